"""EPLB-style hierarchical placement (our own implementation of DeepSeek EPLB's policy).

Given per-expert loads, fill all R x C physical slots:
1. pack expert groups to nodes with balanced packing (equal group count per node);
2. inside each node, replicate: every extra physical slot goes to the expert with the
   largest load per replica;
3. pack the node's physical replicas (weight = load / replicas) to its ranks, C each.
Tokens are then split evenly over replicas (split.even_split). If the groups do not
divide over the nodes, the policy falls back to one global "node", as EPLB does.
"""

from __future__ import annotations

import numpy as np

from .packing import balanced_packing
from .types import Topology


def replicate(weight_BI: np.ndarray, num_phy: int) -> np.ndarray:
    """Replica count per item: start at 1, add to argmax(load / count) until num_phy."""
    B, I = weight_BI.shape
    if num_phy < I:
        raise ValueError(f"replicate: {num_phy} physical slots cannot hold {I} experts")
    cnt = np.ones((B, I), dtype=np.int64)
    bi = np.arange(B)
    w = weight_BI.astype(np.float64)
    for _ in range(num_phy - I):
        j = (w / cnt).argmax(axis=1)
        cnt[bi, j] += 1
    return cnt


def eplb_slots(
    weight_LE: np.ndarray, topology: Topology, slots_per_rank: int, num_groups: int | None = None
) -> np.ndarray:
    """slots_LRC: the logical expert in every physical slot under the hierarchical policy."""
    L, E = weight_LE.shape
    R, C = topology.num_ranks, slots_per_rank
    G = num_groups or E
    if E % G:
        raise ValueError(f"eplb: {E} experts do not divide into {G} groups")
    N, P = topology.num_nodes, topology.ranks_per_node
    if G % N:
        N, P = 1, R  # EPLB's global fallback
    w = weight_LE.astype(np.float64)
    gsize = E // G
    node_LG, _ = balanced_packing(w.reshape(L, G, gsize).sum(axis=2), N)
    node_LE = np.repeat(node_LG, gsize, axis=1)
    per_node = E // N
    log_LE = np.argsort(node_LE * E + np.arange(E)[None, :], axis=1, kind="stable")  # experts grouped by node
    B = L * N
    w_node = np.take_along_axis(w, log_LE, axis=1).reshape(B, per_node)
    phy = P * C
    cnt = replicate(w_node, phy)
    cum = np.cumsum(cnt, axis=1)
    local_of_phy = (cum[:, None, :] <= np.arange(phy)[None, :, None]).sum(axis=2)  # [B, phy]
    bi = np.arange(B)[:, None]
    phy_w = w_node[bi, local_of_phy] / cnt[bi, local_of_phy]
    pack, slot = balanced_packing(phy_w, P)
    expert_of_phy = log_LE.reshape(B, per_node)[bi, local_of_phy]
    rank = pack + (np.arange(B) % N)[:, None] * P
    slots = np.full((L, R, C), -1, dtype=np.int64)
    lidx = np.repeat(np.arange(L), N)[:, None]
    slots[np.broadcast_to(lidx, rank.shape), rank, slot] = expert_of_phy
    return slots
