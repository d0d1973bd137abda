"""Per micro-step placement scalars (TensorBoard): measured rows per rank against the plan, replicas, transfers,
planner time, measured expert time.

Why apart from the trainer: one all-gather and two all-reduces serve every micro-step of an optimizer step, and
the scalars are pure functions of what they gathered. Cost per optimizer step and rank: an all-gather of
``N x 4 x L`` float64 (N micro-steps; Qwen3-30B-A3B, N = 4: 6 KB per rank, R x that received) and two
all-reduces of ``N x 4`` / ``N x 6``; no device sync beyond the expert timing events read once.

Legend: N reports (micro-steps) of one optimizer step, R ranks of the EP group, L MoE layers, E experts.
"""

from __future__ import annotations

import torch

from ..distributed import collectives
from .balance import max_over_mean, rank_load_metrics


def gather_placement_metrics(rt, reports: list, ep_group) -> list[dict[str, float]]:
    """Each report's metrics (``reports``: (micro-step, ``MicroStepReport``) of one optimizer step), gathered over
    the EP group once for all of them."""
    stats = rt.engine.take_stats(drain=True)  # spans still open at the last report: the last micro-step's
    reports[-1][1].transfers.add(stats)
    mine = torch.tensor([[rep.measured_rows_L, rep.planned_rows_L, rep.replicas_L, rep.expert_ms_L]
                         for _, rep in reports], dtype=torch.float64)
    every_RN = collectives.all_gather(mine, ep_group)
    times_N = torch.tensor([[r.transfers.exposed_s, r.transfers.issue_s, r.transfers.seconds_by_path["direct"],
                             r.transfers.seconds_by_path["host"]] for _, r in reports])
    collectives.all_reduce(times_N, collectives.ReduceOp.MAX, ep_group)
    nbytes_N = torch.tensor([[r.transfers.bytes_by_path["intra_node"], r.transfers.bytes_by_path["inter_node"],
                              r.transfers.transfers, r.transfers.local_copies, r.transfers.grad_return_bytes,
                              r.transfers.bytes_by_path["host"]] for _, r in reports], dtype=torch.float64)
    collectives.all_reduce(nbytes_N, group=ep_group)
    return [placement_metrics(rt, m, every_RN[:, i], times_N[i], nbytes_N[i]) for i, (m, _) in enumerate(reports)]


def placement_metrics(rt, m: int, every_R, times, nbytes) -> dict[str, float]:
    """One micro-step's placement scalars from the EP group's gathered rows (``every_R``: [R, 4, L])."""
    measured_RL, planned_RL, replicas_RL, expert_ms_RL = every_R.unbind(1)
    L = measured_RL.shape[1]
    loads_LE = torch.as_tensor(rt.loads_MLSE[m]).sum(1).double()
    maxvio_L = loads_LE.max(-1).values / loads_LE.mean(-1).clamp_min(1e-12) - 1
    metrics = {
        **rank_load_metrics(measured_RL.T),  # what the runtime measured, not the plan
        "placement/planned_max_over_mean": float(max_over_mean(planned_RL.T).mean()),
        "placement/rows_off_plan": float((measured_RL - planned_RL).abs().sum()),
        # conservation, independent of the plan: rows delivered over all ranks vs the pairs the routes hold
        "placement/rows_minus_routed": float((measured_RL.sum(0) - loads_LE.sum(-1)).abs().sum()),
        "placement/max_vio_experts": float(maxvio_L.mean()),
        "placement/replicas": float(replicas_RL.sum()) / L,
        "transfer/bytes_intra_node": float(nbytes[0]),
        "transfer/bytes_inter_node": float(nbytes[1]),
        "transfer/bytes_host": float(nbytes[5]),
        "transfer/moves": float(nbytes[2]),
        "transfer/local_copies": float(nbytes[3]),
        "transfer/grad_return_bytes": float(nbytes[4]),
        "transfer/exposed_s": float(times[0]),
        "transfer/issue_s": float(times[1]),
        "transfer/seconds_direct": float(times[2]),
        "transfer/seconds_host": float(times[3]),
        "placement/plan_ms": float(rt.plan.plan_ms_M[m]),
        **({"placement/count_gather_ms": float(rt.plan.gather_ms_M[m])}  # reactive: the part spent all-gathering
           if hasattr(rt.plan, "gather_ms_M") else {}),
        # measured, not planned: expert compute time per rank (forward; CUDA events / perf_counter)
        "placement/expert_ms_max": float(expert_ms_RL.max(0).values.sum()),
        "placement/expert_ms_mean": float(expert_ms_RL.mean(0).sum()),
        "placement/expert_ms_max_over_mean": float(max_over_mean(expert_ms_RL.T).mean()),
    }
    for layer in range(L):
        metrics[f"placement/layer_{layer}/expert_ms_max"] = float(expert_ms_RL[:, layer].max())
        metrics[f"placement/layer_{layer}/planned_max_rows"] = float(planned_RL[:, layer].max())
        metrics[f"placement/layer_{layer}/max_vio_experts"] = float(maxvio_L[layer])
        metrics[f"placement/layer_{layer}/replicas"] = float(replicas_RL[:, layer].sum())
    return metrics
