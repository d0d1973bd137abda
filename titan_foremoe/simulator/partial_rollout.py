"""Partial rollouts (Kimi k1.5 / AReaL style): each step's generation stops at a budget, the unfinished responses
continue in the next step under the new weights.

``[rl] rollout_token_budget`` (the runtime's knob): a fraction f in (0, 1] stops the step's generation once f of the
responses in flight have finished (the client aborts the rest: in the steady state f x in-flight = the step's
batch, so B / f responses are in flight); an integer > 1 once the finished responses hold that many tokens.
``[rl] partial_max_staleness`` m drops a response that could only train more than m steps after its first token
(its tokens are wasted). Each step the engines
hold the carried responses and the step's new requests, dealt by the runtime's fleet client (``dealing.deal``: a
new request is a prompt with its samples, estimated prompt + n x ``max_tokens``; a carried response is a request of
its own on the engine that began it, estimated prompt + ``max_tokens``, and the new requests are dealt on top of
those loads, ``deal``'s ``load_K``); every carried response is prefilled again (its
KV cache was computed with the old weights), the new prompts once per request. The step trains on the responses
that finished in it; the step's rollout is the slowest engine's ``EngineModel.fleet_ms`` (``decode_table.py``:
``rollout.py``'s model), which is what the partial rollout buys: the longest response no longer bounds a step's
decode steps, and the batch slots stay full.

Per-token staleness: a token generated in step s of a response that finishes (and trains) in step s_f is
``s_f - s`` steps old, plus the pipeline's lag (1 with the engines one step ahead, 0 colocated).

Legend: B responses per step, N responses in flight, K engines, S steps simulated, A staleness ages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..rollouts.fleet.dealing import deal
from .decode_table import EngineModel


_DEALS: dict = {}


def deal_cached(est_G: np.ndarray, K: int, load_K: np.ndarray | None = None) -> np.ndarray:
    """``dealing.deal`` of ``est_G`` over K alive engines carrying ``load_K``, memoized: the split search deals the
    same estimates on the same relative loads over and over (every window, every step of equal requests); the
    deal depends on the loads only through their differences."""
    load = np.zeros(K, np.int64) if load_K is None else np.asarray(load_K, np.int64) - int(np.min(load_K))
    key = (K, np.asarray(est_G, np.int64).tobytes(), load.tobytes())
    if key not in _DEALS:
        if len(_DEALS) > 4096:
            _DEALS.clear()
        _DEALS[key] = deal(est_G, np.ones(K, bool), load)
    return _DEALS[key]


@dataclass(frozen=True)
class Budget:
    """``[rl] rollout_token_budget``: ``fraction`` of the in-flight responses that must finish, or ``tokens`` the
    finished responses must hold (exactly one of them)."""

    fraction: float = 0.0
    tokens: int = 0

    @staticmethod
    def parse(v) -> "Budget":
        """0 < v <= 1: a fraction; an integer > 1: tokens (the runtime's ``[rl] rollout_token_budget``); one clear
        line otherwise."""
        try:
            x = float(v)
        except ValueError:
            x = -1.0
        if 0 < x <= 1:
            return Budget(fraction=x)
        if x > 1 and x == int(x):
            return Budget(tokens=int(x))
        raise ValueError(f"rollout_token_budget {v!r}: a fraction in (0, 1] of the responses in flight that must "
                         "finish, or an integer > 1 of tokens the finished responses must hold")

    def stop(self, rem_N: np.ndarray, length_N: np.ndarray) -> int:
        """Decode steps this step runs: until ``fraction`` of the responses (``rem_N`` tokens left each) have
        finished, or until the finished ones hold ``tokens`` (``length_N``: each one's whole length); all of them
        when the budget is not reached."""
        order = np.argsort(rem_N, kind="stable")
        if self.tokens:
            i = int(np.searchsorted(np.cumsum(length_N[order]), self.tokens))
            return int(rem_N[order[min(i, len(order) - 1)]])
        need = max(int(np.ceil(self.fraction * len(rem_N))), 1)
        return int(rem_N[order[need - 1]])

    def __str__(self) -> str:
        return f"{self.tokens} tokens" if self.tokens else f"{self.fraction:g} of the responses"


def partial_steps(eng: EngineModel, lens_by_step: list[np.ndarray], K: int, budget: Budget, samples_per_prompt: int,
                  max_tokens: int, lag: int = 0, warmup: int = 0, max_staleness: int | None = None) -> dict:
    """Run the partial rollout over the steps of ``lens_by_step`` (each step's new responses' full lengths) on K
    engines of ``eng``; the first ``warmup`` steps fill the pipeline and are not counted. Per counted step:
    ``rollout_ms_S``, ``tokens_S`` (generated), ``trained_tokens_S`` / ``trained_S`` (finished responses' tokens /
    count), ``dropped_S`` / ``wasted_tokens_S`` (responses dropped as too old: ``max_staleness``, the runtime's
    ``[rl] partial_max_staleness``, drops a response once the step that could train it is more than that many steps
    after its first token; None: never), ``decode_steps_S``; ``staleness_A`` (tokens trained at each age) and its ``staleness_mean`` /
    ``staleness_max`` / ``stale_share`` (tokens older than the trained weights)."""
    P, n = eng.P, max(int(samples_per_prompt), 1)
    S = len(lens_by_step)
    rem = np.zeros(0, np.int64)
    pos = np.zeros(0, np.int64)
    born = np.zeros(0, np.int64)
    engine = np.zeros(0, np.int64)  # the engine of each in-flight response
    hist = np.zeros((0, S), np.int64)  # tokens each in-flight response generated in each step
    out = {k: [] for k in ("rollout_ms_S", "tokens_S", "trained_tokens_S", "trained_S", "decode_steps_S",
                           "in_flight_S", "dropped_S", "wasted_tokens_S")}
    age_A = np.zeros(S + lag + 1, np.int64)
    for s, lens in enumerate(lens_by_step):
        lens = np.minimum(np.asarray(lens, np.int64), max_tokens)
        carried = len(rem)
        G = -(-len(lens) // n)
        size_G = np.minimum(n, len(lens) - n * np.arange(G))
        # a continuation stays on its engine (it carries its estimate there); the new prompts are dealt on top
        carry_K = np.bincount(engine, weights=np.full(len(engine), P + max_tokens), minlength=K).astype(np.int64)
        engine_G = deal_cached(P + size_G * max_tokens, K, carry_K)
        engine_R = np.concatenate([engine, engine_G])
        engine_N = np.concatenate([engine, np.repeat(engine_G, size_G)])
        rem = np.concatenate([rem, lens])
        pos = np.concatenate([pos, np.zeros(len(lens), np.int64)])
        born = np.concatenate([born, np.full(len(lens), s)])
        hist = np.concatenate([hist, np.zeros((len(lens), S), np.int64)])
        t = budget.stop(rem, pos + rem)
        gen = np.minimum(rem, t)
        ctx_R = np.concatenate([P + pos[:carried], np.full(G, P)])
        pre_tok = np.bincount(engine_R, weights=ctx_R, minlength=K)
        pre_pairs = np.bincount(engine_R, weights=ctx_R * (ctx_R + 1) / 2, minlength=K)
        r = eng.fleet_ms(engine_N, gen, K, pos, pos + rem, pre_tok, pre_pairs)
        hist[:, s] = gen
        rem, pos = rem - gen, pos + gen
        done = rem == 0
        drop = ~done & (s + 1 + lag - born > (np.inf if max_staleness is None else max_staleness))
        if s >= warmup:
            for k, v in (("rollout_ms_S", r["rollout_ms"]), ("tokens_S", float(gen.sum())),
                         ("trained_tokens_S", float(pos[done].sum())), ("trained_S", int(done.sum())),
                         ("decode_steps_S", float(r["decode_steps_K"].max())), ("in_flight_S", len(done)),
                         ("dropped_S", int(drop.sum())), ("wasted_tokens_S", float(pos[drop].sum()))):
                out[k].append(v)
            ages = s - np.arange(S) + lag  # a token of step j trains at s (+ lag): s - j + lag steps old
            np.add.at(age_A, ages[: s + 1], hist[done][:, : s + 1].sum(axis=0))
        keep = ~done & ~drop
        rem, pos, hist, engine, born = rem[keep], pos[keep], hist[keep], engine_N[keep], born[keep]
    tot = max(int(age_A.sum()), 1)
    A = np.arange(len(age_A))
    return {**{k: np.asarray(v) for k, v in out.items()}, "staleness_A": age_A,
            "staleness_mean": float((A * age_A).sum() / tot), "staleness_max": int(A[age_A > 0].max(initial=0)),
            "stale_share": float(age_A[1:].sum() / tot), "budget": str(budget)}
