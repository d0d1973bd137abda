"""Which engine serves each prompt's samples: the step's requests dealt over the fleet by outstanding tokens.

A request is one prompt with its ``n`` samples (one engine keeps a prompt's samples together: they share the
prompt's prefix-cache blocks). Its weight is the tokens it puts on its engine, estimated before it runs:
``prompt + n * expected response`` (``request_tokens``; the expected response is ``max_tokens`` unless the
caller knows better, e.g. the last step's mean). ``deal`` is longest-processing-time: requests by weight,
heaviest first, each to the alive engine with the fewest outstanding tokens (ties: lowest index), so engines
end equally loaded in tokens, not in request counts. It is a pure function of the weights, so every data-parallel
rank computes the same deal from the step's gathered weights (one all-gather of G int64 per step) and sends only
its own requests; after an engine fails, the survivors re-deal its requests the same way, starting from the
loads they already carry.

The simulator deals the same estimates (``simulator/rollout.py``), then charges each engine the real lengths of
what it was dealt: its longest response bounds its time.

Cost at R = 1024 ranks, 2 requests per rank (G = 2048), K = 128 engines: one sort and G heap steps on every
rank, ~2 ms of Python; 16 KB gathered per rank per step.

Legend: G requests of the step (all ranks'), K engines.
"""

from __future__ import annotations

import heapq

import numpy as np


def request_tokens(prompt_tokens_G: np.ndarray, samples_G: np.ndarray | int, expected_response: float) -> np.ndarray:
    """``[G]`` int64: tokens each request is expected to put on its engine (prompt once, its samples' responses)."""
    p = np.asarray(prompt_tokens_G, dtype=np.int64)
    return p + np.asarray(samples_G, dtype=np.int64) * int(round(expected_response))


def deal(tokens_G: np.ndarray, alive_K: np.ndarray, load_K: np.ndarray | None = None) -> np.ndarray:
    """``[G]`` int64: the engine of each request. ``alive_K``: bool per engine (a dead one gets nothing);
    ``load_K``: tokens the engines already carry (default none). Raises ValueError when no engine is alive."""
    tokens_G = np.asarray(tokens_G, dtype=np.int64)
    alive_K = np.asarray(alive_K, dtype=bool)
    alive = np.flatnonzero(alive_K)
    if not len(alive):
        raise ValueError("engine fleet: no engine is alive to serve the step's requests")
    load = np.zeros(len(alive_K), dtype=np.int64) if load_K is None else np.asarray(load_K, dtype=np.int64)
    heap = [(int(load[k]), int(k)) for k in alive]
    heapq.heapify(heap)
    out_G = np.empty(len(tokens_G), dtype=np.int64)
    for g in np.argsort(-tokens_G, kind="stable"):
        l, k = heapq.heappop(heap)
        out_G[g] = k
        heapq.heappush(heap, (l + int(tokens_G[g]), k))
    return out_G


def engine_tokens(tokens_G: np.ndarray, engine_G: np.ndarray, engines: int) -> np.ndarray:
    """``[K]``: tokens dealt to each engine."""
    return np.bincount(np.asarray(engine_G), weights=np.asarray(tokens_G, dtype=np.float64),
                       minlength=engines).astype(np.int64)
