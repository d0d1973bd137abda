"""Reactive baseline: plan every layer of every forward from that layer's own counts.

What the reactive peers do (Megatron-LM's virtual-expert balancing, LLEP's
least-loaded expert parallelism): after the router of a layer, all-gather its
token counts, plan, move the weights, then run the experts. No look-ahead across
micro-steps, so the plan and the weight moves sit before the layer's expert compute,
and nothing stays resident: every spill is a fresh weight transfer in every forward.

The plan is LLEP's longest-processing-time spill, written here for our slot budget:
experts in decreasing load; an expert stays on its owner up to the capacity
``ceil(mean)`` counting the owner's still-pending native load, and the rest spills to
the helper with the smallest effective load that has a free spare slot (at most S
foreign experts per rank, the same memory budget as the other balancers), in chunks
of at least ``min_chunk`` tokens. What no helper can take stays on the owner.

Shapes: M micro-steps, L layers, E experts, R ranks, K = E/R owned, S spare, C = K + S.
Plain Python per layer: R and E are small (<= 256), and it is what runs per layer.
"""

from __future__ import annotations

import time

import numpy as np

from .split import assign_from_slots
from .types import TRANSFER_DTYPE, Topology


def plan_layer(load_E, num_ranks: int, spare_slots: int, min_chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer's reactive plan. Returns (slots_RC, tok_RC), owned experts first."""
    load = [int(x) for x in load_E]
    E, R, S = len(load), num_ranks, spare_slots
    K = E // R
    slots = np.full((R, K + S), -1, dtype=np.int64)
    slots[:, :K] = np.arange(E).reshape(R, K)
    tok = np.zeros((R, K + S), dtype=np.int64)
    tok[:, :K] = np.asarray(load, dtype=np.int64).reshape(R, K)
    total = sum(load)
    if S == 0 or total == 0:
        return slots, tok
    cap = -(-total // R)
    pending = [sum(load[r * K : (r + 1) * K]) for r in range(R)]
    if max(pending) <= cap:
        return slots, tok
    assigned = [0] * R
    used = [0] * R
    for e in sorted(range(E), key=lambda i: -load[i]):  # stable: ties by expert id
        n = load[e]
        if n == 0:
            break
        o = e // K
        pending[o] -= n
        keep = min(n, max(cap - assigned[o] - pending[o], 0))
        rest = n - keep  # tokens to spill
        if rest > 0:
            helpers = sorted((assigned[h] + pending[h], h) for h in range(R) if h != o and used[h] < S)
            for eff, h in helpers:
                chunk = min(rest, cap - eff)
                if chunk <= 0 or (chunk < min_chunk and chunk < rest):
                    continue
                slots[h, K + used[h]] = e
                tok[h, K + used[h]] = chunk
                used[h] += 1
                assigned[h] += chunk
                rest -= chunk
                if rest == 0:
                    break
        keep += rest  # what no helper could take stays on the owner
        tok[o, e % K] = keep
        assigned[o] += keep
    return slots, tok


def plan_reactive(
    load_MLE: np.ndarray, topology: Topology, spare_slots: int, min_gain: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Plan a stage layer by layer; every plan sees only its own (micro-step, layer) counts.

    Returns (slots_MLRC, assign_MLER, transfers_T, plan_ms_ML): every spare slot in use is
    a transfer from the owner in that micro-step (nothing resident across forwards);
    plan_ms_ML is the measured planning time of each layer (what sits on its critical path).
    """
    M, L, E = load_MLE.shape
    R = topology.num_ranks
    K, S = E // R, spare_slots
    node_R = topology.node_of_rank_R()
    slots = np.empty((M, L, R, K + S), dtype=np.int64)
    tok = np.empty_like(slots)
    plan_ms = np.zeros((M, L))
    for m in range(M):
        for layer in range(L):
            load_E = load_MLE[m, layer]
            t0 = time.perf_counter()
            min_chunk = max(1, int(np.ceil(min_gain * load_E.sum() / R)))
            slots[m, layer], tok[m, layer] = plan_layer(load_E, R, S, min_chunk)
            plan_ms[m, layer] = (time.perf_counter() - t0) * 1e3
    assign = assign_from_slots(slots.reshape(M * L, R, -1), tok.reshape(M * L, R, -1), E).reshape(M, L, E, R)
    m, l, r, c = np.nonzero(slots[:, :, :, K:] >= 0)
    tr = np.zeros(len(m), dtype=TRANSFER_DTYPE)
    e = slots[m, l, r, K + c]
    tr["micro_step"], tr["layer"], tr["expert"] = m, l, e
    tr["src_rank"], tr["dst_rank"] = e // K, r
    tr["inter_node"] = node_R[e // K] != node_R[r]
    return slots, assign, tr, plan_ms
