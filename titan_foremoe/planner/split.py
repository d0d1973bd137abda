"""Token level: integer splits of each expert's tokens among the ranks hosting it.

Also the per-source split the dispatcher needs (which source sends how many tokens
of an expert to which host), kept local first to cut dispatch traffic.
"""

from __future__ import annotations

import numpy as np

from .replicas import slot_positions


def _positions(slot_exp_LRC: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """(E, expert of each slot with E for empty ones, ``replicas.slot_positions`` flattened) for the polishes."""
    E = int(slot_exp_LRC.max(initial=0)) + 1
    return E, np.where(slot_exp_LRC >= 0, slot_exp_LRC, E), slot_positions(slot_exp_LRC, E).reshape(-1)


def straggler_hosts(load_LR, la, e_all, pos_flat, E: int, R: int, nth_A=None):
    """The polishes' common step, for the active layers ``la``: (A, arange(A), their rank loads, each one's
    straggler h and its load, and for each of h's slots the slot of that expert on every other rank ``[A, C, R]``,
    -1 where none). ``nth_A``: per layer, the rank that many places below the straggler instead (0: the straggler)."""
    A = la.size
    a1 = np.arange(A)
    ld = load_LR[la]
    h = ld.argmax(axis=1) if nth_A is None else np.argsort(-ld, axis=1, kind="stable")[a1, nth_A]
    lh = ld[a1, h]
    dexp = e_all[la, h]  # [A, C]
    dpos = pos_flat.take(((la[:, None, None] * (E + 1) + dexp[:, :, None]) * R) + np.arange(R))  # [A, C, R]
    dpos[a1, :, h] = -1
    return A, a1, ld, h, lh, dpos


def rebalance_split(slot_exp_LRC: np.ndarray, tok_LRC: np.ndarray, max_iters: int) -> np.ndarray:
    """Shift tokens from each layer's straggler to its least-loaded co-host, in place.

    Every step moves floor((load_h - load_r) / 2) tokens (at most what h holds of that
    expert) from the max rank h to the lightest other rank hosting the same expert,
    so the max never rises and rank loads end as even as integers and hosting allow.
    Returns tok_LRC.
    """
    return rebalance_split_time(slot_exp_LRC, tok_LRC, max_iters, 0)


def rebalance_split_time(slot_exp_LRC: np.ndarray, tok_LRC: np.ndarray, max_iters: int, slot_tokens: int,
                         spare_weight: float = 1.0, num_owned: int | None = None) -> np.ndarray:
    """``rebalance_split`` on grouped-GEMM time rather than tokens: a rank's load is its tokens plus
    ``slot_tokens`` per expert it runs (the fixed cost of one more, smaller GEMM, in tokens).

    Each step moves half the gap between the straggler and its lightest co-host, where filling a
    co-host's empty slot costs it ``slot_tokens`` more (a sliver must be worth its GEMM); emptying one of
    the straggler's slots saves it as much. With slot_tokens 0 this is the token rule exactly.
    ``spare_weight`` (> 1): a token in a spare slot (slot >= ``num_owned``) costs that much (the runtime copies a
    spare slot's output rows into place, ``CostModel.spare_token_weight``); a move of x tokens then changes the
    two loads by x times their slots' weights, and levels them.
    Returns tok_LRC.
    """
    if spare_weight != 1.0:
        return _rebalance_weighted(slot_exp_LRC, tok_LRC, max_iters, slot_tokens, spare_weight, num_owned)
    L, R, C = tok_LRC.shape
    E, e_all, pos_flat = _positions(slot_exp_LRC)
    big = np.iinfo(np.int64).max // 4
    c0 = int(slot_tokens)
    load = tok_LRC.sum(axis=2) + c0 * (tok_LRC > 0).sum(axis=2)
    la = np.arange(L)  # layers still improving: later rounds touch only those
    for _ in range(max_iters):
        if la.size == 0:
            break
        A, a1, ld, h, lh, dpos = straggler_hosts(load, la, e_all, pos_flat, E, R)
        cl = np.where(dpos >= 0, ld[:, None, :], big)
        if c0:  # a co-host's empty slot starts one more GEMM there
            empty = tok_LRC[la[:, None, None], np.arange(R)[None, None, :], np.maximum(dpos, 0)] == 0
            cl = np.where((dpos >= 0) & empty, cl + c0, cl)
        r_c = cl.argmin(axis=2)  # lightest co-host of each of h's experts
        lmin = cl[a1[:, None], np.arange(C)[None, :], r_c]
        x_c = np.where(lmin < lh[:, None], np.minimum(tok_LRC[la, h], (lh[:, None] - lmin) // 2), 0)
        c = x_c.argmax(axis=1)
        x = x_c[a1, c]
        go = x > 0
        if not go.all():
            la, h, c, x, r_c, dpos, a1 = la[go], h[go], c[go], x[go], r_c[go], dpos[go], np.arange(int(go.sum()))
        if la.size == 0:
            break
        r = r_c[a1, c]
        dest = dpos[a1, c, r]
        tok_LRC[la, h, c] -= x
        tok_LRC[la, r, dest] += x
        for rk in (h, r):
            load[la, rk] = tok_LRC[la, rk].sum(axis=1) + c0 * (tok_LRC[la, rk] > 0).sum(axis=1)
    return tok_LRC


def _rebalance_weighted(slot_exp_LRC: np.ndarray, tok_LRC: np.ndarray, max_iters: int, slot_tokens: int,
                        spare_weight: float, num_owned: int | None) -> np.ndarray:
    """``rebalance_split_time`` with slot weights w_c (1 owned, ``spare_weight`` spare): rank load = sum_c w_c
    tok_c + slot_tokens per slot with tokens (float). A move of x from the straggler's slot c to a co-host's slot
    d takes w_c x off one and puts w_d x on the other: x = floor(gap / (w_c + w_d)) levels them."""
    L, R, C = tok_LRC.shape
    if num_owned is None:
        raise ValueError("spare_weight needs num_owned (the owned slots come first)")
    E, e_all, pos_flat = _positions(slot_exp_LRC)
    w_C = np.where(np.arange(C) < num_owned, 1.0, float(spare_weight))
    c0 = float(slot_tokens)

    def loads(t):
        return (t * w_C).sum(axis=-1) + c0 * (t > 0).sum(axis=-1)

    load = loads(tok_LRC)
    la = np.arange(L)
    for _ in range(max_iters):
        if la.size == 0:
            break
        A, a1, ld, h, lh, dpos = straggler_hosts(load, la, e_all, pos_flat, E, R)
        ok = dpos >= 0
        dp = np.maximum(dpos, 0)
        empty = tok_LRC[la[:, None, None], np.arange(R)[None, None, :], dp] == 0
        cl = np.where(ok, ld[:, None, :] + np.where(empty, c0, 0.0), np.inf)
        wd = w_C[dp]  # weight of the co-host's slot
        wc = w_C[None, :, None]
        gap = lh[:, None, None] - cl
        x = np.where(ok & (gap > 0), np.minimum(tok_LRC[la, h][:, :, None], np.floor(gap / (wc + wd))), 0)
        # the move that lowers the straggler most: w_c x off it (the co-host stays at or below it)
        gain = np.where(x > 0, wc * x, 0.0).reshape(A, -1)
        best = gain.argmax(axis=1)
        go = gain[a1, best] > 0
        if not go.any():
            break
        la, h, best, a1 = la[go], h[go], best[go], np.arange(int(go.sum()))
        c, r = np.divmod(best, R)
        xs = x[go].reshape(len(la), -1)[a1, best].astype(np.int64)
        dest = dpos[go][a1, c, r]
        tok_LRC[la, h, c] -= xs
        tok_LRC[la, r, dest] += xs
        for rk in (h, r):
            load[la, rk] = loads(tok_LRC[la, rk])
    return tok_LRC


def even_split(load_LE: np.ndarray, slot_exp_LRC: np.ndarray) -> np.ndarray:
    """EPLB's token rule: each expert's tokens split evenly over its replicas.

    The remainder goes one token each to the first replicas in (rank, slot) order.
    """
    L, R, C = slot_exp_LRC.shape
    E = load_LE.shape[1]
    flat = slot_exp_LRC.reshape(L, R * C)
    valid = flat >= 0
    key = np.where(valid, flat, E)
    order = np.argsort(key, axis=1, kind="stable")
    sk = np.take_along_axis(key, order, axis=1)
    pos = np.arange(R * C)[None, :]
    start = np.where(np.concatenate([np.ones((L, 1), bool), sk[:, 1:] != sk[:, :-1]], axis=1), pos, 0)
    start = np.maximum.accumulate(start, axis=1)
    k_sorted = pos - start  # replica index within its expert
    k = np.empty_like(k_sorted)
    np.put_along_axis(k, order, k_sorted, axis=1)
    li = np.arange(L)[:, None]
    count_LE = np.zeros((L, E + 1), dtype=np.int64)
    np.add.at(count_LE, (li, key), 1)
    e = np.where(valid, flat, 0)
    n = np.maximum(count_LE[li, e], 1)
    tot = load_LE[li, e]
    share = tot // n + (k < tot % n)
    return np.where(valid, share, 0).reshape(L, R, C).astype(np.int64)


def assign_from_slots(slot_exp_LRC: np.ndarray, tok_LRC: np.ndarray, num_experts: int) -> np.ndarray:
    """assign_LER: tokens of expert e on rank r, summed over the rank's slots."""
    L, R, C = slot_exp_LRC.shape
    l, r, c = np.nonzero((slot_exp_LRC >= 0) & (tok_LRC != 0))
    out = np.zeros((L, num_experts, R), dtype=np.int64)
    np.add.at(out, (l, slot_exp_LRC[l, r, c], r), tok_LRC[l, r, c])
    return out


def ideal_assign(load_LE: np.ndarray, num_ranks: int) -> np.ndarray:
    """Lower bound: cut the concatenated tokens of all experts into R near-equal pieces."""
    L, E = load_LE.shape
    R = num_ranks
    end = np.cumsum(load_LE, axis=1)
    start = end - load_LE
    tot = end[:, -1]
    bounds = (np.arange(R + 1)[None, :] * tot[:, None]) // R  # [L, R+1]
    lo = np.maximum(start[:, :, None], bounds[:, None, :-1])
    hi = np.minimum(end[:, :, None], bounds[:, None, 1:])
    return np.clip(hi - lo, 0, None).astype(np.int64)


def _north_west(supply_ES: np.ndarray, cap_ER: np.ndarray) -> np.ndarray:
    """Per expert, fill hosts in rank order from sources in rank order (interval overlap)."""
    a1 = np.cumsum(supply_ES, axis=1)
    a0 = a1 - supply_ES
    b1 = np.cumsum(cap_ER, axis=1)
    b0 = b1 - cap_ER
    f = np.minimum(a1[:, :, None], b1[:, None, :]) - np.maximum(a0[:, :, None], b0[:, None, :])
    return np.clip(f, 0, None)


def source_split(loads_SE: np.ndarray, assign_ER: np.ndarray, node_of_rank_R: np.ndarray) -> np.ndarray:
    """tokens_SER: how many of source s's tokens for expert e go to host r (one layer).

    Deterministic and locality-first: a source keeps what it can on itself, then
    sends to hosts on its own node, then anywhere (ranks in index order at each
    stage). Both marginals hold: sum over R = loads_SE, sum over S = assign_ER.
    """
    loads_SE = np.asarray(loads_SE, dtype=np.int64)
    assign_ER = np.asarray(assign_ER, dtype=np.int64)
    S, E = loads_SE.shape
    R = assign_ER.shape[1]
    if assign_ER.shape[0] != E or S != R:
        raise ValueError(f"source_split: loads_SE {loads_SE.shape} and assign_ER {assign_ER.shape} disagree")
    if not np.array_equal(loads_SE.sum(axis=0), assign_ER.sum(axis=1)):
        raise ValueError("source_split: assign_ER does not cover exactly the tokens of loads_SE")
    supply = loads_SE.T.copy()  # [E, S]
    cap = assign_ER.copy()  # [E, R]
    out = np.zeros((S, E, R), dtype=np.int64)
    ar = np.arange(S)
    self_f = np.minimum(supply, cap)  # source s == rank s
    out[ar, :, ar] = self_f.T
    supply -= self_f
    cap -= self_f
    for n in np.unique(node_of_rank_R):
        m = node_of_rank_R == n
        f = _north_west(supply * m[None, :], cap * m[None, :])
        out += f.transpose(1, 0, 2)
        supply -= f.sum(axis=2)
        cap -= f.sum(axis=1)
    f = _north_west(supply, cap)
    out += f.transpose(1, 0, 2)
    return out
