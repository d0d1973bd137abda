"""One MoE layer of any shape on one EP group: dispatch, experts, combine, forward and backward (ms).

For comparing with published per-layer measurements (``simulate_cluster.py --layer``). The group's
N x T tokens route T x top-k pairs per rank; tokens per expert follow the aiconfigurator collector's
``balanced`` or ``power_law_<a>`` sampling (``collector_sampling``, busiest rank first, mean of 5 draws),
and the layer waits for the busiest rank. Experts: the calibration's expert model (measured: fused-MoE
fit, scanned pairs = the rank's dispatched pairs; backward = forward x measured GEMM backward / forward);
a shared expert (``shared_ffn``) runs every token of the rank as two dense bf16 GEMMs (measured rows).
Dispatch / combine: the bytes the busiest rank sends or receives (bf16 activations, one row per pair
that leaves the rank), NVLink inside a node (measured NCCL alltoall curve), IB across nodes; the
backward moves the same bytes again (gradient of combine, then of dispatch).

Legend: D draws, K local experts of the busiest rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .calibration import Calibration
from .collector_sampling import rank0_counts_DK
from .timing import DeviceCosts


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    moe_ffn: int
    experts: int
    top_k: int
    shared_ffn: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden", "moe_ffn", "experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.experts:
            raise ValueError(f"--top-k {self.top_k} exceeds --experts {self.experts}")
        if self.shared_ffn < 0:
            raise ValueError(f"--shared-ffn must be >= 0, got {self.shared_ffn}")


def _a2a_ms(link: DeviceCosts, nvlink_bytes: float, ib_bytes: float) -> float:
    s = link.a2a_s_MLPR(np.array([nvlink_bytes, ib_bytes], dtype=np.float64)[None, None, :, None])
    return float((link.a2a_latency_us * 1e-6 + s.max()) * 1e3)


def layer_times(cal: Calibration, link: DeviceCosts, shape: LayerShape, tokens_per_rank: int, ep: int,
                gpus_per_node: int = 8, distribution: str = "balanced", draws: int = 5, seed: int = 0,
                kernel: str = "grouped_mm") -> dict:
    """Per-layer times (ms) of the busiest rank; see the module doc for what is charged."""
    if tokens_per_rank < 1 or ep < 1 or gpus_per_node < 1:
        raise ValueError("--tokens-per-rank, --ep and --gpus-per-node must be >= 1")
    if shape.experts % ep:
        raise ValueError(f"--experts {shape.experts} do not divide over --ep {ep}")
    if ep > gpus_per_node and ep % gpus_per_node:
        raise ValueError(f"--ep {ep} spans partial nodes of {gpus_per_node} GPUs")
    n_DK = rank0_counts_DK(distribution, tokens_per_rank * ep, shape.experts, shape.top_k, ep, draws, seed)
    cost = cal.curve(shape.hidden, shape.moe_ffn, kernel)
    fwd = float(cost.rank_ms(n_DK, backward=False).mean())
    bwd = float(cost.rank_ms(n_DK, backward=True).mean())
    shared_f = shared_b = 0.0
    if shape.shared_ffn:
        g = cal.fused(shape.hidden, shape.shared_ffn).gemm if "gemm_table" in cal.raw else None
        if g is None:
            raise ValueError(f"calibration {cal.path} has no gemm_table for the shared expert")
        shared_f = float(g.swiglu_ms(tokens_per_rank, shape.hidden, shape.shared_ffn, False))
        shared_b = float(g.swiglu_ms(tokens_per_rank, shape.hidden, shape.shared_ffn, True))
    # Busiest rank: receives its local pairs from the other ranks, sends its own pairs to them.
    local = min(gpus_per_node, ep)
    recv = float(n_DK.sum(axis=1).mean())
    send = float(tokens_per_rank * shape.top_k)
    act = shape.hidden * link.act_bytes
    same, other = (local - 1) / ep, (ep - local) / ep  # remote peers' share of uniformly spread pairs
    nv = max(send, recv) * same * act
    ib = max(send, recv) * other * act
    a2a = _a2a_ms(link, nv, ib) if ep > 1 else 0.0
    fwd_d = {"dispatch": a2a, "experts": fwd + shared_f, "combine": a2a}
    bwd_d = {"dispatch": a2a, "experts": bwd + shared_b, "combine": a2a}
    fwd_d["total"] = sum(fwd_d.values())
    bwd_d["total"] = sum(bwd_d.values())
    return {"experts_forward_ms": fwd, "shared_expert_forward_ms": shared_f, "forward_ms": fwd_d,
            "backward_ms": bwd_d, "busiest_rank_pairs": recv, "calibration": cal.path,
            "expert_kernel": kernel if "fused_moe" in cal.raw else "grouped_gemm_table",
            "distribution": distribution}
