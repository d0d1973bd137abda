"""Balanced bin packing with equal-count bins, vectorized over a batch (usually layers).

Shared by the step-level owner placement and the EPLB baseline: both need
"heaviest item first into the lightest bin that still has room".
"""

from __future__ import annotations

import numpy as np


def balanced_packing(weight_BI: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack I items into num_packs bins of exactly I / num_packs items each.

    Returns (pack_BI, slot_BI): the bin of every item and its position inside the bin.
    Greedy LPT: items sorted by weight (descending, ties by index for determinism)
    each go to the lightest bin that is not yet full.
    """
    B, I = weight_BI.shape
    if I % num_packs:
        raise ValueError(f"packing: {I} items do not divide into {num_packs} bins")
    cap = I // num_packs
    pack_BI = np.zeros((B, I), dtype=np.int64)
    slot_BI = np.zeros((B, I), dtype=np.int64)
    if cap == 1:  # one item per bin: any bijection is optimal; keep heaviest -> bin 0 order
        order = np.argsort(-weight_BI, axis=1, kind="stable")
        np.put_along_axis(pack_BI, order, np.arange(I)[None, :].repeat(B, 0), axis=1)
        return pack_BI, slot_BI
    order_BI = np.argsort(-weight_BI, axis=1, kind="stable")
    bin_w = np.zeros((B, num_packs), dtype=np.float64)
    bin_n = np.zeros((B, num_packs), dtype=np.int64)
    bi = np.arange(B)
    w_sorted = np.take_along_axis(weight_BI, order_BI, axis=1).astype(np.float64)
    for k in range(I):
        cand = np.where(bin_n < cap, bin_w, np.inf)
        p = cand.argmin(axis=1)
        item = order_BI[:, k]
        pack_BI[bi, item] = p
        slot_BI[bi, item] = bin_n[bi, p]
        bin_w[bi, p] += w_sorted[:, k]
        bin_n[bi, p] += 1
    return pack_BI, slot_BI


def greedy_match(overlap_BKK: np.ndarray) -> np.ndarray:
    """Greedy max-overlap matching of K new bins to K old bins per batch row.

    Returns old_of_new_BK. Used to relabel a fresh placement so that as many
    experts as possible stay where they were (fewer owner moves).
    """
    B, K, _ = overlap_BKK.shape
    ov = overlap_BKK.astype(np.float64).copy()
    out = np.zeros((B, K), dtype=np.int64)
    bi = np.arange(B)
    for _ in range(K):
        flat = ov.reshape(B, -1).argmax(axis=1)
        i, j = np.divmod(flat, K)
        out[bi, i] = j
        ov[bi, i, :] = -np.inf
        ov[bi, :, j] = -np.inf
    return out
