"""Benchmark figures of a StagePlan (straggler ratio, transfers, planning time)."""

from __future__ import annotations

import numpy as np

from .types import StagePlan


def max_over_mean_M(assign_MLER: np.ndarray) -> np.ndarray:
    """Max rank load / mean rank load, per layer, averaged over layers: one value per micro-step."""
    load = assign_MLER.sum(axis=2).astype(np.float64)  # [M, L, R]
    mean = load.mean(axis=2)
    ratio = np.where(mean > 0, load.max(axis=2) / np.where(mean > 0, mean, 1.0), 1.0)
    return ratio.mean(axis=1)


def summarize(plan: StagePlan) -> dict:
    """summary.json entry. Transfers are counted per rank per micro-step *per layer*
    (each rank has S spare slots in every layer), so a plan that refills every spare
    slot of every layer in every micro-step scores S."""
    M, L, E, R = plan.assign_MLER.shape
    r = max_over_mean_M(plan.assign_MLER)
    n_tr = len(plan.transfers_T)
    return {
        "mean_max_over_mean": float(r.mean()),
        "p95_max_over_mean": float(np.percentile(r, 95)),
        "transfers_per_rank_per_microstep": n_tr / (M * L * R),
        "intra_node_transfer_fraction": float((~plan.transfers_T["inter_node"]).mean()) if n_tr else 1.0,
        "plan_ms_median": float(np.median(plan.plan_ms_M)),
        "plan_ms_max": float(np.max(plan.plan_ms_M)),
        "transfers_total": n_tr,
        "micro_steps": M,
    }
