#!/usr/bin/env python
"""The synchronous recompute stage's planning on the training thread, before and after ``placement/lazy.py``, at a
named model shape (synthetic loads, foremoe with the trainer's "auto" slot cost of the recompute stage):

* whole: ``plan_stage`` of the whole stage and ``compile_stage`` of this rank's tables, what ``plan_ahead`` and
  ``start_stage`` ran inline for every micro-step before the stage could start;
* lazy: ``plan_lazily`` (micro-step 0 planned and compiled, micro-steps 1.. queued in the planner's worker: what
  the trainer runs); ``--first-layers k``: only micro-step 0's first k layers here, its others queued first (not
  what the trainer runs: see ``placement/lazy.py``). The worker's time per micro-step is what micro-step m - 1
  must outlast for m not to wait.

Best of ``--repeats`` (wall and CPU); time the 3M-addition loop of COMMON.md beside it:

    python benchmarks/bench_lazy_recompute.py --ranks 8 --micro-steps 4
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_foremoe.placement.lazy import plan_lazily  # noqa: E402
from titan_foremoe.placement.tables import compile_stage  # noqa: E402
from titan_foremoe.planner import PlannerConfig, Topology, plan_stage  # noqa: E402
from titan_foremoe.planner.planahead import StagePlanner  # noqa: E402
from titan_foremoe.planner.synthetic import synthetic_loads  # noqa: E402
from titan_foremoe.simulator.models import get_model  # noqa: E402
from titan_foremoe.train.slot_cost import SlotCost  # noqa: E402


def _best(fn, repeats: int) -> tuple[float, float, object]:
    """(best wall ms, best CPU ms, the last result)."""
    wall = cpu = float("inf")
    out = None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return wall * 1e3, cpu * 1e3, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_30b_a3b")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--micro-steps", type=int, default=4)
    p.add_argument("--rows-per-source", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--planner", choices=("thread", "process"), default="thread",
                   help="[balance] planner: a thread shares the GIL with the training thread (the wall time after "
                        "the first submit includes the worker's turns), a process does not")
    p.add_argument("--first-layers", type=int, default=0,
                   help="micro-step 0's layers planned before the stage (0: all, what the trainer does)")
    a = p.parse_args(argv)
    M, R = a.micro_steps, a.ranks
    spec = get_model(a.model)
    loads = synthetic_loads(a.model, M, R, a.rows_per_source, 0)
    topo, cfg = Topology.from_ranks(R, a.ranks_per_node), PlannerConfig(spare_slots=1)
    cost = SlotCost("auto", "h100", spec.dim, spec.moe_hidden).cost_models(loads)[0]["recompute"]
    rank = R // 2
    L = loads.shape[1]
    k = a.first_layers or L

    def whole():
        plan = plan_stage("foremoe", loads, topo, cfg, cost, micro_steps_per_step=M)
        return plan, compile_stage(plan, loads, rank)

    w_wall, w_cpu, (plan, _) = _best(whole, a.repeats)
    with StagePlanner(a.planner) as planner:
        def lazy():
            stage = plan_lazily(planner, "foremoe", loads, topo, cfg, cost, rank, False, False, first_layers=k)
            return stage, time.perf_counter()

        l_wall = l_cpu = float("inf")
        worker_ms = []
        for f in lazy()[0].pending:  # the worker's start-up (once per job, a process: seconds) is not a step's
            f.result()
        for _ in range(a.repeats):
            wall, cpu, (stage, t_end) = _best(lazy, 1)
            l_wall, l_cpu = min(l_wall, wall), min(l_cpu, cpu)
            for f in ([stage.rest] if stage.rest is not None else []) + stage.pending:
                f.result()
            worker_ms.append((time.perf_counter() - t_end) * 1e3 / max(M - k / L, 1))
    print(f"{a.model} L={loads.shape[1]} R={R} M={M}: training thread before (whole stage planned + compiled) "
          f"{w_wall:.1f} ms wall / {w_cpu:.1f} ms CPU; after (micro-step 0's {k} of {L} layers + queue) "
          f"{l_wall:.1f} / {l_cpu:.1f} ms; "
          f"saving {w_wall - l_wall:.1f} ms per RL step; the worker's plan + tables per later micro-step "
          f"{min(worker_ms):.1f} ms (best); plan_ms_M of the whole plan {', '.join(f'{x:.1f}' for x in plan.plan_ms_M)}"
          )
    return 0


if __name__ == "__main__":
    sys.exit(main())
