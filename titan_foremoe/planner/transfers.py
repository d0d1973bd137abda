"""Transfer schedule: the weight moves a micro-step needs, from the slots before it.

A slot whose expert was already resident on that rank costs nothing. Otherwise the
weights come from the copy that is cheapest under the cost model: a copy on the
destination's node (NVLink) if any, else the previous owner (inter-node).
"""

from __future__ import annotations

import numpy as np

from .types import TRANSFER_DTYPE, CostModel, Topology


def schedule_transfers(
    prev_slots_LRC: np.ndarray,
    slots_LRC: np.ndarray,
    prev_owner_LE: np.ndarray,
    topology: Topology,
    micro_step: int,
    cost: CostModel | None = None,
) -> np.ndarray:
    """Moves needed to go from prev_slots_LRC to slots_LRC (structured TRANSFER_DTYPE rows).

    prev_slots_LRC holds only copies that are valid for this micro-step (stale
    replicas must already be cleared to -1 by the caller).
    """
    cost = cost or CostModel()
    L, R, C = slots_LRC.shape
    E = prev_owner_LE.shape[1]
    present = (slots_LRC[:, :, :, None] == prev_slots_LRC[:, :, None, :]).any(axis=3)
    need = (slots_LRC >= 0) & ~present
    l, r, c = np.nonzero(need)
    out = np.zeros(len(l), dtype=TRANSFER_DTYPE)
    if len(l) == 0:
        return out
    e = slots_LRC[l, r, c]
    node_R = topology.node_of_rank_R()
    prev_host_LER = np.zeros((L, E + 1, R), dtype=bool)
    pl, pr, pc = np.nonzero(prev_slots_LRC >= 0)
    prev_host_LER[pl, prev_slots_LRC[pl, pr, pc], pr] = True
    cand = prev_host_LER[l, e]  # [T, R]
    cand[np.arange(len(l)), r] = False
    near = cand & (node_R[None, :] == node_R[r][:, None])
    owner = prev_owner_LE[l, e]
    # cheapest path first: a same-node copy rides NVLink; otherwise the owner sends over IB.
    t_intra, t_inter = cost.transfer_s(False), cost.transfer_s(True)
    src = np.where(near.any(axis=1) & (t_intra <= t_inter), near.argmax(axis=1), owner)
    out["micro_step"] = micro_step
    out["layer"] = l
    out["expert"] = e
    out["src_rank"] = src
    out["dst_rank"] = r
    out["inter_node"] = node_R[src] != node_R[r]
    return out


def first_host_LE(slots_LRC: np.ndarray, num_experts: int) -> np.ndarray:
    """Lowest rank holding each expert (-1 if none): the fallback source when no owner map exists."""
    L, R, C = slots_LRC.shape
    host = np.zeros((L, num_experts + 1, R), dtype=bool)
    l, r, c = np.nonzero(slots_LRC >= 0)
    host[l, slots_LRC[l, r, c], r] = True
    host = host[:, :num_experts]
    return np.where(host.any(axis=2), host.argmax(axis=2), -1)


def keep_primary_copies(slots_LRC: np.ndarray, num_experts: int) -> np.ndarray:
    """Clear every copy but the lowest-rank one of each expert (stale after an optimizer step)."""
    first = first_host_LE(slots_LRC, num_experts)
    L = slots_LRC.shape[0]
    e = np.where(slots_LRC >= 0, slots_LRC, 0)
    r = np.arange(slots_LRC.shape[1])[None, :, None]
    is_primary = (slots_LRC >= 0) & (first[np.arange(L)[:, None, None], e] == r)
    # keep one slot per (rank, expert): the first one
    out = np.where(is_primary, slots_LRC, -1)
    return out
