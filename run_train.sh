#!/usr/bin/env bash
# Launch titan_foremoe with torchrun, torchtitan-style.
#
#   NGPU=4 CONFIG_FILE=./train_configs/debug_tiny_cpu.toml ./run_train.sh --training.steps=10
#
# NGPU: processes per node (GPUs on CUDA, gloo ranks on CPU); NNODES, NODE_RANK and
# RDZV_ENDPOINT (host:port) for several machines; LOG_RANK: the ranks whose output is shown.
# torchrun runs through titan_foremoe.distributed.launch: a node that has not joined after
# [comm] join_timeout_seconds is named in one line by the others, and a multi-node run exits quietly.
# MAX_RESTARTS=N: torchrun restarts the whole worker group up to N times after a failure (a lost rank);
# every restart resumes from the latest complete checkpoint (enable [checkpoint] for that).
# One job per dump folder (a second one is refused, naming the first); the workers end with the launcher, even a
# SIGKILLed one; SIGTERM / Ctrl-C end in one line naming the last complete checkpoint and the resume command
# ([checkpoint] save_on_signal: the workers first finish and save the current step). See docs/failures.md.
# Extra arguments are config overrides (--section.key=value) passed to every worker.
# On CUDA, PYTORCH_CUDA_ALLOC_CONF defaults to expandable_segments:True (a value you set is kept; the launcher sets it).
# With no importable titan_foremoe in the current python, a .venv is built from pyproject.toml.
set -euo pipefail
# The command as typed, with the variables the user set: the launcher names it as the resume command after a
# stop signal (SIGTERM from a scheduler, Ctrl-C).
resume=""
for var in PYTHON NGPU NNODES NODE_RANK RDZV_ENDPOINT LOG_RANK MAX_RESTARTS CONFIG_FILE; do
    if [ -n "${!var+x}" ]; then resume+="$var=$(printf '%q' "${!var}") "; fi
done
# A launcher that knows better (scripts/slurm/train.sbatch: submit again) sets it first.
export TITAN_FOREMOE_RESUME_COMMAND=${TITAN_FOREMOE_RESUME_COMMAND:-"$resume$(printf '%q ' "$0" "$@")"}
# A relative CONFIG_FILE is read from where the user stands, else from the repository (the shipped configs).
if [ -n "${CONFIG_FILE:-}" ] && [[ "$CONFIG_FILE" != /* ]]; then
    if [ -f "$CONFIG_FILE" ]; then
        CONFIG_FILE="$PWD/$CONFIG_FILE"
    elif [ ! -f "$(dirname "$0")/$CONFIG_FILE" ]; then
        echo "config error: CONFIG_FILE $CONFIG_FILE: no such file in $PWD nor in the repository" \
            "$(cd "$(dirname "$0")" && pwd)" >&2
        exit 2
    fi
fi
cd "$(dirname "$0")"

NGPU=${NGPU:-4}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
LOG_RANK=${LOG_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-localhost:0}
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_tiny_rl.toml"}

PYTHON=${PYTHON:-$(scripts/ensure_env.sh)}

# Refuse a bad config (or a resume the checkpoint cannot serve) before any worker starts: exit 2, one line.
# Exit 3: the checkpoint says this job already finished; say so and leave its outputs alone.
# Another live job on the dump folder is refused here (and by the launcher, which holds the folder's lock).
check=0
preflight_err=$(mktemp)
trap 'rm -f "$preflight_err"; exit 130' INT  # Ctrl-C in the pre-flight leaves no temporary file
trap 'rm -f "$preflight_err"; exit 143' TERM
LOCAL_WORLD_SIZE=$NGPU NODE_RANK=$NODE_RANK "$PYTHON" -m titan_foremoe.config.check "$CONFIG_FILE" --world-size $((NGPU * NNODES)) --preflight "$@" \
    2>"$preflight_err" || check=$?
cat "$preflight_err" >&2
line=$(tail -n 1 "$preflight_err")
rm -f "$preflight_err"
trap - INT TERM
if [ "$check" -eq 3 ]; then exit 0; fi
if [ "$check" -ne 0 ]; then
    if [ "$NNODES" -gt 1 ] && [ "$NODE_RANK" -ne 0 ]; then
        # the nodes already waiting at the rendezvous stop at once, instead of after [comm] join_timeout_seconds
        "$PYTHON" -m titan_foremoe.distributed.launch --report-failure "$RDZV_ENDPOINT" "$NODE_RANK" 30 "$line" || true
    fi
    exit "$check"
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# On CUDA the launcher sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for the workers unless the user set
# it, even empty (titan_foremoe/distributed/launch.py, allocator_env; docs/memory.md).
if [ "$MAX_RESTARTS" -gt 0 ]; then
    # torchrun's agent shares its rendezvous TCPStore with the workers by default; that store outlives a
    # failed worker group, so restarted workers read the dead group's keys under the same names (gloo peer
    # addresses -> "Connection refused", satisfied barriers -> hangs). Opting out gives every restart a
    # fresh store hosted by its rank 0 on a fresh MASTER_PORT.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
fi
exec "$PYTHON" -m titan_foremoe.distributed.launch \
    --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NGPU" --max-restarts="$MAX_RESTARTS" \
    --rdzv_backend c10d --rdzv_endpoint="$RDZV_ENDPOINT" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m titan_foremoe.train --job.config_file "$CONFIG_FILE" "$@"
