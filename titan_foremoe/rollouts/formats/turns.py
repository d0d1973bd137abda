"""Multi-turn records -> one sample: the turns' routes stitched, the assistant's tokens marked for the loss.

An agent loop sends the conversation again at every turn: turn i's input is the whole sequence so far
(earlier prompts, outputs and the tool / user tokens appended since), its output the assistant's next
message. Engines that reuse a cached prefix return routes only from an offset (vLLM
``routed_experts_prompt_start``, SGLang ``routed_experts_start_len``): turn i's rows cover positions
``[start_i, len(input_i) + len(output_i) - 1)``, and the positions before ``start_i`` must come from
earlier turns. Stitching writes every turn's rows at their positions (a later turn's rows win where
two overlap: the same tokens through the same weights) and refuses a sequence with any position left
uncovered, naming the turn and offset that left it, never replaying a shifted or zero-filled route.

Loss mask (``loss_mask_T``): the output tokens of every turn whose ``role`` is ``assistant`` (the
default) are trained; the tokens a later turn's input adds (tool results, user messages) are
replayed and routed but not trained. When every completion token is an assistant output (one turn, or
turns with nothing inserted) there is no mask: every completion token is trained, as before.

Legend: T tokens of the final sequence, R = T - 1 routed positions, X layers, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..sample import RolloutError


@dataclass
class Turn:
    input_ids: np.ndarray
    output_ids: np.ndarray
    routes_RXK: np.ndarray
    """Rows for positions ``[start, len(input_ids) + len(output_ids) - 1)``."""
    start: int
    logprobs: list[float] | None
    where: str
    start_field: str
    """The engine's name of the offset (for errors)."""
    role: str = "assistant"


@dataclass
class Stitched:
    tokens_T: np.ndarray
    prompt_len: int
    routes_RXK: np.ndarray
    logprobs_T: np.ndarray | None
    loss_mask_T: np.ndarray | None


def stitch(turns: list[Turn], where: str, layers_topk: tuple[int, int]) -> Stitched:
    last = turns[-1]
    tokens_T = np.concatenate([last.input_ids, last.output_ids])
    T = len(tokens_T)
    X, K = layers_topk
    routes_RXK = np.zeros((T - 1, X, K), dtype=np.int64)
    covered_R = np.zeros(T - 1, dtype=bool)
    lp_T = np.full(T, np.nan, dtype=np.float32)
    mask_T = np.zeros(T, dtype=bool)
    for t in turns:
        seq = np.concatenate([t.input_ids, t.output_ids])
        if len(seq) > T or (tokens_T[: len(seq)] != seq).any():
            raise RolloutError(t.where, "input_ids",
                               "this turn's tokens are not a prefix of the final sequence (turns out of order?)")
        end = len(seq) - 1
        if t.start < 0 or t.start > end or len(t.routes_RXK) != end - t.start:
            raise RolloutError(t.where, "routed_experts",
                               f"{len(t.routes_RXK)} rows, expected positions [{t.start}, {end}) = {end - t.start} "
                               f"({t.start_field} = {t.start}; input + output tokens - 1: the last output token has none)")
        if t.routes_RXK.shape[1:] != (X, K):
            raise RolloutError(t.where, "routed_experts", f"rows of shape {t.routes_RXK.shape[1:]}, expected ({X}, {K})")
        if t.start > 0 and not covered_R[: t.start].all():
            gap = np.flatnonzero(~covered_R[: t.start])
            raise RolloutError(t.where, t.start_field,
                               f"routes start at position {t.start} but positions {gap[0]}..{gap[-1]} have no earlier "
                               "turn's routes: send the conversation's earlier turns with it (multi-turn record) or "
                               "have the engine return routes from position 0")
        routes_RXK[t.start : end] = t.routes_RXK
        covered_R[t.start : end] = True
        if t.role == "assistant":
            mask_T[len(t.input_ids) : len(seq)] = True
        if t.logprobs is not None:
            if len(t.logprobs) != len(t.output_ids):
                raise RolloutError(t.where, "logprobs", f"{len(t.logprobs)} values for {len(t.output_ids)} output tokens")
            lp_T[len(t.input_ids) : len(seq)] = t.logprobs
    if not covered_R.all():
        gaps = np.flatnonzero(~covered_R)
        raise RolloutError(where, "routed_experts",
                           f"positions {gaps[0]}..{gaps[-1]} have no route ({len(gaps)} of {T - 1}): "
                           "a turn's routed experts are missing")
    P = len(turns[0].input_ids)
    has_lp = any(t.logprobs is not None for t in turns)
    if has_lp and np.isnan(lp_T[P:][mask_T[P:]]).any():
        has_lp = False  # a trained token without a behaviour log-prob: none are used (tool tokens need none)
    every = mask_T[P:].all()  # no tool / user token: no mask (every completion token is trained)
    return Stitched(tokens_T, P, routes_RXK, lp_T if has_lp else None, None if every else mask_T)
