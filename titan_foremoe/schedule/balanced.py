"""Balanced policy: level the dense cost of one mini-batch's sequences over its R * M (rank, micro-step) bins.

Three vectorized passes, each a pure function of its inputs (ties broken by index):
1. ``deal``: longest-processing-time in rounds: the B costliest unplaced sequences go, costliest first, to the
   B bins in ascending load order (one ``argsort`` of B bins per round instead of one heap pop per sequence).
   A sequence that would overflow the token budget takes the least loaded bin with room instead.
2. ``polish``: pairwise swaps: bins sorted by load, the i-th heaviest paired with the i-th lightest; per pair the
   one swap (or move, through an empty slot) that best halves their gap, all pairs at once; repeated.
3. ``to_cells``: bins sorted by load fill micro-step 0 with the R heaviest, micro-step 1 with the next R, ...,
   so the ranks of a micro-step carry the most similar loads (this minimizes the sum over micro-steps of the
   busiest rank for the given bins).
``spread_experts`` then permutes sequences of equal length (so every bin keeps its exact cost and tokens) so that
similar expert signatures fall in different (micro-step, EP group) cells.

Legend: N sequences of the mini-batch, B = R * M bins, P = B // 2 bin pairs, K slots per bin (most sequences
in a bin + 1 empty), E experts.
"""

from __future__ import annotations

import numpy as np

_POLISH_ROUNDS = 64
_POLISH_ELEMS = 1 << 22  # swap candidates evaluated at once (P * K * K), bounds the polish's memory to ~100 MB


def deal(cost_N: np.ndarray, tokens_N: np.ndarray, bins: int, budget: float) -> np.ndarray | None:
    """Bin of each sequence, or None when the token budget cannot be met with ``bins`` bins.

    O(N log B) time over N / B rounds; O(N + B) memory.
    """
    n = len(cost_N)
    order = np.lexsort((np.arange(n), -cost_N))  # costliest first, ties by index
    load_B, room_B = np.zeros(bins), np.full(bins, float(budget))
    bin_N = np.empty(n, dtype=np.int64)
    ids_B = np.arange(bins)
    for k in range(0, n, bins):
        items = order[k : k + bins]
        target = np.lexsort((ids_B, load_B))[: len(items)]
        fits = tokens_N[items] <= room_B[target]
        ok, bad = items[fits], items[~fits]
        bin_N[ok] = target[fits]
        load_B[target[fits]] += cost_N[ok]
        room_B[target[fits]] -= tokens_N[ok]
        for i in bad:  # rare: only when bins are nearly full
            room = np.flatnonzero(room_B >= tokens_N[i])
            if room.size == 0:
                return None
            b = room[np.argmin(load_B[room])]
            bin_N[i] = b
            load_B[b] += cost_N[i]
            room_B[b] -= tokens_N[i]
    return bin_N


def _slots(bin_N: np.ndarray, bins: int) -> np.ndarray:
    """``[B, K]`` sequence ids per bin (ascending), -1 in empty slots; K = largest bin + 1."""
    order = np.lexsort((np.arange(len(bin_N)), bin_N))
    counts_B = np.bincount(bin_N, minlength=bins)
    start_B = np.cumsum(counts_B) - counts_B
    slot_BK = np.full((bins, int(counts_B.max(initial=0)) + 1), -1, dtype=np.int64)
    slot_BK[bin_N[order], np.arange(len(order)) - start_B[bin_N[order]]] = order
    return slot_BK


