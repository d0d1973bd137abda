"""Check the simulator's compute model against benchmarks/bench_moe_runtime.py measurements.

Rebuilds the benchmark's loads exactly (same seeded response order, token cap, layers),
plans them with the same ``plan_stage`` calls, and predicts each balancer's straggler
grouped-GEMM time (forward, summed over layers, median micro-step) from a calibration
measured on the same CPU. Compared as ratios to ``static`` (absolute CPU times drift 2x
between sessions); the error is predicted ratio / measured ratio - 1.
"""

from __future__ import annotations

import numpy as np

from ..planner import PlannerConfig, Topology, plan_stage
from ..planner.trace import load_trace
from .calibration import Calibration


def bench_loads(trace: str, layers: int, responses_per_rank: int, micro_steps: int, max_tokens: int, seed: int,
                ranks: int) -> np.ndarray:
    """loads_MLSE of bench_moe_runtime.build_batches (every rank's share, stacked by source)."""
    experts, offsets, E = load_trace(trace)
    order = np.random.default_rng(seed).permutation(len(offsets) - 1)[: micro_steps * ranks * responses_per_rank]
    out = np.zeros((micro_steps, layers, ranks, E), dtype=np.int64)
    for m in range(micro_steps):
        for r in range(ranks):
            start = (m * ranks + r) * responses_per_rank
            for i in order[start : start + responses_per_rank]:
                routes = experts[offsets[i] : offsets[i + 1]][:max_tokens, :layers].astype(np.int64)
                for layer in range(layers):
                    out[m, layer, r] += np.bincount(routes[:, layer].ravel(), minlength=E)
    return out


def predict(bench_summary: dict, cal: Calibration, trace: str, clock: str = "auto") -> dict:
    """Predicted vs measured straggler expert time per balancer and stage. clock: 'thread' compares with the
    ranks' thread CPU time (``expert_cpu_ms_straggler``), 'wall' with wall time; 'auto': thread where the
    benchmark recorded it."""
    c = bench_summary["config"]
    R = bench_summary["ranks"]
    loads = bench_loads(trace, c["layers"], c["responses_per_rank"], c["micro_steps"], c["max_tokens"], c["seed"], R)
    topo = Topology.from_ranks(R, c["ranks_per_node"] or R)
    curve = cal.curve(c["dim"], c["moe_hidden_dim"])
    history = loads.sum(axis=(0, 2))
    first = next(iter(bench_summary["results"].values()))["recompute"]
    if clock == "auto":
        clock = "thread" if "expert_cpu_ms_straggler" in first else "wall"
    key = "expert_cpu_ms_straggler" if clock == "thread" else "expert_ms_straggler"
    if key not in first:
        raise ValueError(f"the benchmark summary has no {key} (re-run benchmarks/bench_moe_runtime.py)")
    pred, meas = {}, {}
    for name, res in bench_summary["results"].items():
        kw = {"history_LE": history} if name == "eplb_history" else {}
        plan = plan_stage(name, loads, topo, PlannerConfig(spare_slots=c["spare_slots"]), **kw)
        t_MLR = curve.rank_ms(plan.assign_MLER.transpose(0, 1, 3, 2), backward=False)
        pred[name] = float(np.median(t_MLR.max(axis=2).sum(axis=1)))
        meas[name] = {s: float(res[s][key]) for s in ("recompute", "update")}
    out = {}
    for name in pred:
        row = {"predicted_ms": pred[name], "predicted_ratio": pred[name] / pred["static"], "clock": clock}
        for s in ("recompute", "update"):
            ratio = meas[name][s] / meas["static"][s]
            row[f"measured_ms_{s}"] = meas[name][s]
            row[f"measured_ratio_{s}"] = ratio
            row[f"ratio_error_{s}"] = row["predicted_ratio"] / ratio - 1.0
        out[name] = row
    return out
