"""Tests run on CPU; torchtitan's CPU patches go in before anything imports it.

Under pytest-xdist (``scripts/run_tests.sh`` runs ``-n 2 --dist loadgroup``, docs/testing.md) the slowest tests
start first, so that the two workers do not end on one long test, and the tests of a module that shares a
module-scoped fixture (an engine, a reference run) stay on one worker, so that the fixture is built once.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torchtitan_patches  # noqa: E402

torchtitan_patches.apply_all()

# Node-id prefixes of the slowest tests, slowest first (CI's --durations on an idle machine, docs/testing.md). A
# stale list only costs time: every test still runs.
SLOW_FIRST = (
    "tests/test_vllm_rl.py",
    "tests/test_compile_placement.py",
    "tests/test_checkpoint_history.py::test_branch_from_older_step",
    "tests/test_checked_streams.py::test_selftest_cpu_rungs",
    "tests/test_vllm_engine.py",
    "tests/test_exact_placement.py",
    "tests/test_ep_fsdp.py",
    "tests/test_dry_run.py",
    "tests/test_recovery.py",
    "tests/test_run_train.py",
    "tests/test_relayout_rl.py",
    "tests/test_placement_runtime.py",
    "tests/test_hf_job.py",
    "tests/test_checked_streams.py",
    "tests/test_launch.py",
    "tests/test_job_safety.py",
)


def _slow_rank(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(SLOW_FIRST) if nodeid.startswith(prefix)), len(SLOW_FIRST))


def _shares_a_module_fixture(item) -> bool:
    """Whether the test uses a module- or session-scoped fixture of this suite (not pytest's own, such as
    ``tmp_path_factory``)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope in ("module", "session") and d.baseid
               for defs in info.name2fixturedefs.values() for d in defs)


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook reads the groups
def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # not an xdist worker: collection order
        return
    items.sort(key=lambda item: _slow_rank(item.nodeid))  # stable: collection order otherwise
    for item in items:
        if _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
