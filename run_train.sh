#!/usr/bin/env bash
# Launch titan_foremoe with torchrun, torchtitan-style.
#
#   NGPU=4 CONFIG_FILE=./train_configs/debug_tiny_cpu.toml ./run_train.sh --training.steps=10
#
# NGPU: processes per node (GPUs on CUDA, gloo ranks on CPU); NNODES, NODE_RANK and
# RDZV_ENDPOINT (host:port) for several machines; LOG_RANK: the ranks whose output is shown.
# Extra arguments are config overrides (--section.key=value) passed to every worker.
# With no importable titan_foremoe in the current python, a .venv is built from pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")"

NGPU=${NGPU:-4}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
LOG_RANK=${LOG_RANK:-0}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-localhost:0}
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_tiny_rl.toml"}

PYTHON=${PYTHON:-$(scripts/ensure_env.sh)}

# Refuse a bad config before any worker starts (exit 2, one line naming the key).
"$PYTHON" -m titan_foremoe.config.check "$CONFIG_FILE" --world-size $((NGPU * NNODES)) "$@"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NGPU" \
    --rdzv_backend c10d --rdzv_endpoint="$RDZV_ENDPOINT" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m titan_foremoe.train --job.config_file "$CONFIG_FILE" "$@"
