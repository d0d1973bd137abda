"""Token polish on the grouped GEMMs' time: the last level of foremoe's micro-step plan.

``split.rebalance_split_time`` levels tokens + a fixed cost per slot, a line fitted to the grouped GEMM's time
around the typical group; the real time of a group is not a line (tiles of 128 rows, small groups slower per
row), so ranks level in that proxy stay a few percent apart in time, which is the "imbalance" of the gap to
ideal (docs/simulator.md). ``level_time`` then moves tokens between each layer's slowest rank and a co-host of
one of its experts on the time table itself (``CostModel.group_ms``, the simulator's calibrated model of the
runtime's kernels): per candidate (expert slot of the straggler, co-host) a bisection finds the move x where the
two ranks' times cross, and the move that lowers the pair's larger time most is applied; repeated while the
straggler gets faster. Only moves between copies the plan already placed: no new slot, no new transfer.

Cost: per round O(A C (R + log T)) (A layers still improving, C slots, R ranks, T tokens of a slot: a bisection of
log2 T steps, each one table lookup), vectorized over layers; rounds as ``polish_iters`` (2 R). Measured in
docs/simulator.md ("Gap to ideal, per cause").

Legend: L layers, R ranks, C slots per rank (K owned first), E experts, A active layers.
"""

from __future__ import annotations

import numpy as np

from .split import _positions, straggler_hosts
from .types import CostModel

def table_ms(rows: np.ndarray, table: tuple) -> np.ndarray:
    """One group's time (ms) at ``rows`` (any shape) from ``(rows grid, ms)``: interpolated, linear past the grid,
    0 for an empty group."""
    g, t = (np.asarray(x, dtype=np.float64) for x in table)
    n = np.asarray(rows, dtype=np.float64)
    out = np.where(n > g[-1], t[-1] * n / g[-1], np.interp(n, g, t))
    return np.where(n > 0, out, 0.0)


def _lookup(table: tuple):
    """``f(rows)`` from the table as one array lookup (rows as integers): the interpolation done once."""
    g, t = (np.asarray(x, dtype=np.float64) for x in table)
    top = int(g[-1])
    f_N = table_ms(np.arange(top + 1), table)
    slope = t[-1] / g[-1]

    def f(n):
        n = np.asarray(n, dtype=np.int64)
        return np.where(n > top, slope * n, f_N[np.clip(n, 0, top)])
    return f


_TABLE_ROWS_MAX = 1 << 22  # slot_ms_fn's lookup covers up to this many rows (64 MiB); more takes the sum


def slot_ms_fn(table: tuple, spare_row_ms: float, spare_part_ms: float, num_slots: int, num_owned: int):
    """``f(rows, slot)``: a slot's time (ms) on ``table`` plus, on a spare slot, each row's copy (``spare_row_ms``)
    and, once it runs any row, the spare part's fixed time (``spare_part_ms``: the runtime runs it only then).

    Why a table: the polishes call it hundreds of times per plan on arrays of a few hundred entries, where each
    numpy call's overhead is the cost; ``T[kind, rows]`` (owned / spare, every row count up to the largest seen,
    grown by doubling) is one lookup, the same values bit for bit as the sum below (integer rows >= 0; anything
    else, or more than ``_TABLE_ROWS_MAX`` rows, takes the sum). ~2 x 8 bytes per row count (a few hundred KB)."""
    f = _lookup(table)
    spare_C = np.arange(num_slots) >= num_owned
    row_C = np.where(spare_C, float(spare_row_ms), 0.0)
    part_C = np.where(spare_C, float(spare_part_ms), 0.0)
    kind_C = spare_C.astype(np.intp)
    row, part = float(spare_row_ms), float(spare_part_ms)
    held = [np.zeros((2, 0))]

    def grow(top: int) -> np.ndarray:
        n = np.arange(top + 1)
        base = f(n)
        held[0] = np.stack([base, base + row * n + part * (n > 0)])
        return held[0]

    def slot_ms(n, c):
        n = np.asarray(n)
        top = int(n.max(initial=0)) if n.dtype.kind in "iu" else -1
        if top < 0 or top > _TABLE_ROWS_MAX or (n.size and n.min() < 0):  # not row counts a table holds
            return f(n) + row_C[c] * n + part_C[c] * (n > 0)
        T = held[0]
        if top >= T.shape[1]:
            T = grow(min(max(top, 2 * T.shape[1], 1024), _TABLE_ROWS_MAX))
        return T[kind_C[c], n]
    return slot_ms


