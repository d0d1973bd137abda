"""Tokens each data-parallel rank will send to each expert, per micro-step and layer.

A routed position counts once for each of its top-k experts; positions without
a route (padding, a sequence's last token) never count. Shape suffixes follow
the planner: M micro-steps, L MoE layers, S source ranks, E experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import collectives
from ..routing_log import RoutingLog


def sequence_loads(log: RoutingLog) -> torch.Tensor:
    """``[layers, experts]`` token-expert counts of all sequences in ``log``."""
    L, E = log.num_layers, log.num_experts
    if log.live_BTX is not None:  # a hole's experts are unknown until the recompute's router picks them
        raise ValueError("routing log has positions without a route (-1): fill them from the recompute's live "
                         "routes (RoutingLog.fill_holes) before counting loads")
    routes_NLK = log.experts_BTXK[log.route_mask_BT()].to(torch.int64)
    flat = (routes_NLK + E * torch.arange(L)[None, :, None]).flatten()
    return torch.bincount(flat, minlength=L * E).view(L, E)


def micro_step_loads(log: RoutingLog, schedule: list[list[int]]) -> torch.Tensor:
    """``loads_MLE`` for this rank: ``schedule[m]`` lists the log's sequences run in micro-step m."""
    return torch.stack([sequence_loads(log.select(seqs)) for seqs in schedule])


def gather_source_loads(loads_MLE: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``loads_MLSE``: every source rank of the EP group, by all-gather (S = 1 without a group).

    The sources of an EP group are its EP ranks (different EP groups run different batches and plan
    from their own loads), so the gather is over ``group`` only.
    """
    if group is None or not dist.is_initialized():
        return loads_MLE[:, :, None]
    return collectives.all_gather(loads_MLE, group).permute(1, 2, 0, 3).contiguous()