def polish(cost_N: np.ndarray, tokens_N: np.ndarray, bin_N: np.ndarray, bins: int, budget: float,
           rounds: int = _POLISH_ROUNDS) -> np.ndarray:
    """Pairwise swap polish of ``deal``'s bins (see module doc); keeps every bin within ``budget`` tokens.

    O(rounds * (N log N + B K^2)) time, O(min(B K^2, 4M)) memory per chunk of pairs.
    """
    bin_N = bin_N.copy()
    if bins < 2 or len(bin_N) == 0:
        return bin_N
    for _ in range(rounds):
        load_B = np.bincount(bin_N, cost_N, minlength=bins)
        tok_B = np.bincount(bin_N, tokens_N.astype(np.float64), minlength=bins)
        slot_BK = _slots(bin_N, bins)
        K = slot_BK.shape[1]
        c_BK = np.where(slot_BK >= 0, cost_N[slot_BK], 0.0)
        t_BK = np.where(slot_BK >= 0, tokens_N[slot_BK], 0).astype(np.float64)
        by_load = np.lexsort((np.arange(bins), load_B))
        P = bins // 2
        heavy_P, light_P = by_load[::-1][:P], by_load[:P]
        moved = False
        step = max(1, _POLISH_ELEMS // (K * K))
        for a in range(0, P, step):
            h, l = heavy_P[a : a + step], light_P[a : a + step]
            gap = (load_B[h] - load_B[l])[:, None, None]
            d = c_BK[h][:, :, None] - c_BK[l][:, None, :]  # cost moved from heavy to light
            dt = t_BK[h][:, :, None] - t_BK[l][:, None, :]
            new_gap = np.abs(gap - 2.0 * d)
            ok = (d > 0) & (new_gap < gap * (1.0 - 1e-9))
            ok &= (tok_B[l][:, None, None] + dt <= budget) & (tok_B[h][:, None, None] - dt <= budget)
            score = np.where(ok, new_gap, np.inf).reshape(len(h), K * K)
            best = score.argmin(axis=1)
            go = np.isfinite(score[np.arange(len(h)), best])
            if not go.any():
                continue
            moved = True
            x = slot_BK[h[go], best[go] // K]  # always a sequence (d > 0)
            y = slot_BK[l[go], best[go] % K]  # a sequence, or -1 for a move into the empty slot
            bin_N[x] = l[go]
            bin_N[y[y >= 0]] = h[go][y >= 0]
        if not moved:
            break
    return bin_N


def to_cells(cost_N: np.ndarray, bin_N: np.ndarray, ranks: int, micro_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``(rank_N, micro_N)``: the R heaviest bins form micro-step 0, the next R micro-step 1, ..."""
    bins = ranks * micro_steps
    load_B = np.bincount(bin_N, cost_N, minlength=bins)
    pos_B = np.empty(bins, dtype=np.int64)
    pos_B[np.lexsort((np.arange(bins), -load_B))] = np.arange(bins)
    return pos_B[bin_N] % ranks, pos_B[bin_N] // ranks


def spread_experts(tokens_N: np.ndarray, group_N: np.ndarray, cell_N: np.ndarray, loads_NE: np.ndarray
                   ) -> np.ndarray:
    """Permutation ``src_N``: slot n takes sequence ``src_N[n]``'s place, only among equal (group, tokens).

    ``group_N`` is the mini-batch, ``cell_N`` the (micro-step, EP group) a slot feeds. Within each set of
    equal-length sequences, sequences sorted by signature (their busiest expert, then id) are dealt to slots
    ordered round-robin over cells, so neighbours in signature land in different cells. O(N log N + N E).
    """
    n = len(tokens_N)
    idx = np.arange(n)
    sig_N = np.asarray(loads_NE).argmax(axis=1)
    items = np.lexsort((idx, sig_N, tokens_N, group_N))  # sequences in (group, tokens, signature) order
    by_cell = np.lexsort((idx, cell_N, tokens_N, group_N))  # slots grouped by (group, tokens, cell)
    g, t, c = group_N[by_cell], tokens_N[by_cell], cell_N[by_cell]
    new_run = np.r_[True, (g[1:] != g[:-1]) | (t[1:] != t[:-1]) | (c[1:] != c[:-1])]
    run_start = np.maximum.accumulate(np.where(new_run, np.arange(n), 0))
    occ = np.empty(n, dtype=np.int64)
    occ[by_cell] = np.arange(n) - run_start  # k-th slot of its cell within its tie set
    slots = np.lexsort((idx, cell_N, occ, tokens_N, group_N))  # round-robin over cells within a tie set
    src_N = np.empty(n, dtype=np.int64)
    src_N[slots] = items
    return src_N