def landing_LR(slot_exp_LRC: np.ndarray | None, tok_LRC: np.ndarray, num_owned: int, cost: CostModel):
    """Each rank's time adding the replica gradients returned to it (ms, over the leading axes of ``tok_LRC``;
    0.0 without ``cost.landing_ms`` or slots): per layer one row per spare slot of another rank that runs rows
    of an expert this rank owns (in one of its first ``num_owned`` slots), ``cost.landing_ms`` each plus
    ``cost.landing_fixed_ms`` once (``simulator.grouped_mm.GroupedMMCost.landing_ms``, the update stage's)."""
    if slot_exp_LRC is None or not cost.landing_ms:
        return 0.0
    *lead, R, C = tok_LRC.shape
    se, tk = slot_exp_LRC.reshape(-1, R, C), tok_LRC.reshape(-1, R, C)
    owner_NE = np.full((se.shape[0], max(int(se.max()) + 1, 1)), -1)
    n, r, c = np.nonzero(se[:, :, :num_owned] >= 0)
    owner_NE[n, se[n, r, c]] = r
    n, r, c = np.nonzero((se[:, :, num_owned:] >= 0) & (tk[:, :, num_owned:] > 0))
    o = owner_NE[n, se[n, r, num_owned + c]]
    ok = (o >= 0) & (o != r)  # a spare slot reading its own rank's owned row returns nothing
    cnt = np.zeros((se.shape[0], R))
    np.add.at(cnt, (n[ok], o[ok]), 1.0)
    return (cnt * cost.landing_ms + (cnt > 0) * cost.landing_fixed_ms).reshape(*lead, R)


def rank_ms_LR(tok_LRC: np.ndarray, cost: CostModel, num_owned: int, slot_exp_LRC=None) -> np.ndarray:
    """Each rank's time on the time table (ms: its groups' ``cost.group_ms`` plus the spare rows' copy and the
    spare part, and with ``slot_exp_LRC`` the returned gradients' landing, ``landing_LR``); without a table its
    load in tokens, ``cost.slot_overhead_tokens`` per slot with tokens (the token polishes' measure)."""
    if cost.group_ms is None:
        return (tok_LRC + int(cost.slot_overhead_tokens) * (tok_LRC > 0)).sum(axis=-1).astype(np.float64)
    C = tok_LRC.shape[-1]
    f = slot_ms_fn(cost.group_ms, cost.spare_row_ms, cost.spare_part_ms, C, num_owned)
    return f(tok_LRC, np.arange(C)).sum(axis=-1) + landing_LR(slot_exp_LRC, tok_LRC, num_owned, cost)


def pass_ms_QLR(tok_LRC: np.ndarray, cost: CostModel, num_owned: int, slot_exp_LRC=None) -> np.ndarray:
    """Each pass's rank times ``[Q, ..., R]`` (ms) on ``cost.passes``' tables (the forward's, the backward's; the
    landing of returned gradients, with ``slot_exp_LRC``, in the last: the backward's)."""
    C = tok_LRC.shape[-1]
    t = np.stack([slot_ms_fn(*q, C, num_owned)(tok_LRC, np.arange(C)).sum(axis=-1) for q in cost.passes])
    t[-1] += landing_LR(slot_exp_LRC, tok_LRC, num_owned, cost)
    return t


def layer_ms(tok_LRC: np.ndarray, cost: CostModel, num_owned: int, slot_exp_LRC=None) -> tuple[np.ndarray, np.ndarray]:
    """(each layer's time: its slowest rank's, or with ``cost.passes`` the sum over passes of each pass's slowest
    rank, as the stage runs them; the ranks' total, the ties' measure), over the leading axes of ``tok_LRC``."""
    if len(cost.passes) > 1:
        t_QLR = pass_ms_QLR(tok_LRC, cost, num_owned, slot_exp_LRC)
        return t_QLR.max(axis=-1).sum(axis=0), t_QLR.sum(axis=(0, -1))
    t_LR = rank_ms_LR(tok_LRC, cost, num_owned, slot_exp_LRC)
    return t_LR.max(axis=-1), t_LR.sum(axis=-1)


def best_in_time(plans: list[tuple[np.ndarray, np.ndarray]], cost: CostModel, num_owned: int):
    """Per layer, the (slot_exp_LRC, tok_LRC) of ``plans`` that runs fastest (``layer_ms``: its slowest rank, or
    each pass's; ties: the lower total, then the earlier plan)."""
    se = np.stack([p[0] for p in plans])  # [P, L, R, C]
    tk = np.stack([p[1] for p in plans])
    t_PL, tot_PL = layer_ms(tk, cost, num_owned, se)
    pick = np.lexsort((tot_PL, t_PL), axis=0)[0]  # [L]: stable, ties to the earlier plan
    li = np.arange(se.shape[1])
    return se[pick, li].copy(), tk[pick, li].copy()


