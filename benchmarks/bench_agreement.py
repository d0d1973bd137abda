#!/usr/bin/env python
"""Cost of the once-per-stage plan and split agreement (``PlacementRuntime.check_agreement``) on one rank, without
the collectives (one all-to-all of R int64, one all-reduce of 4 int64): the hashing of the plan arrays and the
per-peer split hashes, at a named model shape (synthetic loads, ``foremoe``):

    python benchmarks/bench_agreement.py --ranks 64 --micro-steps 16
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_foremoe.distributed import agreement  # noqa: E402
from titan_foremoe.placement.runtime import plan_digests  # noqa: E402
from titan_foremoe.placement.tables import compile_stage, stage_splits  # noqa: E402
from titan_foremoe.planner import PlannerConfig, Topology, plan_stage  # noqa: E402
from titan_foremoe.planner.synthetic import synthetic_loads  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_30b_a3b")
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--micro-steps", type=int, default=16)
    a = p.parse_args(argv)
    M, R = a.micro_steps, a.ranks
    loads = synthetic_loads(a.model, M, R, 4, 0)
    plan = plan_stage("foremoe", loads, Topology.from_ranks(R, a.ranks_per_node), PlannerConfig(spare_slots=2),
                      micro_steps_per_step=4)
    tables = compile_stage(plan, loads, R // 2)
    L = loads.shape[1]
    c0, t0 = time.process_time(), time.perf_counter()
    items = plan_digests(plan, loads)
    agreement.total_digest(items)  # what the all-reduce carries
    t1 = time.perf_counter()
    send, recv = stage_splits(tables, R)
    agreement.peer_hash_R(send.reshape(-1, R)), agreement.peer_hash_R(recv.reshape(-1, R))
    t2, c2 = time.perf_counter(), time.process_time()
    print(f"L={L} M={M} R={R}: plan digests {1e3*(t1-t0):.0f} ms, splits + peer hashes {1e3*(t2-t1):.0f} ms wall, "
          f"{1e3*(c2-c0):.0f} ms CPU total; arrays hashed {(plan.assign_MLER.nbytes + loads.nbytes)/2**20:.0f} MiB; "
          f"split matrix {send.nbytes/2**20:.1f} MiB x 2; all-to-all {R * 8} B, all-reduce 32 B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
