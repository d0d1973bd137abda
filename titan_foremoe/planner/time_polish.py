"""Token polish on the grouped GEMMs' time: the last level of foremoe's micro-step plan.

``split.rebalance_split_time`` levels tokens + a fixed cost per slot, a line fitted to the grouped GEMM's time
around the typical group; the real time of a group is not a line (tiles of 128 rows, small groups slower per
row), so ranks level in that proxy stay a few percent apart in time, which is the "imbalance" of the gap to
ideal (docs/simulator.md). ``level_time`` then moves tokens between each layer's slowest rank and a co-host of
one of its experts on the time table itself (``CostModel.group_ms``, the simulator's calibrated model of the
runtime's kernels): per candidate (expert slot of the straggler, co-host) a bisection finds the move x where the
two ranks' times cross, and the move that lowers the pair's larger time most is applied; repeated while the
straggler gets faster. Only moves between copies the plan already placed: no new slot, no new transfer.

Cost: per round O(A C R log T) (A layers still improving, C slots, R ranks, T tokens of a slot: 20 bisection
steps), vectorized over layers; rounds as ``polish_iters`` (2 R).

Legend: L layers, R ranks, C slots per rank (K owned first), E experts, A active layers.
"""

from __future__ import annotations

import numpy as np

from .split import _positions
from .types import CostModel

_BISECT = 20  # steps: moves of up to 2^20 tokens found exactly


def table_ms(rows: np.ndarray, table: tuple) -> np.ndarray:
    """One group's time (ms) at ``rows`` (any shape) from ``(rows grid, ms)``: interpolated, linear past the grid,
    0 for an empty group."""
    g, t = (np.asarray(x, dtype=np.float64) for x in table)
    n = np.asarray(rows, dtype=np.float64)
    out = np.where(n > g[-1], t[-1] * n / g[-1], np.interp(n, g, t))
    return np.where(n > 0, out, 0.0)


def level_time(slot_exp_LRC: np.ndarray, tok_LRC: np.ndarray, max_iters: int, cost: CostModel,
               num_owned: int) -> np.ndarray:
    """Level each layer's rank times on ``cost.group_ms`` by moving tokens between co-hosts; in place, returned."""
    if cost.group_ms is None:
        return tok_LRC
    L, R, C = tok_LRC.shape
    table = cost.group_ms
    extra_C = np.where(np.arange(C) >= num_owned, float(cost.spare_row_ms), 0.0)

    def slot_ms(n, c):
        return table_ms(n, table) + extra_C[c] * n

    E, e_all, pos_flat = _positions(slot_exp_LRC)
    load = slot_ms(tok_LRC, np.arange(C)).sum(axis=2)
    la = np.arange(L)
    for _ in range(max_iters):
        if la.size == 0:
            break
        A = la.size
        a1 = np.arange(A)
        ld = load[la]
        h = ld.argmax(axis=1)
        lh = ld[a1, h]
        dexp = e_all[la, h]  # [A, C]
        dpos = pos_flat.take(((la[:, None, None] * (E + 1) + dexp[:, :, None]) * R) + np.arange(R))  # [A, C, R]
        dpos[a1, :, h] = -1
        ok = dpos >= 0
        dp = np.maximum(dpos, 0)
        c_ = np.broadcast_to(np.arange(C)[None, :, None], dp.shape)
        nh = np.broadcast_to(tok_LRC[la, h][:, :, None], dp.shape).astype(np.float64)
        nd = tok_LRC[la[:, None, None], np.arange(R)[None, None, :], dp].astype(np.float64)
        base_h = lh[:, None, None] - slot_ms(nh, c_)
        base_r = ld[:, None, :] - slot_ms(nd, dp)

        def times(x):
            return base_h + slot_ms(nh - x, c_), base_r + slot_ms(nd + x, dp)

        lo, hi = np.zeros(dp.shape), np.where(ok, nh, 0.0)
        for _ in range(_BISECT):  # largest x with the co-host still at or below the straggler
            mid = np.floor((lo + hi + 1) / 2)
            th, tr = times(mid)
            up = (tr <= th) & (mid <= hi)
            lo, hi = np.where(up, mid, lo), np.where(up, hi, mid - 1)
        best_x, best = lo, np.inf
        th0, tr0 = times(lo)
        score = np.maximum(th0, tr0)
        x1 = np.minimum(lo + 1, nh)
        th1, tr1 = times(x1)
        s1 = np.maximum(th1, tr1)
        best_x = np.where(s1 < score, x1, lo)
        score = np.where(ok & (best_x > 0), np.minimum(score, s1), np.inf)
        flat = score.reshape(A, -1)
        k = flat.argmin(axis=1)
        go = flat[a1, k] < lh * (1.0 - 1e-9)
        if not go.any():
            break
        la, h, k, a1o = la[go], h[go], k[go], a1[go]
        c, r = np.divmod(k, R)
        xs = best_x.reshape(A, -1)[a1o, k].astype(np.int64)
        dest = dpos[a1o, c, r]
        tok_LRC[la, h, c] -= xs
        tok_LRC[la, r, dest] += xs
        for rk in (h, r):
            load[la, rk] = slot_ms(tok_LRC[la, rk], np.arange(C)[None, :]).sum(axis=1)
    return tok_LRC
