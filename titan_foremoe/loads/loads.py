"""Tokens each data-parallel rank will send to each expert, per micro-step and layer.

A routed position counts once for each of its top-k experts; positions without
a route (padding, a sequence's last token) never count. Shape suffixes follow
the planner: M micro-steps, L MoE layers, S source ranks, E experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..routing_log import RoutingLog


def sequence_loads(log: RoutingLog) -> torch.Tensor:
    """``[layers, experts]`` token-expert counts of all sequences in ``log``."""
    L, E = log.num_layers, log.num_experts
    routes_NLK = log.experts_BTXK[log.route_mask_BT()].to(torch.int64)
    flat = (routes_NLK + E * torch.arange(L)[None, :, None]).flatten()
    return torch.bincount(flat, minlength=L * E).view(L, E)


def micro_step_loads(log: RoutingLog, schedule: list[list[int]]) -> torch.Tensor:
    """``loads_MLE`` for this rank: ``schedule[m]`` lists the log's sequences run in micro-step m."""
    return torch.stack([sequence_loads(log.select(seqs)) for seqs in schedule])


def gather_source_loads(loads_MLE: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``loads_MLSE``: every source rank of the EP group, by all-gather (S = 1 without a group)."""
    if group is None or not dist.is_initialized():
        return loads_MLE[:, :, None]
    parts = [torch.empty_like(loads_MLE) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, loads_MLE.contiguous(), group=group)
    return torch.stack(parts, dim=2)
