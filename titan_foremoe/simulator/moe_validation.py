"""Held-back checks of a measured calibration against NVIDIA's fused-MoE rows (aiconfigurator-core).

The fused-MoE coefficients are fitted on the balanced rows of ``fused_moe.train_shapes`` only; every
row of the other shapes (Qwen3-30B-A3B's among them) is held back. Each row is rebuilt as the collector
ran it (``collector_sampling``): rank 0 of ``moe_ep_size`` runs experts [0, E / ep) over all T x top-k
routed pairs of the batch (vLLM's EP path: scanned pairs = T x top-k). Power-law rows: the mean over
the collector's 5 draws.

Legend: R measured rows, D draws, K rank 0's local experts.
"""

from __future__ import annotations

import numpy as np

from .calibration import Calibration
from .collector_sampling import rank0_counts_DK

QWEN3 = "2048x768x128x8"


def _rows(cal: Calibration, distribution: str, shapes: list[str] | None) -> np.ndarray:
    fm = cal.raw["fused_moe"]
    rows = np.asarray(fm["rows"][distribution], dtype=np.float64)
    names = np.array([f"{int(r[0])}x{int(r[1])}x{int(r[2])}x{int(r[3])}" for r in rows])
    keep = np.isin(names, fm["held_back_shapes"] if shapes is None else shapes)
    return rows[keep]


def row_forward_ms(cal: Calibration, row, distribution: str, draws: int = 5, seed: int = 0) -> float:
    """Simulated fused-MoE forward of one measured row (D, F, E, top-k, ep, T, ...)."""
    D, F, E, k, ep, T = (int(x) for x in row[:6])
    n_DK = rank0_counts_DK(distribution, T, E, k, ep, draws=draws, seed=seed)
    return float(cal.fused(D, F).forward_ms(n_DK, np.full(len(n_DK), T * k)).mean())


def moe_forward_errors(cal: Calibration, distribution: str = "balanced", shapes: list[str] | None = None) -> dict:
    """Relative error (simulated - measured) / measured over held-back rows (default: all held-back shapes)."""
    rows = _rows(cal, distribution, shapes)
    sim_R = np.array([row_forward_ms(cal, r, distribution) for r in rows])
    err_R = (sim_R - rows[:, 6]) / rows[:, 6]
    return {"rows": len(rows), "median_abs_err": float(np.median(np.abs(err_R))),
            "worst_abs_err": float(np.max(np.abs(err_R))), "err_R": err_R, "rows_R": rows}


def power_law_ratio_errors(cal: Calibration, shapes: list[str] | None = None, alpha: str = "1.2",
                           draws: int = 5, seed: int = 0) -> dict:
    """Measured vs simulated latency ratio power_law_<alpha> / balanced at the same shape, EP and tokens;
    error = simulated ratio / measured ratio - 1."""
    bal = {tuple(r[:6]): r[6] for r in _rows(cal, "balanced", shapes)}
    pl = [r for r in _rows(cal, f"power_law_{alpha}", shapes) if tuple(r[:6]) in bal]
    meas_R = np.array([r[6] / bal[tuple(r[:6])] for r in pl])
    sim_R = np.array([row_forward_ms(cal, r, f"power_law_{alpha}", draws, seed) / row_forward_ms(cal, r, "balanced")
                      for r in pl])
    err_R = sim_R / meas_R - 1.0
    return {"rows": len(pl), "median_abs_err": float(np.median(np.abs(err_R))),
            "worst_abs_err": float(np.max(np.abs(err_R))), "measured_ratio_R": meas_R, "simulated_ratio_R": sim_R,
            "err_R": err_R, "rows_R": np.array(pl)}
