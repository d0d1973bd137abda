#!/usr/bin/env bash
# One-command GPU check for a single lent GPU (docs/gpu.md): scripts/gpu_check.sh [--cpu] [--only STAGES] --out DIR
# Stages (scripts/gpu_check.py STAGES): kernels, the trainer at world size 1, two ranks on one GPU, one
# Qwen3-30B-A3B MoE layer, CUDA IPC, the engine fleet's IPC weight sync, vLLM's sleep mode (SKIP without vLLM); each PASS / FAIL / SKIP with its figures, each under its own time limit.
# PYTHON picks the interpreter; else the project's .venv when present, else python3. Where that python cannot
# import torchtitan and a wheel folder is here (GPU_WHEELS, default gpu_wheels/, built by scripts/gpu_wheels.sh
# and carried with the device call), the wheels go into a venv that sees the system's packages
# (--system-site-packages: torch, transformers, ...) with --no-index: the device has no package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
WHEELS=${GPU_WHEELS:-gpu_wheels}
if ! "$PYTHON" -c 'import torchtitan' >/dev/null 2>&1 && [ -d "$WHEELS" ]; then
    venv=${GPU_CHECK_VENV:-${TMPDIR:-/tmp}/titan_foremoe_gpu_check_venv}
    if [ ! -x "$venv/bin/python" ]; then
        "$PYTHON" -m venv --system-site-packages "$venv" >&2
    fi
    "$venv/bin/python" -m pip install -q --no-index --no-deps --find-links "$WHEELS" -r scripts/gpu_wheels.txt >&2
    PYTHON=$venv/bin/python
    echo "gpu_check: torchtitan and its pure-Python dependencies installed from $WHEELS into $venv" >&2
fi
export PYTHON  # the trainer stages launch run_train.sh with it
export PYTHONUNBUFFERED=1
exec "$PYTHON" scripts/gpu_check.py "$@"
