#!/usr/bin/env bash
# One-command GPU check for a single lent GPU (docs/gpu.md): scripts/gpu_check.sh [--cpu] --out DIR
# Needs torch and numpy only (no torchtitan, no package registry). PYTHON picks the interpreter; else the
# project's .venv when present, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" scripts/gpu_check.py "$@"
