"""``schedule_sequences``: put every sequence of a step on a (rank, micro-step) before the stage starts.

Policies: ``rollout_order`` (today's dealing: each rank keeps its rows, in order) and ``balanced`` (levels each
micro-step's per-rank dense cost, then spreads expert loads among equally level choices; balanced.py).

Legend: N sequences of the step over all R data-parallel ranks, U mini-batches, M micro-steps per mini-batch,
E experts. Cost at N = 4096, R = 1024: see docs/schedule.md (milliseconds on one host core, O(N) memory).
"""

from __future__ import annotations

import numpy as np

from . import balanced
from .cost import DenseCost
from .types import SequenceSchedule

POLICIES = ("balanced", "rollout_order")


def _int_array(name: str, x, n: int | None) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"schedule_sequences: {name} must be a 1-D integer array, got dtype {a.dtype} "
                         f"shape {a.shape}")
    if n is not None and a.shape[0] != n:
        raise ValueError(f"schedule_sequences: {name} has {a.shape[0]} entries, tokens_N has {n}")
    if a.size and a.min() < 0:
        raise ValueError(f"schedule_sequences: {name} has a negative entry at sequence {int(a.argmin())}")
    return a.astype(np.int64)


def _check_budget(tokens_N: np.ndarray, max_tokens: int | None) -> None:
    if max_tokens is None:
        return
    if max_tokens <= 0:
        raise ValueError(f"schedule_sequences: max_tokens must be positive, got {max_tokens}")
    over = np.flatnonzero(tokens_N > max_tokens)
    if over.size:
        i = int(over[0])
        raise ValueError(f"schedule_sequences: sequence {i} computes {int(tokens_N[i])} positions, over the "
                         f"per-rank budget max_tokens={max_tokens} ({over.size} such sequences); raise "
                         f"max_tokens_per_micro_step to at least {int(tokens_N.max())}")


