#!/usr/bin/env bash
# The test command: builds or reuses the environment from pyproject.toml, then runs pytest.
#   ./scripts/run_tests.sh [pytest args]
# Two pytest-xdist workers (TEST_WORKERS, default 2; 0 runs in one process, as does a python without xdist):
# the suite is mostly subprocesses and gloo ranks that wait on each other, so two at a time fill 2 cores
# (docs/testing.md). A worker takes a whole file (module-scoped fixtures built once), costliest first (tests/conftest.py).
# The vLLM tests need the CPU engine's own venv: built or reused here by scripts/setup_vllm_cpu.sh
# (VLLM_VENV, default ~/.cache/titan_foremoe/vllm-venv, kept between CI runs). TITAN_FOREMOE_SKIP_VLLM=1 skips them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(scripts/ensure_env.sh)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "${TITAN_FOREMOE_SKIP_VLLM:-0}" != "1" ] && [ -z "${TITAN_FOREMOE_VLLM_PYTHON:-}" ]; then
    TITAN_FOREMOE_VLLM_PYTHON=$(scripts/setup_vllm_cpu.sh ${VLLM_VENV:+"$VLLM_VENV"})
    export TITAN_FOREMOE_VLLM_PYTHON
fi
WORKERS=${TEST_WORKERS:-2}
parallel=()
if [ "$WORKERS" != "0" ] && "$PYTHON" -c 'import xdist' 2>/dev/null; then
    parallel=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
fi
# A test whose failure names a rank killed by SIGABRT / SIGSEGV / SIGBUS (torchrun's "exitcode: -6", the
# launcher's "killed by SIGABRT", torch.multiprocessing's "terminated with signal") runs once more: the known gloo
# heap crash of multi-rank CPU jobs (docs/testing.md); any other failure, a wrong figure included, fails at once.
reruns=()
if "$PYTHON" -c 'import pytest_rerunfailures' 2>/dev/null; then
    reruns=(--reruns 1 --only-rerun 'exitcode: -(6|7|11)\b|killed by SIG(ABRT|SEGV|BUS)|terminated with signal SIG(ABRT|SEGV|BUS)')
fi
exec "$PYTHON" -m pytest -q -p no:cacheprovider --durations=20 "${parallel[@]}" "${reruns[@]}" "$@" tests
