#!/usr/bin/env bash
# Build (or reuse) a torch 2.11 environment shaped like the lent GPU machine, and print its python.
#   scripts/ensure_env_torch211.sh [VENV]     (default: ~/.cache/titan_foremoe/torch211-venv, kept between CI runs)
# What the device has (torch 2.11.0 with its CUDA libraries, transformers, safetensors, tensorboard, pytest), plus
# the wheels a device call carries (scripts/gpu_wheels.txt, --no-deps): so CI's torch 2.11 job also checks that
# list. titan_foremoe itself is not installed: run with PYTHONPATH=<repository> (tests/test_torch211.py does).
# Cost: ~1 min and 4.6 GB the first time (the CUDA wheel and its libraries from the index; no CPU wheel of 2.11
# is there), a stamp check after.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_lib.sh
VENV=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/titan_foremoe/torch211-venv}
TORCH_VERSION=2.11.0
stamp="$VENV/.titan_foremoe_torch211.sha256"
want=$(cat "$0" scripts/gpu_wheels.txt | sha256sum | cut -d' ' -f1)
check='import importlib.metadata as m, sys; [m.version(p) for p in ("transformers", "safetensors", "tensorboard", "pytest", "tyro", "torchdata", "spmd_types")]; sys.exit(0 if m.version("torch").split("+")[0] == "'$TORCH_VERSION'" and m.version("torchtitan") == "0.3.0" else 1)'
if venv_current "$VENV" "$stamp" "$want" "$check"; then
    echo "$VENV/bin/python"
    exit 0
fi
venv_create "$VENV" "the torch $TORCH_VERSION environment"
echo "installing torch==$TORCH_VERSION and the GPU machine's packages into $VENV (~1 min)" >&2
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" transformers safetensors tensorboard pytest 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
"$VENV/bin/python" -m pip install -q --no-deps -r scripts/gpu_wheels.txt 2>&1 | grep -v "^WARNING: Location" >&2 || true
"$VENV/bin/python" -c "$check" >&2
echo "$want" > "$stamp"
echo "$VENV/bin/python"
