"""Exact per-layer balance planned on the device from the live counts (MoonEP-style): the ``exact`` balancer.

What MoonEP (MoonshotAI/MoonEP; vLLM #52101, Megatron-LM #6274 / #7450, torchtitan #4751) does per
micro-batch and MoE layer: the EP group's expert counts are exchanged on the GPU, a GPU planner gives every
rank of the NVLink domain *exactly* its quota of token-expert rows by duplicating hot experts onto ranks with
spare capacity inside the domain, the duplicated weights are pulled over NVLink after the plan (overlapped
with the rest of the layer's compute) and their gradients are reduced back to the home rank. Exact quotas
make every receive size known without a host read. This module is our own planner for that contract,
written in torch ops only (no ``.item()``, ``nonzero`` or boolean indexing: nothing waits for the device),
so the runtime (``placement/exact.py``) runs it on the device and the simulator runs the same function
on numpy inputs (``plan_exact_stage``).

The plan, per node (duplicates never leave a node): the node's rows split as evenly as integers allow over
its ranks (``quota_R``). Each owner keeps its coldest experts up to its quota; the rest of its rows (its
hottest experts first) form the node's *excess* stream, the under-quota ranks' missing rows the *deficit*
stream. Both streams are laid out in rank order and cut against each other by prefix sums: the rows of an
excess piece that fall in a deficit interval run on that rank, as a duplicate of the expert. Each node's
excess equals its deficit, so the cut never crosses a node. Cost: O(E log E + E R) elementwise work in ~15
kernels; E = 128, R = 64: an [E, R] overlap of 8 K entries.

Legend: E experts, R ranks (of one EP group), K = E / R experts owned per rank, S source ranks (== R).
"""

from __future__ import annotations

import numpy as np
import torch


def quota_R(load_E: torch.Tensor, num_ranks: int, ranks_per_node: int) -> torch.Tensor:
    """Rows each rank must receive: its node's rows (the node's owned experts' loads) split as evenly as
    integers allow, the first ranks of the node taking the remainder. Device tensor, no sync."""
    R, G = num_ranks, ranks_per_node
    node_N = load_E.reshape(R // G, -1).sum(1)
    local_G = torch.arange(G, device=load_E.device)
    q_NG = node_N[:, None] // G + (local_G[None, :] < (node_N % G)[:, None]).to(node_N.dtype)
    return q_NG.reshape(R)


def host_quota_R(total_rows: int, num_ranks: int) -> np.ndarray:
    """``quota_R`` of a group within one node from its row total alone (host-known: the sources' pair counts)."""
    return total_rows // num_ranks + (np.arange(num_ranks) < total_rows % num_ranks).astype(np.int64)


def _segments(len_X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = torch.cumsum(len_X, 0)
    return hi - len_X, hi


def plan_exact(load_E: torch.Tensor, num_ranks: int, ranks_per_node: int) -> torch.Tensor:
    """``assign_ER``: rows of expert e computed on rank r, every rank at exactly its ``quota_R``.

    ``load_E``: the EP group's rows per expert (int64, on any device), experts owned contiguously
    (``e // K``). Rows of expert e run on its owner and on ranks of the owner's node (duplicates)."""
    E, R = load_E.shape[0], num_ranks
    if E % R or R % ranks_per_node:
        raise ValueError(f"exact plan: {E} experts over {R} ranks in nodes of {ranks_per_node}: not divisible")
    K = E // R
    load_E = load_E.to(torch.int64)
    device = load_E.device
    quota = quota_R(load_E, R, ranks_per_node)
    owner_E = torch.arange(E, device=device) // K
    # each owner's experts coldest first (stable: ties by expert id); the owner keeps a prefix up to its quota
    by_load = torch.argsort(load_E, stable=True)
    order = by_load[torch.argsort(owner_E[by_load], stable=True)]  # owner-major, coldest first
    load_O = load_E[order]  # the experts in that order
    before_O = torch.cumsum(load_O.reshape(R, K), 1).reshape(E) - load_O  # the owner's colder rows
    keep_O = torch.minimum(load_O, (quota[owner_E[order]] - before_O).clamp_min(0))
    excess_O = load_O - keep_O
    deficit_R = (quota - load_E.reshape(R, K).sum(1)).clamp_min(0)
    # cut the excess stream (owner order) by the deficit stream (rank order): overlap of [lo, hi) intervals
    a_lo, a_hi = _segments(excess_O)
    b_lo, b_hi = _segments(deficit_R)
    moved_OR = (torch.minimum(a_hi[:, None], b_hi[None, :]) - torch.maximum(a_lo[:, None], b_lo[None, :])).clamp_min(0)
    assign_OR = moved_OR
    assign_OR = assign_OR.scatter_add(1, owner_E[order][:, None], keep_O[:, None])
    return torch.empty_like(assign_OR).index_copy_(0, order, assign_OR)


def replicas_R(assign_ER: torch.Tensor) -> torch.Tensor:
    """Duplicates each rank hosts: experts it computes rows of without owning them."""
    E, R = assign_ER.shape
    owned_ER = (torch.arange(E, device=assign_ER.device)[:, None] // (E // R)) == torch.arange(R, device=assign_ER.device)
    return ((assign_ER > 0) & ~owned_ER).sum(0)


def rank_rows(assign_ER: torch.Tensor, rank: int, rows: int, load_E: torch.Tensor) -> torch.Tensor:
    """Positions, in the group's expert-sorted pairs, of the ``rows`` rows ``rank`` computes, in its compute
    order (by expert; within an expert the pairs after those of lower ranks). ``rows`` is the rank's quota,
    host-known: a static shape, so no sync. Pairs of expert e sit at ``[start_e, start_e + load_e)``."""
    a_E = assign_ER[:, rank]
    end_E = torch.cumsum(a_E, 0)
    below_E = torch.cumsum(assign_ER, 1)[:, rank] - a_E  # rows of e on lower ranks
    start_E = torch.cumsum(load_E, 0) - load_E
    j = torch.arange(rows, device=assign_ER.device)
    e_j = torch.searchsorted(end_E, j, right=True).clamp_max(assign_ER.shape[0] - 1)
    return start_E[e_j] + below_E[e_j] + j - (end_E - a_E)[e_j]


def plan_exact_stage(load_MLE: np.ndarray, num_ranks: int, ranks_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """The simulator's use of ``plan_exact``: every (micro-step, layer), on the host. Returns
    (``assign_MLER``, ``slots_MLRC``): owned experts first, then the rank's duplicates (-1 pads)."""
    M, L, E = load_MLE.shape
    R, K = num_ranks, E // num_ranks
    assign = np.stack([plan_exact(torch.as_tensor(l, dtype=torch.int64), R, ranks_per_node).numpy()
                       for l in load_MLE.reshape(M * L, E)])  # [ML, E, R]
    owned_ER = (np.arange(E)[:, None] // K) == np.arange(R)[None, :]
    dup = (assign > 0) & ~owned_ER[None]
    C = K + max(int(dup.sum(axis=1).max()) if dup.size else 0, 0)
    slots = np.full((M * L, R, C), -1, dtype=np.int64)
    slots[:, :, :K] = np.arange(E).reshape(R, K)
    x, e, r = np.nonzero(dup)
    order = np.lexsort((e, r, x))  # by (layer, rank), experts ascending
    x, e, r = x[order], e[order], r[order]
    key = x * R + r
    first = np.searchsorted(key, key)  # first index of each (layer, rank) run
    slots[x, r, K + np.arange(len(key)) - first] = e
    return assign.reshape(M, L, E, R), slots.reshape(M, L, R, C)
