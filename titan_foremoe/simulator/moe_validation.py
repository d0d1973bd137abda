"""Held-back check: the simulator's expert forward against NVIDIA's measured fused-MoE rows.

A measured calibration is fitted on bf16 GEMM rows only; the fused-MoE rows it carries
(``moe_rows``, from aiconfigurator-core) are never fitted on, so they are held back whole.
Balanced rows: every expert gets T * top_k / E tokens (T tokens on a rank), a rank runs E / ep experts.

Legend: R = measured rows.
"""

from __future__ import annotations

import numpy as np

from .calibration import Calibration


def moe_forward_errors(cal: Calibration, distribution: str = "balanced") -> dict:
    """Relative error (simulated - measured) / measured of each measured row of one distribution."""
    rows = [r for r in cal.raw["moe_rows"]["rows"] if r["distribution"] == distribution]
    s = cal.raw["moe_rows"]["shape"]
    curve = cal.curve(s["hidden_size"], s["inter_size"])
    tokens_R = np.array([r["num_tokens"] for r in rows], dtype=np.float64)
    k_R = np.array([s["num_experts"] // r["moe_ep_size"] for r in rows], dtype=np.float64)
    n_R = tokens_R * s["topk"] / s["num_experts"]
    sim_R = curve.per_expert_ms(n_R, k_R, backward=False) * k_R
    meas_R = np.array([r["latency"] for r in rows], dtype=np.float64)
    err_R = (sim_R - meas_R) / meas_R
    return {"rows": len(rows), "median_abs_err": float(np.median(np.abs(err_R))),
            "worst_abs_err": float(np.max(np.abs(err_R))), "err_R": err_R, "tokens_R": tokens_R, "k_R": k_R}