def level_time(slot_exp_LRC: np.ndarray, tok_LRC: np.ndarray, max_iters: int, cost: CostModel,
               num_owned: int, chain_depth: int = 1) -> np.ndarray:
    """Level each layer's rank times on ``cost.group_ms`` by moving tokens between co-hosts; in place, returned.

    Per round and layer: each of the straggler's slots is paired with the lightest other host of its expert; a
    bisection finds where the two ranks' times cross; the pair whose larger time is lowest moves."""
    if cost.group_ms is None:
        return tok_LRC
    L, R, C = tok_LRC.shape
    slot_ms = slot_ms_fn(cost.group_ms, cost.spare_row_ms, cost.spare_part_ms, C, num_owned)
    E, e_all, pos_flat = _positions(slot_exp_LRC)
    land = cost.landing_ms > 0  # the owners' landing of returned gradients: a rank's time depends on others' slots
    load = slot_ms(tok_LRC, np.arange(C)).sum(axis=2) + landing_LR(slot_exp_LRC, tok_LRC, num_owned, cost)
    la = np.arange(L)
    cC = np.arange(C)[None, :]
    nth_L = np.zeros(L, dtype=np.int64)  # the rank that sheds: 0 the straggler, k the k-th below it (when stuck)
    depth = min(R, int(chain_depth))
    for _ in range(max_iters):
        if la.size == 0:
            break
        A, a1, ld, h, lh, dpos = straggler_hosts(load, la, e_all, pos_flat, E, R, nth_L[la])
        r = np.where(dpos >= 0, ld[:, None, :], np.inf).argmin(axis=2)  # lightest co-host of each slot's expert
        d = dpos[a1[:, None], cC, r]  # its slot, -1: none
        ok = d >= 0
        dp = np.maximum(d, 0)
        nh = tok_LRC[la, h]  # [A, C]
        nd = tok_LRC[la[:, None], r, dp]
        base_h = lh[:, None] - slot_ms(nh, cC)
        base_r = ld[a1[:, None], r] - slot_ms(nd, dp)

        def times(x):
            return base_h + slot_ms(nh - x, cC), base_r + slot_ms(nd + x, dp)

        lo, hi = np.zeros_like(nh), np.where(ok, nh, 0)
        while (hi > lo).any():  # largest x with the co-host still at or below the straggler
            mid = (lo + hi + 1) // 2
            th, tr = times(mid)
            up = tr <= th
            lo, hi = np.where(up, mid, lo), np.where(up, hi, mid - 1)
        x1 = np.minimum(lo + 1, nh)
        s0, s1 = np.maximum(*times(lo)), np.maximum(*times(x1))
        x = np.where(s1 < s0, x1, lo)
        score = np.where(ok & (x > 0), np.minimum(s0, s1), np.inf)
        c = score.argmin(axis=1)
        go = score[a1, c] < lh * (1.0 - 1e-9)  # the pair's larger time drops below the shedding rank's
        nth_L[la] = np.where(go, 0, nth_L[la] + 1)  # stuck: next round the rank below sheds, making room
        keep = go | (nth_L[la] < depth)
        if go.any():
            lg, h, c, a1 = la[go], h[go], c[go], a1[go]
            rr, xs, dest = r[a1, c], x[a1, c], d[a1, c]
            tok_LRC[lg, h, c] -= xs
            tok_LRC[lg, rr, dest] += xs
            if land:  # a replica emptied or first used changes its owner's landing: the moved layers' ranks anew
                load[lg] = slot_ms(tok_LRC[lg], cC[None]).sum(axis=2) + landing_LR(
                    slot_exp_LRC[lg], tok_LRC[lg], num_owned, cost)
            else:
                for rk in (h, rr):
                    load[lg, rk] = slot_ms(tok_LRC[lg, rk], cC).sum(axis=1)
        la = la[keep]
    return tok_LRC


# level_passes' rounds: 4 took the update stage's MoE time to within 0.003 ms per micro-step of 16 (2 R at EP 8)
# on the trace and Qwen3 synthetic loads, in a quarter of the time (docs/simulator.md, levers)
PASS_ROUNDS = 4


