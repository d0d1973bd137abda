#!/usr/bin/env python
"""How much a background stage plan slows the training thread of the same process (the GIL).

The trainer plans the update stage (plan + this rank's tables) in a thread while the recompute stage runs
(``train/placement_plans.py``, ``planner/planahead.StagePlanner``). The planner is numpy-bound and holds the
GIL for much of its run; the training thread, between kernel launches, runs Python and small torch ops that
need it too. This measures a launch-bound loop (tiny torch ops + Python per "layer", as the trainer does
between CUDA launches) alone and while a planner keeps working at the Qwen3-30B-A3B load (synthetic loads,
``foremoe``, R EP ranks), in alternating windows (the machine may be shared: medians of paired windows):

    python benchmarks/bench_planner_gil.py --ranks 64 --micro-steps 8 --windows 6 --out DIR

Modes: ``thread`` (today's planner thread) and ``process`` (plan and tables in a spawned worker process; the
parent only pickles the loads out and the plan and tables back). Writes ``DIR/summary.json``: per mode the
loop's iterations per second alone and beside the planner, the slowdown, and the plan's wall time.
Caveat: on a machine with fewer free cores than 2 the planner also competes for a core, which a GPU node (tens
of cores per 8 GPUs) does not; ``--pin`` puts the loop and the planner on different CPUs, so thread and process
modes differ by the GIL alone (other processes on the machine slow both modes alike: paired windows).
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_foremoe.planner import PlannerConfig, Topology  # noqa: E402
from titan_foremoe.planner.planahead import StagePlanner  # noqa: E402
from titan_foremoe.planner.synthetic import synthetic_loads  # noqa: E402
from titan_foremoe.train.placement_plans import PlanTables  # noqa: E402


def training_loop(seconds: float) -> tuple[float, float]:
    """Iterations per second of a launch-bound loop (8 tiny torch ops and some Python per iteration), and the
    share of the wall time its thread ran (the rest: waiting for the GIL or for a core)."""
    x = torch.randn(8, 8)
    w = torch.randn(8, 8)
    meta = {"layer": 0, "rows": [0] * 8}
    n, t0, c0 = 0, time.perf_counter(), time.thread_time()
    while (now := time.perf_counter()) - t0 < seconds:
        y = torch.relu(x @ w) + x
        y = y * 0.5 - y.mean()
        x = y.clamp(-1, 1)
        meta["layer"] = (meta["layer"] + 1) % 48
        meta["rows"] = [r + 1 for r in meta["rows"]]
        n += 1
    return n / (now - t0), (time.thread_time() - c0) / (now - t0)


def measure(mode: str, args, loads) -> dict:
    if args.pin:  # the planner's thread or worker process inherits CPU 1 when it is created (at the warm-up)
        os.sched_setaffinity(0, {1})
    planner = StagePlanner(mode)  # the trainer's: plan and this rank's tables per submit
    job = ("foremoe", loads, Topology.from_ranks(args.ranks, args.ranks_per_node), PlannerConfig(spare_slots=2))
    kw = {"micro_steps_per_step": args.micro_steps_per_step, "then": PlanTables(loads, args.ranks // 2, False, False)}
    planner.submit(*job, **kw).result()  # warm-up (the process imports numpy and the planner)
    if args.pin:  # the training loop (this thread, and the feeder started from it) on CPU 0
        os.sched_setaffinity(0, {0})
    busy = threading.Event()
    plan_s: list[float] = []

    def keep_planning():
        while busy.is_set():
            t0 = time.perf_counter()
            plan, tables = planner.submit(*job, **kw).result()
            plan_s.append(time.perf_counter() - t0)

    alone, beside, ran_alone, ran_beside = [], [], [], []
    for _ in range(args.windows):
        rate, ran = training_loop(args.window_s)
        alone.append(rate)
        ran_alone.append(ran)
        busy.set()
        feeder = threading.Thread(target=keep_planning)  # waits on the future (releases the GIL) in process mode
        feeder.start()
        time.sleep(0.05)
        rate, ran = training_loop(args.window_s)
        beside.append(rate)
        ran_beside.append(ran)
        busy.clear()
        feeder.join()
    planner.close()
    slow = [1 - b / a for a, b in zip(alone, beside)]
    return {"iters_per_s_alone": statistics.median(alone), "iters_per_s_beside_planner": statistics.median(beside),
            "slowdown": statistics.median(slow), "slowdown_per_window": slow,
            "loop_ran_share_alone": statistics.median(ran_alone), "loop_ran_share_beside": statistics.median(ran_beside),
            "plan_and_tables_s_median": statistics.median(plan_s) if plan_s else None, "plans": len(plan_s)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_30b_a3b")
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--micro-steps", type=int, default=8)
    p.add_argument("--micro-steps-per-step", type=int, default=4)
    p.add_argument("--responses-per-rank", type=int, default=4)
    p.add_argument("--modes", default="thread,process")
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--window-s", type=float, default=3.0)
    p.add_argument("--pin", action="store_true",
                   help="training loop on CPU 0, planner thread or process on CPU 1 (Linux): the two never share a "
                        "core, as on a GPU node, so thread vs process differs by the GIL only")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    loads = synthetic_loads(args.model, args.micro_steps, args.ranks, args.responses_per_rank, seed=0)
    res = {"model": args.model, "ranks": args.ranks, "micro_steps": args.micro_steps,
           "loads_bytes": int(loads.nbytes), "cpus": os.cpu_count(),
           "load_average": os.getloadavg(), "pinned": args.pin}
    for mode in args.modes.split(","):
        res[mode] = measure(mode, args, loads)
        r = res[mode]
        print(f"{mode}: loop {r['iters_per_s_alone']:.0f} it/s alone, {r['iters_per_s_beside_planner']:.0f} beside "
              f"the planner: slowdown {100 * r['slowdown']:.1f}%; loop thread ran {100 * r['loop_ran_share_alone']:.0f}% / "
              f"{100 * r['loop_ran_share_beside']:.0f}% of the wall time (plan + tables {r['plan_and_tables_s_median']:.2f} s, "
              f"{r['plans']} plans)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
