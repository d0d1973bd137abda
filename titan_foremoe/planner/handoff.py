"""Micro-step level, before replicas: whole-expert handoffs.

A spare slot may run a *whole* expert of another rank: all its tokens, the owner's slot runs nothing. With a
slot's fixed cost c0 (``CostModel.slot_overhead_tokens``: one more grouped-GEMM group and its slot gather, in
tokens) a split adds c0 to the layer's work while a handoff adds none, so where c0 is a sizable part of an
expert's load (gpt-oss-20b on H100: ~1,100 tokens, about one expert's micro-step load) levelling ranks with
whole experts first leaves the replicas (splits, ``replicas.py``) a smaller gap to close at their cost.

Descent per layer on the sum of squared rank loads (a rank's load: its tokens + c0 per slot with tokens),
never raising the layer's straggler: each round takes the best of every whole-expert handoff (any rank's
expert to a rank with an idle spare slot, or back to its owner) and every swap of one of the straggler's
experts with one of another rank's; stop when none lowers the sum. Levelling all ranks, not only the
straggler, is what opens room for it: on the gpt-oss trace (c0 ~1,100 tokens) a straggler-only greedy stopped
at 3.5-4% above the whole-expert mean, this descent at ~2.5%.
Candidate moves are scored for all layers at once; the chosen move of each layer is applied in a short loop.
A handoff is a replica with all the tokens: the transfer schedule and gradient return treat it as one.

Legend: L layers, R ranks, C slots per rank (K owned first, then S spare), E experts, A active layers.
"""

from __future__ import annotations

import numpy as np

from .replicas import initial_slots


def _dest(slot_e: list, tok: list, e: int, K: int, own_k: int) -> int:
    """The slot of rank r (its slot_e / tok rows, as lists: C is small) that takes expert e whole: e's owned
    slot (own_k >= 0), else a spare slot holding e idle (no transfer), else the first idle spare slot."""
    if own_k >= 0:
        return own_k
    idle = [c for c in range(K, len(tok)) if tok[c] == 0]
    same = [c for c in idle if slot_e[c] == e]
    return (same or idle)[0]


def whole_handoffs(load_LE: np.ndarray, owned_LRK: np.ndarray, resident_LRS: np.ndarray, slot_tokens: int,
                   max_iters: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(slot_exp_LRC, tok_LRC) as ``replicas.initial_slots`` gives them, after whole-expert handoffs and swaps
    (load = tokens + slot_tokens per slot with tokens; see the module doc). Every expert's tokens stay in one
    slot; idle spare slots keep their residents."""
    slot_e, tok = initial_slots(load_LE, owned_LRK, resident_LRS)
    L, R, C = tok.shape
    K = owned_LRK.shape[2]
    E = load_LE.shape[1]
    if C == K:
        return slot_e, tok
    c0 = int(slot_tokens)
    owner_LE = np.empty((L, E), dtype=np.int64)  # owner rank and owned slot of every expert
    own_k_LE = np.empty((L, E), dtype=np.int64)
    li = np.arange(L)[:, None, None]
    owner_LE[li, owned_LRK] = np.arange(R)[None, :, None]
    own_k_LE[li, owned_LRK] = np.arange(K)[None, None, :]
    load = tok.sum(axis=2) + c0 * (tok > 0).sum(axis=2)
    r_ = np.arange(R)
    spare_C = np.arange(C) >= K
    la = np.arange(L)
    for _ in range(max_iters if max_iters is not None else 8 * R):
        if la.size == 0:
            break
        A = la.size
        a1 = np.arange(A)
        ld = load[la]  # [A, R]
        h = ld.argmax(axis=1)
        lh = ld[a1, h]
        se, st = slot_e[la], tok[la]  # [A, R, C]
        free = (st[:, :, K:] == 0).any(axis=2)  # [A, R] an idle spare slot
        own = owner_LE[la[:, None, None], np.maximum(se, 0)]  # [A, R, C] owner of each slot's expert
        x = np.where(st > 0, st + c0, 0)  # [A, R, C] what moving the slot's expert whole moves
        # handoff of rank a's slot c to rank b: [A, R(a), C, R(b)]; gain = drop in the sum of squared loads
        la_, lb_ = ld[:, :, None, None], ld[:, None, None, :]
        xx = x[..., None]
        ok1 = ((xx > 0) & (r_[:, None, None] != r_)[None] & ((own[..., None] == r_) | free[:, None, None, :])
               & (lb_ + xx <= lh[:, None, None, None]))
        g1 = np.where(ok1, 2 * xx * (la_ - lb_ - xx), 0)
        # swap of the straggler's slot c with rank b's slot d: [A, C, R(b), C(d)]
        xh, own_h = x[a1, h], own[a1, h]  # [A, C]
        dlt = xh[:, :, None, None] - x[:, None, :, :]
        lb2 = ld[:, None, :, None]
        ok2 = ((xh > 0)[:, :, None, None] & (x > 0)[:, None, :, :] & (dlt > 0)
               & (r_[None, :] != h[:, None])[:, None, :, None]
               & ((own_h[:, :, None, None] == r_[None, None, :, None]) | free[:, None, :, None] | spare_C)
               & ((own == h[:, None, None])[:, None, :, :] | free[a1, h][:, None, None, None]
                  | spare_C[None, :, None, None])
               & (lb2 + dlt <= lh[:, None, None, None]))
        g2 = np.where(ok2, 2 * dlt * (lh[:, None, None, None] - lb2 - dlt), 0)
        b1, b2 = g1.reshape(A, -1).argmax(axis=1), g2.reshape(A, -1).argmax(axis=1)
        v1, v2 = g1.reshape(A, -1)[a1, b1], g2.reshape(A, -1)[a1, b2]
        go = np.maximum(v1, v2) > 0
        for a in np.flatnonzero(go):
            l = la[a]
            if v1[a] >= v2[a]:
                src, rem = divmod(int(b1[a]), C * R)
                c, dst = divmod(rem, R)
                moves = [(src, c, dst)]
            else:
                c, rem = divmod(int(b2[a]), R * C)
                r, d = divmod(rem, C)
                moves = [(int(h[a]), c, r), (r, d, int(h[a]))]
            ranks = {rk for m in moves for rk in (m[0], m[2])}
            se_l = {rk: slot_e[l, rk].tolist() for rk in ranks}  # C is small: python lists beat numpy here
            tk_l = {rk: tok[l, rk].tolist() for rk in ranks}
            taken = [(src, cc, se_l[src][cc], tk_l[src][cc]) for src, cc, _ in moves]
            for src, cc, _, _ in taken:
                tk_l[src][cc] = 0
            for (src, cc, e, n), (_, _, dst) in zip(taken, moves):
                k = int(own_k_LE[l, e]) if owner_LE[l, e] == dst else -1
                slot = _dest(se_l[dst], tk_l[dst], e, K, k)
                se_l[dst][slot], tk_l[dst][slot] = e, n
            for rk in ranks:
                slot_e[l, rk], tok[l, rk] = se_l[rk], tk_l[rk]
                load[l, rk] = sum(tk_l[rk]) + c0 * sum(1 for t in tk_l[rk] if t > 0)
        la = la[go]
    return slot_e, tok
