#!/usr/bin/env bash
# Build the wheel folder carried with a GPU device call (docs/gpu.md): scripts/gpu_wheels.sh [DIR]
# (default: gpu_wheels/, ignored by git). The packages are scripts/gpu_wheels.txt, downloaded without their
# dependencies (all pure Python, ~2 MB); scripts/gpu_check.sh installs them on the device with --no-index.
# Prints DIR and its size. Idempotent: an existing wheel is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-gpu_wheels}
mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --platform any -d "$DIR" -r scripts/gpu_wheels.txt >&2
for w in "$DIR"/*.whl; do
    case "$w" in *-none-any.whl) ;; *) echo "gpu_wheels: $w is not pure Python: it would not install on the device" >&2; exit 1;; esac
done
echo "$DIR $(du -sh "$DIR" | cut -f1) in $(ls "$DIR"/*.whl | wc -l) wheels"
