"""Micro-step level: which hot experts get replicas in the spare slots, and where.

Greedy on the known loads, vectorized over layers: while a layer's straggler is
above the target ceil(mean), move part of one of its experts to the rank with the
most room. A destination that already holds the expert (owner, earlier replica, or a
replica still resident from the previous micro-step) costs nothing; a new replica
costs a weight transfer, so it must take at least ``min_new_tokens`` off the
straggler, and copies fed from the same node score higher (cheaper path). With ``slot_tokens`` > 0 a
rank's load is its tokens plus ``slot_tokens`` per slot with tokens (the calibrated fixed cost of one
more grouped-GEMM group and its slot gather, in tokens): a new replica costs its receiver that much, and
a slot emptied saves it.
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


class _State:
    """Mutable greedy state of one micro-step (all layers)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _greedy(st: _State, G: int, iters: int) -> None:
    """Greedy rounds; each round every active layer's G heaviest ranks may each shed one chunk.

    Straggler g draws receivers from its own pool (ranks by room, dealt round-robin),
    so moves in one round never touch the same receiver. Each round works only on the
    layers still active (A of them), so the long tail of a few unfinished layers is cheap.
    """
    slot_exp, tok, load, pos, ncopy = st.slot_exp, st.tok, st.load, st.pos, st.ncopy
    L, R, C = tok.shape
    K, E, T, node_R = st.K, st.E, st.T, st.node_R
    N = ncopy.shape[2]
    Qg = R // G
    active = np.ones(L, dtype=bool)
    pos_flat, ncopy_flat = pos.reshape(-1), ncopy.reshape(-1)  # views: updates below stay visible
    g_ = np.arange(G)[None, :]
    for _ in range(iters):
        la = np.flatnonzero(active)
        if la.size == 0:
            break
        ld = load[la]
        if G > 1:
            # the stable descending order, as one sort of unique keys (load, then rank): faster than argsort
            key = (ld.max(axis=1, keepdims=True) - ld) * R + np.arange(R)
            key.sort(axis=1)
            order = key % R
            hG = order[:, :G]  # [A, G] stragglers
        else:
            hG = ld.argmax(axis=1)[:, None]
        a2 = np.arange(la.size)[:, None]
        need = ld[a2, hG] - T[la, None]
        act = need > st.tol[la, None]
        active[la] = act[:, 0]
        keep = act[:, 0]
        if not keep.all():
            la, ld, hG, need, act = la[keep], ld[keep], hG[keep], need[keep], act[keep]
            if G > 1:
                order = order[keep]
        A = la.size
        if A == 0:
            break
        a2 = a2[:A]
        l2 = la[:, None]
        if G > 1:
            recv = order[:, ::-1].reshape(A, Qg, G).transpose(0, 2, 1)  # [A, G, Qg] pools by room
        else:
            recv = np.broadcast_to(np.arange(R), (A, 1, R))
        lh = (l2 * R + hG)[..., None] * C + np.arange(C)  # [A, G, C] flat (layer, straggler, slot)
        dexp = slot_exp.take(lh)  # experts on the stragglers
        dE = np.where(dexp >= 0, dexp, E)
        dtok = tok.take(lh)
        cap = T[la, None] - ld  # room below target on every rank
        free_ARS = tok[la, :, K:] == 0  # spare slots that can be (re)filled
        has_free = free_ARS[:, :, 0].copy()
        for s_ in range(1, free_ARS.shape[2]):  # S is small: cheaper than any(axis=2)
            has_free |= free_ARS[:, :, s_]
        if G > 1:
            ar = a2[:, :, None] * R + recv
            capq = cap.take(ar)
            freeq = has_free.take(ar)
        else:
            capq, freeq = cap[:, None, :], has_free[:, None, :]
        # flat gathers (much cheaper than multi-array fancy indexing)
        le = la[:, None, None, None] * (E + 1) + dE[..., None]  # [A, G, C, 1]
        dposq = pos_flat.take(le * R + recv[:, :, None, :])  # [A, G, C, Qg]
        hosts = dposq >= 0  # receiver already holds a live copy (no transfer)
        # A straggler that still has a free spare slot may overshoot below the target:
        # it can be refilled later, and the overshoot lets its slot act as a relay
        # (chains h -> r, then k -> h), which 1 spare slot per rank needs to balance.
        give = np.where(has_free[a2, hG][..., None], dtok, np.minimum(dtok, need[..., None]))
        room = capq[:, :, None, :]
        if st.c0:  # a new slot costs its receiver c0: fill it up to the straggler's new load, past the target
            eq = (need[:, :, None, None] + room - st.c0) // 2
            room = np.where(hosts, room, np.maximum(room - st.c0, eq))
        amt = np.minimum(give[..., None], room)  # [A, G, C, Qg]
        relief = np.minimum(amt, need[..., None, None])
        valid = act[..., None, None] & (amt > 0) & (
            hosts | (freeq[:, :, None, :] & (relief >= st.min_new[la, None, None, None]))
        )
        # Straggler relief first; best fit breaks ties (fill the tightest hole, keep deep
        # holes for the big chunks only they can absorb). Scored only where valid (few).
        vi = np.flatnonzero(valid)
        agc, q_v = np.divmod(vi, Qg)
        ag_v = agc // C
        h_v, rl_v, am_v = hosts.take(vi), relief.take(vi), amt.take(vi)
        cq_v = capq.take(ag_v * capq.shape[2] + q_v)
        nodeq = node_R[recv]  # [A, G, Qg] or [A, 1, R]
        intra_v = ncopy_flat.take(le.take(agc) * N + nodeq.take(ag_v * nodeq.shape[2] + q_v)) > 0  # a copy on its node
        bonus = np.where(h_v, st.stay_bonus, intra_v * st.node_bonus)
        score = np.full(valid.size, -np.inf)
        score[vi] = rl_v * (1.0 + bonus) + st.overshoot_weight * (am_v - rl_v) - st.fit_weight * (cq_v - am_v)
        score = score.reshape(A, G, C * Qg)
        flat = score.argmax(axis=2)
        c, q = np.divmod(flat, Qg)
        pick = (a2 * G + g_) * (C * Qg) + flat  # [A, G] flat index of the chosen (c, q)
        go = valid.take(pick)
        if not go.any():
            break
        r = recv.take((a2 * G + g_) * recv.shape[2] + q) if G > 1 else q
        x = np.where(go, amt.take(pick), 0)
        e = dexp.take((a2 * G + g_) * C + c)
        hosted = hosts.take(pick)
        dest = np.where(hosted, dposq.take(pick).astype(np.int64), K + free_ARS[a2, r].argmax(axis=2))
        tok[l2, hG, c] -= x
        load[l2, hG] -= x
        load[l2, r] += x
        if st.c0:  # a slot started on the receiver costs c0; one emptied on the straggler saves it
            started = go & (tok[l2, r, dest] == 0)
            load[l2, r] += st.c0 * started
            load[l2, hG] -= st.c0 * (go & (tok[l2, hG, c] == 0))
        tok[l2, r, dest] += x
        ag, gg = np.nonzero(go & ~hosted)  # new replicas: overwrite the slot, update positions
        if len(ag):
            lg, rg, dg, eg = la[ag], r[ag, gg], dest[ag, gg], e[ag, gg]
            old = slot_exp[lg, rg, dg]
            oldE = np.where(old >= 0, old, E)
            pos[lg, oldE, rg] = -1
            np.add.at(ncopy, (lg, oldE, node_R[rg]), -1)
            pos[lg, eg, rg] = dg
            np.add.at(ncopy, (lg, eg, node_R[rg]), 1)
            slot_exp[lg, rg, dg] = eg
        active[la] &= go.any(axis=1)


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
    shortlist: int = 16,
    tolerance: float = 0.0,
    slot_tokens: int = 0,
    initial: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Choose replicas for one micro-step (all layers at once).

    load_LE: tokens per expert (summed over sources). owned_LRK: owned experts.
    resident_LRS: expert resident in each spare slot from the previous micro-step (-1 none).
    slot_tokens: fixed cost of a slot with tokens, in tokens (0: loads are token counts).
    initial: (slot_exp_LRC, tok_LRC) to start from instead of ``initial_slots`` (e.g. after whole-expert
    handoffs, ``handoff.py``; every expert's tokens in one slot); copied, not modified.
    Returns (slot_exp_LRC, tok_LRC): slot contents and the tokens each slot processes.
    """
    L, E = load_LE.shape
    R, K = owned_LRK.shape[1], owned_LRK.shape[2]
    S = resident_LRS.shape[2]
    N, P = topology.num_nodes, topology.ranks_per_node
    if initial is None:
        slot_exp, tok = initial_slots(load_LE, owned_LRK, resident_LRS)
    else:
        slot_exp, tok = (np.array(a, dtype=np.int64) for a in initial)
    if S == 0:
        return slot_exp, tok
    c0 = int(slot_tokens)
    load = tok.sum(axis=2) + c0 * (tok > 0).sum(axis=2)
    st = _State(c0=c0,
        slot_exp=slot_exp, tok=tok, load=load, K=K, E=E, node_R=topology.node_of_rank_R(), P=P,
        T=-(-load.sum(axis=1) // R),  # ceil(mean): the best an integer split can do
        min_new=np.maximum(np.asarray(min_new_tokens_L, dtype=np.int64), 1),
        stay_bonus=stay_bonus, node_bonus=node_bonus, fit_weight=fit_weight, overshoot_weight=overshoot_weight,
    )
    # a layer is done once its straggler is within `tolerance` x mean of the target
    st.tol = np.floor(tolerance * load.sum(axis=1) / R).astype(np.int64)
    # [L, E+1, R] slot of expert e on rank r, -1 if absent; small dtypes keep the gathers in cache
    pos_dtype = np.int8 if K + S <= 127 else np.int64
    st.pos = slot_positions(slot_exp, E).astype(pos_dtype)
    st.ncopy = (st.pos >= 0).reshape(L, E + 1, N, P).sum(axis=3, dtype=np.int32)  # copies of e on node n
    iters = max_iters if max_iters is not None else R * S + 2 * R
    # Many stragglers at once (disjoint receiver pools) on large EP groups, then one at a
    # time over every rank to finish: same moves, far fewer vectorized rounds.
    G = max(1, R // max(shortlist, 1))
    while R % G:
        G -= 1
    if G > 1:
        _greedy(st, G, iters)
    _greedy(st, 1, iters)
    return slot_exp, tok
