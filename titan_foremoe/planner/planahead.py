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

    def call(self, fn, *args) -> Future:
        """``fn(*args)`` in the worker, after everything submitted before (one worker: FIFO); ``fn`` and ``args``
        picklable in process mode."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "StagePlanner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plans_lazily(balancer: str) -> bool:
    """Whether the synchronous recompute stage plans only its first micro-step before it starts, the rest in the
    planner's worker while it runs (``placement/lazy.py``): foremoe, whose plan is sequential over micro-steps with
    the previous one's slots as its only state (``plan_stage(resume_slots_LRC=)``). The EPLB family decides a
    whole optimizer step at its first micro-step (the rest is an even split, ~0), so it stays planned at once;
    ``reactive`` / ``exact`` plan inside each layer."""
    return balancer.startswith("foremoe")
