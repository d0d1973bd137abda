#!/usr/bin/env bash
# Print the path of a python that can import titan_foremoe (and its test tools).
# Uses the current python if it already can; otherwise creates or refreshes the
# virtual environment $VENV (default: ./.venv) from pyproject.toml. All pip output
# goes to stderr so callers can capture the path.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
check='import titan_foremoe, torchtitan, torch, tomli, tensorboard, pytest, xdist, pytest_rerunfailures, hypothesis, transformers, tokenizers, safetensors, math_verify, pyarrow, scipy'
if [ -z "${VENV:-}" ] && python3 -c "$check" >/dev/null 2>&1 && \
   python3 -c 'import titan_foremoe, sys; sys.exit(0 if titan_foremoe.__file__.startswith(sys.argv[1]) else 1)' "$ROOT" 2>/dev/null; then
    command -v python3
    exit 0
fi
VENV=${VENV:-$ROOT/.venv}
stamp="$VENV/.pyproject.sha256"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating virtual environment $VENV" >&2
    python3 -m venv "$VENV" >&2
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$VENV/bin/python" -c "$check" >/dev/null 2>&1 || \
   ! "$VENV/bin/python" -c 'import titan_foremoe, sys; sys.exit(0 if titan_foremoe.__file__.startswith(sys.argv[1]) else 1)' "$ROOT" 2>/dev/null; then
    echo "installing titan_foremoe and its dependencies into $VENV (pyproject.toml)" >&2
    "$VENV/bin/python" -m pip install -q -e "$ROOT[dev]" >&2
    echo "$want" > "$stamp"
fi
echo "$VENV/bin/python"