def _streams(minibatch_N: np.ndarray, key_N: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sequences ordered by (key, mini-batch, id), each one's stream id and its position in its stream."""
    n = len(key_N)
    order = np.lexsort((np.arange(n), minibatch_N, key_N))
    stream = key_N[order] * (int(minibatch_N.max(initial=0)) + 1) + minibatch_N[order]
    start = np.r_[True, stream[1:] != stream[:-1]][:n]
    first = np.maximum.accumulate(np.where(start, np.arange(n), 0))
    return order, start, np.arange(n) - first


def _next_fit(tok_sorted: np.ndarray, start: np.ndarray, budget: int) -> np.ndarray:
    """Micro-step of each sequence when each stream fills micro-steps in order up to ``budget`` tokens.

    Vectorized over streams: one ``searchsorted`` per micro-step index (O(M S log N)).
    """
    n = len(tok_sorted)
    csum = np.cumsum(tok_sorted)
    before = csum - tok_sorted  # tokens before each position
    stream_start = np.flatnonzero(start)
    stream_end = np.r_[stream_start[1:], n]
    opens = np.zeros(n, dtype=np.int64)  # 1 where a micro-step opens
    ptr = stream_start.copy()
    while ptr.size:
        opens[ptr] = 1
        nxt = np.searchsorted(csum, before[ptr] + budget, side="right")  # first position past the budget
        ptr = np.minimum(np.maximum(nxt, ptr + 1), stream_end)
        live = ptr < stream_end
        ptr, stream_end = ptr[live], stream_end[live]
    micro = np.cumsum(opens)
    return micro - micro[np.maximum.accumulate(np.where(start, np.arange(n), 0))]


def _rollout_order(tokens_N, minibatch_N, source_N, ranks, rows_per_micro, max_tokens, U):
    n = len(tokens_N)
    order, start, pos = _streams(minibatch_N, source_N)
    if rows_per_micro is not None:
        micro_sorted = pos // rows_per_micro
    else:
        micro_sorted = _next_fit(tokens_N[order], start, max_tokens)
    micro_N = np.empty(n, dtype=np.int64)
    micro_N[order] = micro_sorted
    M = int(micro_N.max()) + 1 if n else 1
    return SequenceSchedule(source_N.copy(), micro_N, minibatch_N, M, ranks, U)


def _balanced(tokens_N, minibatch_N, ranks, micro_steps, max_tokens, cost, loads_NE, ep, U):
    n = len(tokens_N)
    cost_N = cost.of(tokens_N)
    budget = float(max_tokens) if max_tokens is not None else np.inf
    members = [np.flatnonzero(minibatch_N == u) for u in range(U)]
    M = micro_steps or 1
    if max_tokens is not None:  # the fewest micro-steps every mini-batch fits in, shared by all of them
        for ids in members:
            m = max(M, -(-int(tokens_N[ids].sum()) // (ranks * max_tokens)))
            while balanced.deal(cost_N[ids], tokens_N[ids], ranks * m, budget) is None:
                m += 1
            M = m
    rank_N, micro_N = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    for ids in members:
        c, t = cost_N[ids], tokens_N[ids]
        bin_ = balanced.deal(c, t, ranks * M, budget)
        bin_ = balanced.polish(c, t, bin_, ranks * M, budget)
        rank, micro = balanced.to_cells(c, bin_, ranks, M)
        stage = balanced.stage_cost(c, rank, micro, ranks, M)
        if M > 1 and stage > c.sum() / ranks * (1.0 + 1e-3):  # bins not level (long sequences): try levels
            alt = balanced.levels(c, t, ranks, M, budget)
            if alt is not None and balanced.stage_cost(c, *alt, ranks, M) < stage:
                rank, micro = alt
        rank_N[ids], micro_N[ids] = rank, micro
    if loads_NE is not None and n:
        cell_N = micro_N * (ranks // ep) + rank_N // ep
        src_N = balanced.spread_experts(tokens_N, minibatch_N, cell_N, loads_NE)
        new_rank, new_micro = np.empty_like(rank_N), np.empty_like(micro_N)
        new_rank[src_N], new_micro[src_N] = rank_N, micro_N
        rank_N, micro_N = new_rank, new_micro
    return SequenceSchedule(rank_N, micro_N, minibatch_N, M, ranks, U)


def schedule_sequences(tokens_N, minibatch_N, source_N, *, ranks: int, policy: str = "balanced",
                       rows_per_micro: int | None = None, micro_steps: int | None = None,
                       max_tokens: int | None = None, cost: DenseCost = DenseCost(),
                       loads_NE: np.ndarray | None = None, ep: int = 1) -> SequenceSchedule:
    """Destination rank and micro-step of every sequence of a step; same result on every rank.

    ``tokens_N``: positions each sequence computes (length - 1); ``minibatch_N``: its optimizer step within the
    stage (never changed); ``source_N``: the rank holding it (a rank's rows in ascending global id are its
    rollout order). ``rollout_order`` takes ``rows_per_micro`` (today's dealing) or ``max_tokens`` (each rank
    fills micro-steps in order up to the budget). ``balanced`` takes ``micro_steps`` and/or ``max_tokens``
    (then M is the fewest micro-steps the budget packs into, at least ``micro_steps``). ``loads_NE``:
    token-expert counts per sequence (summed over layers), spread over (micro-step, EP group) among
    equal-length sequences. Every rank and mini-batch gets the same ``micro_steps``; cells may be empty.
    """
    tokens_N = _int_array("tokens_N", tokens_N, None)
    n = tokens_N.shape[0]
    minibatch_N = _int_array("minibatch_N", minibatch_N, n)
    source_N = _int_array("source_N", source_N, n)
    if ranks < 1:
        raise ValueError(f"schedule_sequences: ranks must be >= 1, got {ranks}")
    if n and source_N.max() >= ranks:
        i = int(source_N.argmax())
        raise ValueError(f"schedule_sequences: sequence {i} has source rank {int(source_N[i])}, outside {ranks} ranks")
    if policy not in POLICIES:
        raise ValueError(f"schedule_sequences: policy {policy!r} is not one of {POLICIES}")
    if ep < 1 or ranks % ep:
        raise ValueError(f"schedule_sequences: ep={ep} must divide ranks={ranks}")
    for name, v in (("rows_per_micro", rows_per_micro), ("micro_steps", micro_steps)):
        if v is not None and v < 1:
            raise ValueError(f"schedule_sequences: {name} must be >= 1, got {v}")
    if loads_NE is not None and (np.ndim(loads_NE) != 2 or np.shape(loads_NE)[0] != n):
        raise ValueError(f"schedule_sequences: loads_NE must be [N={n}, E], got shape {np.shape(loads_NE)}")
    _check_budget(tokens_N, max_tokens)
    U = int(minibatch_N.max()) + 1 if n else 1
    if policy == "rollout_order":
        if (rows_per_micro is None) == (max_tokens is None):
            raise ValueError("schedule_sequences: rollout_order takes exactly one of rows_per_micro or max_tokens")
        return _rollout_order(tokens_N, minibatch_N, source_N, ranks, rows_per_micro, max_tokens, U)
    if micro_steps is None and max_tokens is None:
        raise ValueError("schedule_sequences: balanced needs micro_steps or max_tokens")
    return _balanced(tokens_N, minibatch_N, ranks, micro_steps, max_tokens, cost, loads_NE, ep, U)
