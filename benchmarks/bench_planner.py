#!/usr/bin/env python
"""Benchmark expert-placement balancers on a routing trace or synthetic loads.

python benchmarks/bench_planner.py --trace PATH --ranks 8 --ranks-per-node 4 --spare-slots 1 \
    --responses-per-microstep 8 --global-batch 64 --seed 0 \
    --balancers static,eplb_history,eplb_oracle,foremoe --out DIR
python benchmarks/bench_planner.py --synthetic qwen3_30b_a3b --ranks 64 --ranks-per-node 8 \
    --spare-slots 2 --responses-per-microstep 64 --global-batch 512 --steps 2 --out DIR

Writes DIR/summary.json and DIR/<balancer>.npz (responses, assign, plan_ms).
Exit code 2 on bad arguments or a bad trace.
"""

from __future__ import annotations

import os

# Timings are single-core figures: pin every thread pool before numpy loads.
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_v] = "1"

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_foremoe.planner import BALANCERS, CostModel, PlannerConfig, Topology, plan_stage  # noqa: E402
from titan_foremoe.planner.metrics import owner_summary, step_owners_of, summarize  # noqa: E402
from titan_foremoe.planner.synthetic import MODEL_SHAPES, synthetic_loads  # noqa: E402
from titan_foremoe.planner.trace import load_trace, loads_from_trace, schedule_responses  # noqa: E402

try:  # torch is optional here; if it is importable make sure it also runs on one thread
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="routing trace .npz (experts, offsets)")
    src.add_argument("--synthetic", choices=sorted(MODEL_SHAPES), help="synthetic skewed loads for a model shape")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--spare-slots", type=int, default=1)
    p.add_argument("--responses-per-microstep", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--balancers", default="static,eplb_history,eplb_oracle,foremoe")
    p.add_argument("--owner-policy", choices=("contiguous", "balanced"), default="contiguous",
                   help="owner policy of the 'foremoe' balancer (foremoe_balanced / foremoe_contiguous fix it)")
    p.add_argument("--efsdp", type=int, default=1,
                   help="ranks sharding each expert (FSDP): each moves 1/efsdp of a re-laid-out expert's rows")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps to generate in --synthetic mode")
    p.add_argument("--timing-repeats", type=int, default=3,
                   help="plan each stage N times and keep the fastest time per micro-step")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    for name in ("ranks", "ranks_per_node", "responses_per_microstep", "global_batch", "steps", "timing_repeats",
                 "efsdp"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.spare_slots < 0:
        p.error("--spare-slots must be >= 0")
    a.balancer_list = [b for b in a.balancers.split(",") if b]
    unknown = [b for b in a.balancer_list if b not in BALANCERS]
    if unknown or not a.balancer_list:
        p.error(f"unknown balancer(s) {unknown}; choose from {sorted(BALANCERS)}")
    if a.ranks % a.ranks_per_node:
        p.error(f"--ranks {a.ranks} does not divide into nodes of --ranks-per-node {a.ranks_per_node}")
    if a.responses_per_microstep % a.ranks:
        p.error(f"--responses-per-microstep {a.responses_per_microstep} must be a multiple of --ranks {a.ranks}")
    if a.global_batch % a.responses_per_microstep:
        p.error(f"--global-batch {a.global_batch} must be a multiple of --responses-per-microstep")
    return a


def build_loads(a: argparse.Namespace):
    """(loads_MLSE, responses_MB)."""
    if a.trace:
        experts, offsets, E = load_trace(a.trace)
        if E % a.ranks:
            E = -(-E // a.ranks) * a.ranks  # pad with never-used experts so E divides over ranks
        resp = schedule_responses(len(offsets) - 1, a.global_batch, a.responses_per_microstep, a.seed)
        return loads_from_trace(experts, offsets, resp, a.ranks, E), resp
    M = (a.global_batch // a.responses_per_microstep) * a.steps
    loads = synthetic_loads(a.synthetic, M, a.ranks, a.responses_per_microstep // a.ranks, a.seed)
    resp = np.arange(M * a.responses_per_microstep, dtype=np.int64).reshape(M, a.responses_per_microstep)
    return loads, resp


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        topo = Topology.from_ranks(a.ranks, a.ranks_per_node)
        loads, resp = build_loads(a)
        cfg = PlannerConfig(spare_slots=a.spare_slots, owner_policy=a.owner_policy)
        mps = a.global_batch // a.responses_per_microstep
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        summary = {
            "config": {k: v for k, v in vars(a).items() if k != "balancer_list"},
            "shape": dict(zip(("micro_steps", "layers", "source_ranks", "experts"), map(int, loads.shape))),
            "cost_model": vars(CostModel()),
        }
        for b in a.balancer_list:
            plan = plan_stage(b, loads, topo, cfg, micro_steps_per_step=mps)
            for _ in range(a.timing_repeats - 1):  # best of N per micro-step: the CPU is shared
                again = plan_stage(b, loads, topo, cfg, micro_steps_per_step=mps)
                assert np.array_equal(again.assign_MLER, plan.assign_MLER), f"{b} is not deterministic"
                plan.plan_ms_M = np.minimum(plan.plan_ms_M, again.plan_ms_M)
            summary[b] = summarize(plan)
            # owner moves: fp32 weights + AdamW moments of each expert whose owner changes (bf16 expert_bytes)
            summary[b].update(owner_summary(step_owners_of(plan), a.ranks, CostModel().expert_bytes / 2, a.efsdp))
            np.savez(out / f"{b}.npz", responses=resp, assign=plan.assign_MLER.astype(np.int32), plan_ms=plan.plan_ms_M)
            s = summary[b]
            print(f"{b:20s} mean {s['mean_max_over_mean']:.4f} p95 {s['p95_max_over_mean']:.4f} "
                  f"transfers/rank/ustep {s['transfers_per_rank_per_microstep']:.3f} "
                  f"(replicas {s['replica_transfers_per_rank_per_microstep']:.3f}) "
                  f"owner moves/step {np.mean(s['owner_moves_per_step']):.1f} "
                  f"{s['owner_move_bytes_per_rank_mean'] / 2**20:.0f} MB/rank "
                  f"intra {s['intra_node_transfer_fraction']:.2f} plan_ms {s['plan_ms_median']:.3f}")
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
