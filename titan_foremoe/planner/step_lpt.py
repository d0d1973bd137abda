"""``step_lpt``: one expert placement per optimizer step from the step's replayed loads (RoutePack-style baseline).

RoutePack (arXiv 2608.12146, Ant Group, 2026-08) also plans from the rollout's routing replay, but commits one
placement per optimizer step: per layer, a longest-processing-time (LPT) placement of the experts' copies from
the step's loads, written as in-place copies at the step boundary; the step's micro-steps then run on it. Our
version in the same runtime: owners stay the EP shard (read in place by the slot GEMM), the R x S spare slots of
each layer are filled once per step:
1. copies: the extra copies go, one at a time, to the expert with the largest load per copy (EPLB's rule), at
   most one copy per rank;
2. LPT: every rank starts with its owned experts' shares (load / copies); the extra copies, heaviest share
   first, each go to the least loaded rank with a free spare slot that does not hold that expert yet.
Every micro-step of the step splits each expert's tokens evenly over its copies (``split.even_split``): the
placement is the step's, not the micro-step's. foremoe differs by planning every micro-step.

Cost: O(R S (L R + L E)) per step (R S rounds vectorized over layers), O(L R E) bools of memory; Qwen3-30B-A3B's
shape (48 layers, 128 experts), one spare slot: 0.6 / 12 / 33 ms per step at EP 8 / 64 / 128 on this loaded host
core (3M-addition loop 0.67 s; best of 3); once per optimizer step, no device work, no collective.

Legend: L layers, E experts, R ranks, K = E / R owned experts per rank, S spare slots per rank, X = R S copies.
"""

from __future__ import annotations

import numpy as np

from .owners import contiguous_owners, owned_slots_LRK


def copies_LE(weight_LE: np.ndarray, num_ranks: int, extra: int) -> np.ndarray:
    """Copies of every expert (>= 1, <= R): ``extra`` more, each to the largest load per copy (ties: lowest id)."""
    L, E = weight_LE.shape
    cnt = np.ones((L, E), dtype=np.int64)
    w = weight_LE.astype(np.float64)
    li = np.arange(L)
    for _ in range(extra):
        score = np.where(cnt < num_ranks, w / cnt, -np.inf)
        j = score.argmax(axis=1)
        ok = np.isfinite(score[li, j])
        cnt[li[ok], j[ok]] += 1
    return cnt


def lpt_slots(weight_LE: np.ndarray, num_ranks: int, spare: int) -> np.ndarray:
    """``slots_LRC``: rank r's owned experts (contiguous) in its first K slots, its LPT copies in the S spare ones."""
    L, E = weight_LE.shape
    R, K, S = num_ranks, E // num_ranks, spare
    owned = owned_slots_LRK(contiguous_owners(L, E, R), R)
    slots = np.concatenate([owned, np.full((L, R, S), -1, dtype=np.int64)], axis=2)
    if S == 0:
        return slots
    w = weight_LE.astype(np.float64)
    cnt = copies_LE(w, R, R * S)
    share_LE = w / cnt
    load_LR = share_LE.reshape(L, R, K).sum(axis=2)  # each owner keeps one share
    # the extra copies of each layer, heaviest share first (ties: lowest expert id); -1 pads a layer whose
    # experts all reached R copies before the slots ran out
    X = R * S
    e_LX = np.full((L, X), -1, dtype=np.int64)
    for l in range(L):
        e = np.repeat(np.arange(E), cnt[l] - 1)
        e_LX[l, : len(e)] = e
    li = np.arange(L)[:, None]
    s_LX = np.where(e_LX >= 0, share_LE[li, np.maximum(e_LX, 0)], -1.0)
    order = np.lexsort((e_LX, -s_LX), axis=1)
    e_LX, s_LX = np.take_along_axis(e_LX, order, axis=1), np.take_along_axis(s_LX, order, axis=1)
    free_LR = np.full((L, R), S, dtype=np.int64)
    holds_LRE = np.zeros((L, R, E), dtype=bool)
    holds_LRE[np.arange(L)[:, None, None], np.arange(R)[None, :, None], owned] = True
    l1 = np.arange(L)
    for x in range(X):
        e = np.maximum(e_LX[:, x], 0)
        ok_LR = (free_LR > 0) & ~holds_LRE[l1, :, e] & (e_LX[:, x] >= 0)[:, None]
        r = np.where(ok_LR, load_LR, np.inf).argmin(axis=1)
        go = ok_LR[l1, r]
        lg, rg, eg = l1[go], r[go], e[go]
        slots[lg, rg, K + S - free_LR[lg, rg]] = eg
        free_LR[lg, rg] -= 1
        holds_LRE[lg, rg, eg] = True
        load_LR[lg, rg] += s_LX[go, x]
    return slots