def _top3(t_QAR: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, ranks) of each pass's and layer's three slowest ranks ``[Q, A, 3]`` (-inf past R)."""
    Q, A, R = t_QAR.shape
    if R < 3:
        t_QAR = np.concatenate([t_QAR, np.full((Q, A, 3 - R), -np.inf)], axis=2)
    i = np.argsort(-t_QAR, axis=2, kind="stable")[:, :, :3]
    return np.take_along_axis(t_QAR, i, axis=2), i


def level_passes(slot_exp_LRC: np.ndarray, tok_LRC: np.ndarray, cost: CostModel, num_owned: int,
                 max_iters: int = PASS_ROUNDS, grid: int = 9) -> np.ndarray:
    """Lower each layer's sum over passes of each pass's slowest rank (``cost.passes``: the forward and the
    backward wait for their own stragglers) by moving tokens between co-hosts; in place, returned.

    Per round and layer: from each pass's straggler h, each of h's slots paired with the co-host of its expert
    lightest in all passes; the move x on a grid of ``grid`` points over [0, h's tokens there], then a grid as fine
    around the best, each scored as the layer's time after it (the other ranks' maxima unchanged); the best move
    over passes, slots and x is applied if it lowers the layer's time. Only moves between copies already placed.
    Cost per round: O(A Q^2 C grid) table lookups (A active layers, Q passes, C slots), vectorized over layers."""
    Q = len(cost.passes)
    if Q < 2:
        return tok_LRC
    L, R, C = tok_LRC.shape
    fs = [slot_ms_fn(*q, C, num_owned) for q in cost.passes]

    def ms(q, n, c):
        return fs[q](n, c)

    E, e_all, pos_flat = _positions(slot_exp_LRC)
    cC = np.arange(C)
    t_QLR = pass_ms_QLR(tok_LRC, cost, num_owned, slot_exp_LRC)
    # only the layers where the passes' stragglers are apart: where one rank is the slowest of every pass, its
    # sum is the layer's time and ``level_time`` has levelled it
    la = np.flatnonzero(t_QLR.max(axis=2).sum(axis=0) > t_QLR.sum(axis=0).max(axis=1) * (1.0 + 1e-6))
    frac = np.linspace(0.0, 1.0, grid)
    for _ in range(max_iters):
        if la.size == 0:
            break
        t_QAR = t_QLR[:, la]
        now = t_QAR.max(axis=2).sum(axis=0)  # [A]
        v3, i3 = _top3(t_QAR)
        best = np.full(la.size, np.inf)
        move = np.zeros((4, la.size), dtype=np.int64)  # h, c, r, slot on r; x
        move_x = np.zeros(la.size, dtype=np.int64)
        for p in range(Q):  # from pass p's straggler
            A, a1, _, h, _, dpos = straggler_hosts(t_QLR[p], la, e_all, pos_flat, E, R)
            r = np.where(dpos >= 0, t_QAR.sum(axis=0)[:, None, :], np.inf).argmin(axis=2)  # [A, C]
            d = dpos[a1[:, None], cC[None, :], r]
            ok = d >= 0
            dp = np.maximum(d, 0)
            nh, nd = tok_LRC[la, h], tok_LRC[la[:, None], r, dp]  # [A, C]
            rest, base_h, base_r = [], [], []
            for q in range(Q):  # each pass's max over the ranks other than h and r, and the two ranks' other slots
                i, v = i3[q][:, None, :], v3[q][:, None, :]
                other = (i != h[:, None, None]) & (i != r[:, :, None])
                rest.append(np.where(other, v, -np.inf).max(axis=2))
                base_h.append(t_QAR[q, a1, h][:, None] - ms(q, nh, cC))
                base_r.append(t_QAR[q][a1[:, None], r] - ms(q, nd, dp))

            def score(x):  # [A, C, G]: the layer's time after moving x
                s = 0.0
                for q in range(Q):
                    s = s + np.maximum(np.maximum(rest[q][..., None], base_h[q][..., None] + ms(q, nh[..., None] - x,
                        cC[None, :, None])), base_r[q][..., None] + ms(q, nd[..., None] + x, dp[..., None]))
                return np.where(ok[..., None] & (x > 0), s, np.inf)

            x = np.rint(nh[..., None] * frac).astype(np.int64)
            g = score(x).argmin(axis=2)
            step = np.maximum(nh / (grid - 1), 1.0)
            xb = np.take_along_axis(x, g[..., None], axis=2)
            x = np.clip(xb + np.rint(step[..., None] * np.linspace(-1.0, 1.0, grid)).astype(np.int64), 0, nh[..., None])
            s = score(x).reshape(A, -1)
            k = s.argmin(axis=1)
            sk = s[a1, k]
            c, gk = np.divmod(k, grid)
            better = sk < best
            best = np.where(better, sk, best)
            for j, v in enumerate((h, c, r[a1, c], dp[a1, c])):
                move[j] = np.where(better, v, move[j])
            move_x = np.where(better, x[a1, c, gk], move_x)
        go = best < now * (1.0 - 1e-9)
        if not go.any():
            break
        la, (h, c, rr, dest), xs = la[go], move[:, go], move_x[go]
        tok_LRC[la, h, c] -= xs
        tok_LRC[la, rr, dest] += xs
        if cost.landing_ms > 0:  # the moved layers' ranks anew (an owner's landing follows others' slots)
            t_QLR[:, la] = pass_ms_QLR(tok_LRC[la], cost, num_owned, slot_exp_LRC[la])
        else:
            for rk in (h, rr):
                t_QLR[:, la, rk] = pass_ms_QLR(tok_LRC[la, rk], cost, num_owned)
    return tok_LRC

