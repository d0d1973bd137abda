"""Tests run on CPU; torchtitan's CPU patches go in before anything imports it.

Under pytest-xdist (``scripts/run_tests.sh`` runs ``-n 2 --dist loadfile --no-loadscope-reorder``,
docs/testing.md) a worker takes a whole test file at a time, so that a module-scoped fixture (an engine, a
reference run) is built once, and the costliest files start first, so that the two workers do not end on one long
file.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torchtitan_patches  # noqa: E402

torchtitan_patches.apply_all()

# The costliest test files, costliest first (CI's --durations, docs/testing.md). A stale list only costs time:
# every test still runs.
COSTLIEST_FIRST = (
    "tests/test_checked_streams.py",
    "tests/test_torch211.py",
    "tests/test_recovery.py",
    "tests/test_gpu_check.py",
    "tests/test_vllm_fleet.py",
    "tests/test_job_safety.py",
    "tests/test_launch.py",
    "tests/test_vllm_engine.py",
    "tests/test_vllm_rl.py",
    "tests/test_compile_placement.py",
    "tests/test_checkpoint_history.py",
    "tests/test_dry_run.py",
    "tests/test_ep_fsdp.py",
    "tests/test_exact_placement.py",
    "tests/test_run_train.py",
    "tests/test_relayout_rl.py",
    "tests/test_placement_runtime.py",
    "tests/test_hf_job.py",
    "tests/test_crash_lines.py",
    "tests/test_gpu_fleet_stages.py",
)


def _cost_rank(nodeid: str) -> int:
    path = nodeid.split("::")[0]
    return COSTLIEST_FIRST.index(path) if path in COSTLIEST_FIRST else len(COSTLIEST_FIRST)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker: the files in that order (else: collection order)
        items.sort(key=lambda item: _cost_rank(item.nodeid))  # stable: a file's tests keep their order
