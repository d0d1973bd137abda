"""Micro-step level: which hot experts get replicas in the spare slots, and where.

Greedy on the known loads, vectorized over layers: while a layer's straggler is
above the target ceil(mean), move part of one of its experts to the rank with the
most room. A destination that already holds the expert (owner, earlier replica, or a
replica still resident from the previous micro-step) costs nothing; a new replica
costs a weight transfer, so it must take at least ``min_new_tokens`` off the
straggler, and copies fed from the same node score higher (cheaper path).
The result is already an integer split; the token level polishes it.
"""

from __future__ import annotations

import numpy as np

from .types import Topology


def initial_slots(load_LE: np.ndarray, owned_LRK: np.ndarray, resident_LRS: np.ndarray):
    """Owned experts with all their tokens, spare slots holding residents with no tokens."""
    L, R, K = owned_LRK.shape
    slot_exp_LRC = np.concatenate([owned_LRK, resident_LRS], axis=2).astype(np.int64)
    tok_LRC = np.zeros(slot_exp_LRC.shape, dtype=np.int64)
    tok_LRC[:, :, :K] = np.take_along_axis(load_LE, owned_LRK.reshape(L, R * K), axis=1).reshape(L, R, K)
    return slot_exp_LRC, tok_LRC


def slot_positions(slot_exp_LRC: np.ndarray, num_experts: int) -> np.ndarray:
    """pos_LER: slot index of expert e on rank r (-1 if not hosted); row E absorbs empty slots."""
    L, R, C = slot_exp_LRC.shape
    pos = np.full((L, num_experts + 1, R), -1, dtype=np.int64)
    e = np.where(slot_exp_LRC >= 0, slot_exp_LRC, num_experts)
    pos[np.arange(L)[:, None, None], e, np.arange(R)[None, :, None]] = np.arange(C)[None, None, :]
    pos[:, num_experts] = -1
    return pos


def place_replicas(
    load_LE: np.ndarray,
    owned_LRK: np.ndarray,
    resident_LRS: np.ndarray,
    topology: Topology,
    min_new_tokens_L: np.ndarray,
    stay_bonus: float = 0.5,
    node_bonus: float = 0.1,
    max_iters: int | None = None,
    fit_weight: float = 0.01,
    overshoot_weight: float = 0.5,
) -> tuple[np.ndarray, np.ndarray]:
    """Choose replicas for one micro-step (all layers at once).

    load_LE: tokens per expert (summed over sources). owned_LRK: owned experts.
    resident_LRS: expert resident in each spare slot from the previous micro-step (-1 none).
    Returns (slot_exp_LRC, tok_LRC): slot contents and the tokens each slot processes.
    """
    L, E = load_LE.shape
    R, K = owned_LRK.shape[1], owned_LRK.shape[2]
    S = resident_LRS.shape[2]
    N, P = topology.num_nodes, topology.ranks_per_node
    slot_exp, tok = initial_slots(load_LE, owned_LRK, resident_LRS)
    if S == 0:
        return slot_exp, tok
    C = K + S
    load = tok.sum(axis=2)
    T = -(-load.sum(axis=1) // R)  # ceil(mean): the best an integer split can do
    li = np.arange(L)
    node_R = topology.node_of_rank_R()
    active = np.ones(L, dtype=bool)
    min_new = np.maximum(np.asarray(min_new_tokens_L, dtype=np.int64), 1)
    iters = max_iters if max_iters is not None else R * S + 2 * R
    pos = slot_positions(slot_exp, E)  # [L, E+1, R] slot of expert e on rank r, -1 if absent
    for _ in range(iters):
        h = load.argmax(axis=1)
        need = load[li, h] - T
        active &= need > 0
        if not active.any():
            break
        dexp = slot_exp[li, h]  # [L, C] experts on the straggler
        dtok = tok[li, h]
        dpos = pos[li[:, None], np.where(dexp >= 0, dexp, E)]  # [L, C, R]
        hosts = dpos >= 0  # rank already holds a live copy (no transfer)
        free_LRS = tok[:, :, K:] == 0  # spare slots that can be (re)filled
        has_free = free_LRS.any(axis=2)
        cap = T[:, None] - load  # room below target on every rank
        # A straggler that still has a free spare slot may overshoot below the target:
        # it can be refilled later, and the overshoot lets its slot act as a relay
        # (chains h -> r, then k -> h), which 1 spare slot per rank needs to balance.
        give = np.where(has_free[li, h][:, None], dtok, np.minimum(dtok, need[:, None]))
        amt = np.minimum(give[:, :, None], cap[:, None, :])  # [L, C, R]
        relief = np.minimum(amt, need[:, None, None])
        intra = hosts.reshape(L, C, N, P).any(axis=3)[:, :, node_R]  # a copy on the same node
        new_ok = has_free[:, None, :] & (relief >= min_new[:, None, None])
        valid = (dtok[:, :, None] > 0) & (amt > 0) & (hosts | new_ok)
        bonus = np.where(hosts, stay_bonus, np.where(intra, node_bonus, 0.0))
        # Straggler relief first; best fit breaks ties (fill the tightest hole, keep deep
        # holes for the big chunks only they can absorb).
        value = relief * (1.0 + bonus) + overshoot_weight * (amt - relief) - fit_weight * (cap[:, None, :] - amt)
        score = np.where(valid, value, -np.inf)
        flat = score.reshape(L, C * R).argmax(axis=1)
        c, r = np.divmod(flat, R)
        go = active & valid[li, c, r]
        if not go.any():
            break
        x = np.where(go, amt[li, c, r], 0)
        e = dexp[li, c]
        hosted = hosts[li, c, r]
        dest = np.where(hosted, dpos[li, c, r], K + free_LRS[li, r].argmax(axis=1))
        tok[li, h, c] -= x
        load[li, h] -= x
        load[li, r] += x
        tok[li, r, dest] += x
        g = np.nonzero(go & ~hosted)[0]  # new replicas: overwrite the slot, update positions
        if len(g):
            old = slot_exp[g, r[g], dest[g]]
            pos[g, np.where(old >= 0, old, E), r[g]] = -1
            pos[g, e[g], r[g]] = dest[g]
            slot_exp[g, r[g], dest[g]] = e[g]
        active &= go
    return slot_exp, tok
