#!/usr/bin/env python
"""Cost of run-time placement at cluster scale, in one process (no distributed run).

For each EP size R: synthetic loads of a named model shape, the ``foremoe`` stage plan, and one rank's
tables (``placement/tables.py``) for every micro-step, all layers:

    python benchmarks/bench_placement_scale.py --model qwen3_30b_a3b --ranks 8,64 --ranks-per-node 8 \
        --spare-slots 2 --micro-steps 8 --out DIR
    python benchmarks/bench_placement_scale.py --model deepseek_v3 --ranks 64,128,256 ... --out DIR

Writes ``DIR/summary.json`` (per R: ``plan_ms_per_microstep`` median wall, ``plan_cpu_ms_per_microstep``
process CPU time per micro-step, ``tables_ms_per_microstep`` one rank all layers median,
``tables_cpu_ms_per_microstep`` its process CPU time, ``tables_bytes_per_microstep`` one rank, ``bank_bytes_per_rank`` (bf16, both banks, all layers),
``max_over_mean`` of the plan; with ``--owner-policy balanced`` also the owner moves per step, one rank's
re-layout metadata time and the busiest rank's re-layout bytes with ``--efsdp``) and ``DIR/scale.png`` (time vs R). Times are the best of ``--repeats``
runs per micro-step on one thread; on a shared machine wall times inflate with the load, CPU times much
less: compare figures from one run.
An R that the model's experts do not divide over (EP degree must divide the expert count) is reported
as skipped with the reason. Exit code 2 on bad arguments.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_v] = "1"

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_foremoe.placement.tables import compile_micro_step, stale_micro_steps  # noqa: E402
from titan_foremoe.planner import PlannerConfig, Topology, plan_stage  # noqa: E402
from titan_foremoe.placement.relayout import RowLayout, row_moves  # noqa: E402
from titan_foremoe.planner.metrics import (  # noqa: E402
    max_over_mean_M,
    owner_move_bytes_ZR,
    relayout_bytes_per_move,
    step_owners_of,
)
from titan_foremoe.planner.owners import contiguous_owners, physical_rows_LE  # noqa: E402
from titan_foremoe.planner.synthetic import MODEL_SHAPES, synthetic_loads  # noqa: E402

BF16_BYTES = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODEL_SHAPES), default="qwen3_30b_a3b")
    p.add_argument("--ranks", default="64", help="comma-separated EP sizes, e.g. 8,64,128")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--spare-slots", type=int, default=2)
    p.add_argument("--micro-steps", type=int, default=8)
    p.add_argument("--micro-steps-per-step", type=int, default=4, help="micro-steps per optimizer step")
    p.add_argument("--responses-per-rank", type=int, default=4, help="responses per rank per micro-step")
    p.add_argument("--layers", type=int, default=0, help="use only the first N MoE layers (0: all)")
    p.add_argument("--rank", type=int, default=-1, help="the rank whose tables are timed (-1: the middle one)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--owner-policy", choices=("contiguous", "balanced"), default="contiguous",
                   help="balanced: owners re-placed per optimizer step (tables follow the layout; re-layout timed)")
    p.add_argument("--owner-hysteresis", type=float, default=0.2)
    p.add_argument("--efsdp", type=int, default=1, help="FSDP ranks sharding each EP rank's experts (re-layout)")
    p.add_argument("--compare", default="", help="another run's summary.json to draw in the same plot")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        a.rank_list = [int(r) for r in a.ranks.split(",") if r]
    except ValueError:
        p.error(f"--ranks must be comma-separated integers, got {a.ranks!r}")
    for name in ("ranks_per_node", "micro_steps", "micro_steps_per_step", "responses_per_rank", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not a.rank_list or min(a.rank_list) < 1:
        p.error("--ranks needs at least one positive size")
    if a.spare_slots < 0 or a.layers < 0:
        p.error("--spare-slots and --layers must be >= 0")
    if a.micro_steps % a.micro_steps_per_step:
        p.error(f"--micro-steps {a.micro_steps} must be a multiple of --micro-steps-per-step")
    return a


def _best_ms(fn, repeats: int) -> tuple[float, float, object]:
    """(best wall ms, best process-CPU ms, result) over ``repeats`` runs."""
    wall = cpu = float("inf")
    out = None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        cpu = min(cpu, (time.process_time() - c0) * 1e3)
        wall = min(wall, (time.perf_counter() - t0) * 1e3)
    return wall, cpu, out


def bench_one(a: argparse.Namespace, R: int) -> dict:
    shape = MODEL_SHAPES[a.model]
    E = shape.num_experts
    if E % R:
        return {"skipped": f"{E} experts do not divide over {R} EP ranks (the EP degree must divide the experts)"}
    if R % min(a.ranks_per_node, R):
        return {"skipped": f"{R} ranks do not divide into nodes of {a.ranks_per_node}"}
    P = min(a.ranks_per_node, R)
    topo = Topology.from_ranks(R, P)
    M = a.micro_steps
    loads = synthetic_loads(a.model, M, R, a.responses_per_rank, a.seed)
    if a.layers:
        loads = np.ascontiguousarray(loads[:, : a.layers])
    L = loads.shape[1]
    cfg = PlannerConfig(spare_slots=a.spare_slots, owner_policy=a.owner_policy, owner_hysteresis=a.owner_hysteresis)
    plan_ms = np.full(M, np.inf)
    cpu_ms = np.inf
    plan = None
    for _ in range(a.repeats):
        c0 = time.process_time()
        plan = plan_stage("foremoe", loads, topo, cfg, micro_steps_per_step=a.micro_steps_per_step)
        cpu_ms = min(cpu_ms, (time.process_time() - c0) * 1e3 / M)
        plan_ms = np.minimum(plan_ms, plan.plan_ms_M)
    rank = a.rank if a.rank >= 0 else R // 2
    if rank >= R:
        raise SystemExit(f"--rank {rank} outside 0..{R - 1}")
    stale_M = stale_micro_steps(M, a.micro_steps_per_step)
    tr = plan.transfers_T
    table_ms, table_cpu_ms, table_bytes = [], [], []
    layout_MLE = plan.layout_owner_MLE
    t = None
    for m in range(M):
        def compile_m(m=m, prev=t):  # in order: a micro-step's bank rows follow the previous one's
            return compile_micro_step(
                plan.slots_MLRC[m], plan.assign_MLER[m], loads[m], rank, P,
                prev_slots_LRC=plan.slots_MLRC[m - 1] if m else None, moves_T=tr[tr["micro_step"] == m],
                stale=bool(stale_M[m]), row_LE=physical_rows_LE(layout_MLE[m], R),
                prev_rows_LC=prev.bank_row_LC if m else None,
            )
        ms, cpu, t = _best_ms(compile_m, a.repeats)
        table_ms.append(ms)
        table_cpu_ms.append(cpu)
        table_bytes.append(t.nbytes)
    # banks hold every rank's largest count of non-owned slots (the spare slots for foremoe), both banks
    K = E // R
    slot_owner = np.take_along_axis(layout_MLE[:, :, None, :], np.maximum(plan.slots_MLRC, 0).reshape(M, L, 1, -1),
                                    axis=3).reshape(plan.slots_MLRC.shape)
    nonown = (plan.slots_MLRC >= 0) & (slot_owner != np.arange(R)[None, None, :, None])
    bank_rows = max(int(nonown.sum(-1).max()), a.spare_slots)
    expert_bytes = 3 * shape.dim * shape.moe_hidden_dim * BF16_BYTES
    rank_load = plan.rank_load_MLR.astype(np.float64)
    mean = rank_load.mean(-1)
    return {
        **_relayout_cost(a, plan, R, rank, expert_bytes / BF16_BYTES),
        "ranks": R, "ranks_per_node": P, "layers": L, "experts": E, "top_k": shape.top_k,
        "slots_per_rank": E // R + a.spare_slots, "micro_steps": M, "timed_rank": rank,
        "tokens_per_rank_per_microstep": float(loads.sum(axis=(1, 3)).mean() / (L * shape.top_k)),
        "plan_ms_per_microstep": float(np.median(plan_ms)),
        "plan_cpu_ms_per_microstep": float(cpu_ms),
        "tables_ms_per_microstep": float(np.median(table_ms)),
        "tables_cpu_ms_per_microstep": float(np.median(table_cpu_ms)),
        "tables_bytes_per_microstep": int(np.median(table_bytes)),
        "bank_rows": int(bank_rows),
        "bank_bytes_per_rank": int(2 * bank_rows * expert_bytes * L),
        "max_over_mean": float(np.mean(rank_load.max(-1) / np.where(mean > 0, mean, 1))),
        "static_max_over_mean": float(_static_max_over_mean(loads, R)),
    }


def _relayout_cost(a: argparse.Namespace, plan, R: int, rank: int, expert_params: float) -> dict:
    """Balanced owners: one rank's re-layout metadata (``row_moves`` over the moved layers) per step, and the
    busiest rank's bytes (weights + AdamW moments, 1/efsdp of the rows), from the contiguous start."""
    if a.owner_policy != "balanced":
        return {}
    owner_ZLE = step_owners_of(plan)
    Z, L, E = owner_ZLE.shape
    K, F = E // R, a.efsdp
    # the group's rows as FSDP shards them: EP rank r, efsdp rank f holds chunk f of r's K rows (padded chunks)
    c = -(-K // F)
    per_f = np.minimum(np.maximum(K - c * np.arange(F), 0), c)
    row0_G = (np.arange(R)[:, None] * K + np.arange(F)[None, :] * c).ravel()
    layout = RowLayout(row0_G, np.tile(per_f, R), np.zeros(R * F, dtype=np.int64), rank * F)
    prev, meta_ms, moved = contiguous_owners(L, E, R), [], []
    for z in range(Z):
        old, new = physical_rows_LE(prev, R), physical_rows_LE(owner_ZLE[z], R)
        layers = np.nonzero((owner_ZLE[z] != prev).any(axis=1))[0]

        def moves(old=old, new=new, layers=layers):
            for layer in layers:
                src_row_E = np.empty(E, dtype=np.int64)
                src_row_E[new[layer]] = old[layer]
                row_moves(layout, src_row_E)

        meta_ms.append(_best_ms(moves, a.repeats)[1])
        moved.append(int((owner_ZLE[z] != prev).sum()))
        prev = owner_ZLE[z]
    bytes_ZR = owner_move_bytes_ZR(owner_ZLE, contiguous_owners(L, E, R), R, relayout_bytes_per_move(expert_params, F))
    return {"owner_moves_per_step": moved, "relayout_meta_cpu_ms_per_step": meta_ms,
            "relayout_bytes_per_rank_per_step": bytes_ZR.max(axis=1).tolist(), "efsdp": F}


def _static_max_over_mean(loads_MLSE: np.ndarray, R: int) -> float:
    """Static (contiguous owner) placement: expert e's tokens all land on rank e // (E / R)."""
    load_MLE = loads_MLSE.sum(axis=2)
    M, L, E = load_MLE.shape
    return float(max_over_mean_M(load_MLE.reshape(M, L, R, E // R).swapaxes(2, 3)).mean())


def plot(runs: list[tuple[str, dict]], path: Path, title: str) -> None:
    """Plan and tables CPU time vs R, one line style per model (``runs``: (label, by_ranks))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=100)
    for style, (label, results) in zip(("-", "--", ":"), runs):
        ok = [(int(R), r) for R, r in results.items() if "skipped" not in r]
        if not ok:
            continue
        Rs = [R for R, _ in ok]
        ax.plot(Rs, [r["plan_cpu_ms_per_microstep"] for _, r in ok], "o" + style, color="C0",
                label=f"plan, {label}")
        ax.plot(Rs, [r["tables_cpu_ms_per_microstep"] for _, r in ok], "s" + style, color="C1",
                label=f"one rank's tables, {label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("EP ranks R")
    ax.set_ylabel("CPU ms per micro-step (all layers)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for R in a.rank_list:
        results[str(R)] = r = bench_one(a, R)
        if "skipped" in r:
            print(f"R={R:5d}  skipped: {r['skipped']}")
        else:
            print(f"R={R:5d}  plan {r['plan_ms_per_microstep']:7.2f} ms (cpu {r['plan_cpu_ms_per_microstep']:7.2f})  "
                  f"tables {r['tables_ms_per_microstep']:6.2f} ms (cpu {r['tables_cpu_ms_per_microstep']:6.2f}) {r['tables_bytes_per_microstep'] / 2**20:6.3f} MiB  "
                  f"banks {r['bank_bytes_per_rank'] / 2**30:6.2f} GiB  max/mean {r['max_over_mean']:.4f} "
                  f"(static {r['static_max_over_mean']:.3f})")
            if "owner_moves_per_step" in r:
                print(f"         owner moves per step {r['owner_moves_per_step']}  re-layout metadata (one rank) "
                      f"{', '.join(f'{x:.2f}' for x in r['relayout_meta_cpu_ms_per_step'])} ms cpu  busiest rank "
                      f"{', '.join(f'{x / 2**20:.0f}' for x in r['relayout_bytes_per_rank_per_step'])} MiB "
                      f"(efsdp {r['efsdp']})")
    summary = {"model": a.model, "spare_slots": a.spare_slots, "micro_steps": a.micro_steps,
               "micro_steps_per_step": a.micro_steps_per_step, "responses_per_rank": a.responses_per_rank,
               "seed": a.seed, "by_ranks": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    runs = [(a.model, results)]
    if a.compare:
        other = json.loads(Path(a.compare).read_text())
        runs.append((other["model"], other["by_ranks"]))
    plot(runs, out / "scale.png", f"foremoe, {a.spare_slots} spare slots, {a.ranks_per_node} ranks/node")
    return 0


if __name__ == "__main__":
    sys.exit(main())
