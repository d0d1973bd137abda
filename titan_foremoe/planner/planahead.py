"""Plan the next stage in the background (a thread, or a worker process) while rollout / the current stage runs."""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor

from .balancers import plan_stage

PLANNER_MODES = ("thread", "process")


def _plan_then(balancer, loads_MLSE, topology, config, cost, then, kw):
    plan = plan_stage(balancer, loads_MLSE, topology, config, cost, **kw)
    return then(plan) if then is not None else plan


class StagePlanner:
    """One worker; ``submit`` returns a Future[StagePlan] (or of ``then(plan)``).

    The planner is numpy-bound and holds the GIL for much of its run, which slows the training thread of the
    same process (``benchmarks/bench_planner_gil.py``). ``mode = "process"`` plans in one spawned worker process
    instead: the training thread then only pays for pickling the loads out and the plan and tables back
    (Qwen3-30B-A3B, R = 64, 16 micro-steps: ~50 MB each way, tens of ms per stage) and the worker's start-up
    once (~seconds, at the first submit). ``then`` must then be picklable (a module-level function or a
    ``functools.partial`` of one).
    """

    def __init__(self, mode: str = "thread") -> None:
        if mode not in PLANNER_MODES:
            raise ValueError(f"planner mode must be one of {PLANNER_MODES}, got {mode!r}")
        self.mode = mode
        self._pool = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="foremoe-planner") if mode == "thread"
                      else ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")))

    def submit(self, balancer: str, loads_MLSE, topology, config=None, cost=None, *, then=None, **kw) -> Future:
        """Plan in the worker; with ``then``, the future holds ``then(plan)`` computed in the same worker
        (the runtime compiles this rank's tables there: ``placement_plans.PlanTables``)."""
        return self._pool.submit(_plan_then, balancer, loads_MLSE, topology, config, cost, then, kw)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "StagePlanner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
