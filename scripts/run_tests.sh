#!/usr/bin/env bash
# The test command: builds or reuses the environment from pyproject.toml, then runs pytest.
#   ./scripts/run_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(scripts/ensure_env.sh)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@" tests
