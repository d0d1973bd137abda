"""Plan the next stage in a background thread while rollout / the current stage runs."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from .balancers import plan_stage


class StagePlanner:
    """One worker thread; ``submit`` returns a Future[StagePlan].

    The planner is numpy-bound, so it mostly holds the GIL: keep it on a stage
    boundary that has slack (rollout), not inside the training hot loop.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="foremoe-planner")

    def submit(self, balancer: str, loads_MLSE, topology, config=None, cost=None, *, then=None, **kw) -> Future:
        """Plan in the worker; with ``then``, the future holds ``then(plan)`` computed in the same worker
        (the runtime compiles this rank's tables there: ``then=lambda p: (p, runtime.compile(p, loads))``)."""
        finish = then or (lambda plan: plan)
        return self._pool.submit(lambda: finish(plan_stage(balancer, loads_MLSE, topology, config, cost, **kw)))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "StagePlanner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
