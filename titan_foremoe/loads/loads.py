"""Tokens each data-parallel rank will send to each expert, per micro-step and layer.

A routed position counts once for each of its top-k experts; positions without
a route (padding, a sequence's last token) never count. Shape suffixes follow
the planner: M micro-steps, L MoE layers, S source ranks, E experts.
"""

from __future__ import annotations

import numpy as np
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


def row_loads(log: RoutingLog) -> torch.Tensor:
    """``loads_BLE`` int32: each sequence's own ``sequence_loads``, one row at a time (O(T X K) memory per row).

    Counted once per step, before the sequence schedule: the rows' sums are its expert signatures, and each
    micro-step's loads are then a sum of its rows (``micro_step_loads(..., loads_BLE)``), not a second pass over
    the routes. Host cost: one bincount per row, O(tokens x layers x top-k) per step."""
    L, E = log.num_layers, log.num_experts
    if log.live_BTX is not None:
        raise ValueError("routing log has positions without a route (-1): fill them from the recompute's live "
                         "routes (RoutingLog.fill_holes) before counting loads")
    offsets = (E * np.arange(L, dtype=np.int64))[None, :, None]
    out = np.zeros((log.num_sequences, L, E), dtype=np.int32)
    for b, n in enumerate(log.lengths_B.tolist()):
        ids = log.experts_BTXK[b, : max(n - 1, 0)].numpy().astype(np.int64) + offsets
        out[b] = np.bincount(ids.reshape(-1), minlength=L * E).reshape(L, E)
    return torch.from_numpy(out)


def micro_step_loads(log: RoutingLog, schedule: list[list[int]], loads_BLE: torch.Tensor | None = None) -> torch.Tensor:
    """``loads_MLE`` for this rank: ``schedule[m]`` lists the log's sequences run in micro-step m (may be empty).
    ``loads_BLE``: the log's ``row_loads`` when the caller has them (each micro-step is then a sum of rows)."""
    if loads_BLE is not None:
        return torch.stack([loads_BLE[list(seqs)].sum(0, dtype=torch.int64) for seqs in schedule])
    return torch.stack([sequence_loads(log.select(seqs)) for seqs in schedule])


def gather_source_loads(loads_MLE: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``loads_MLSE``: every source rank of the EP group, by all-gather (S = 1 without a group).

    The sources of an EP group are its EP ranks (different EP groups run different batches and plan
    from their own loads), so the gather is over ``group`` only.
    """
    if group is None or not dist.is_initialized():
        return loads_MLE[:, :, None]
    return collectives.all_gather(loads_MLE, group).permute(1, 2, 0, 3).contiguous()
