"""What the reactive balancer puts on each layer's critical path besides the count all-gather: plan + table compile.

One layer, one rank, synthetic skewed counts (Dirichlet 0.5 over experts), median of 20 runs. The all-gather
itself is not here (its cost is the network's and the ranks' skew; the trainer logs it as
``placement/count_gather_ms``).

    python benchmarks/bench_reactive_layer.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from titan_foremoe.placement.tables import compile_micro_step
from titan_foremoe.planner.balancers import plan_stage
from titan_foremoe.planner.types import PlannerConfig, Topology

SHAPES = (  # (name, experts, EP ranks, ranks per node, spare slots, tokens per rank x top-k)
    ("debug_tiny", 8, 4, 4, 1, 64 * 2),
    ("qwen3_30b_a3b EP 64", 128, 64, 8, 2, 4096 * 8),
    ("deepseek_v3 shape EP 256", 256, 256, 8, 2, 4096 * 8),
)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    rng = np.random.default_rng(0)
    for name, E, R, P, S, pairs in SHAPES:
        topo, cfg = Topology.from_ranks(R, P), PlannerConfig(spare_slots=S)
        loads_11SE = rng.multinomial(pairs, rng.dirichlet(np.full(E, 0.5)), size=R)[None, None]
        plan_ms, compile_ms = [], []
        for _ in range(20):
            t0 = time.perf_counter()
            p = plan_stage("reactive", loads_11SE, topo, cfg)
            t1 = time.perf_counter()
            compile_micro_step(p.slots_MLRC[0], p.assign_MLER[0], loads_11SE[0], R // 2, P, prev_slots_LRC=None,
                               moves_T=p.transfers_T, stale=True)
            plan_ms.append((t1 - t0) * 1e3)
            compile_ms.append((time.perf_counter() - t1) * 1e3)
        print(f"{name:28s} E={E:4d} R={R:4d}: plan {np.median(plan_ms):.2f} ms, compile {np.median(compile_ms):.2f} ms "
              f"per layer")


if __name__ == "__main__":
    main()
