"""**sglang** (``--enable-return-routed-experts``, request ``return_routed_experts``;
``meta_info["routed_experts"]`` = base64 of a flat **int32** array, decoded by
``extract_routed_experts_from_meta_info``; newer versions add
``meta_info["routed_experts_dtype"]``). It covers positions
``[routed_experts_start_len, len(input_ids) + len(output_ids) - 1)``, start 0 by
default (slime checks ``len(tokens) - 1 - start_len`` rows). Record: ``{"input_ids",
"output_ids", "meta_info": {"routed_experts", "output_token_logprobs"?:
[[logprob, id, text]]}, "reward"?, "answer"?, "group"?}``. Multi-turn: ``{"turns":
[record, ...]}``, each turn's ``input_ids`` the conversation so far: the final
sequence is the last turn's input + output, every turn's input must be a prefix of
it, and the turns' rows together must cover every position ``0 .. T-2`` (a missing
segment is refused with the positions it leaves uncovered). Every token after the
first turn's prompt is trained on (tool/user tokens included: we keep no
per-token loss mask).
"""

from __future__ import annotations

import base64

import numpy as np

from ..sample import RolloutError, RolloutSample
from .codec import _extras, _reward, _routes, _text, _tokens


def _sglang_turn(turn: dict, where: str, layers_topk):
    inp = _tokens(turn.get("input_ids"), where, "input_ids")
    out = _tokens(turn.get("output_ids"), where, "output_ids")
    meta = turn.get("meta_info") or {}
    routes = _routes(meta.get("routed_experts"), where, "meta_info.routed_experts", layers_topk,
                     meta.get("routed_experts_dtype"))
    start = int(meta.get("routed_experts_start_len", 0) or 0)
    end = len(inp) + len(out) - 1
    if start < 0 or routes.shape[0] != end - start:
        raise RolloutError(where, "meta_info.routed_experts",
                           f"{routes.shape[0]} rows, expected positions [{start}, {end}) = {end - start} "
                           "(input + output tokens - 1: the last output token has none)")
    lps = meta.get("output_token_logprobs")
    return inp, out, routes, start, [float(e[0]) for e in lps] if lps is not None else None


def read_sglang(rec: dict, where: str, layers_topk) -> list[RolloutSample]:
    turns = rec["turns"] if "turns" in rec else [rec]
    parsed = [_sglang_turn(t, f"{where} turn {i}" if "turns" in rec else where, layers_topk)
              for i, t in enumerate(turns)]
    final_in, final_out = parsed[-1][0], parsed[-1][1]
    tokens = np.concatenate([final_in, final_out])
    T = len(tokens)
    X, K = layers_topk
    routes = np.zeros((T - 1, X, K), dtype=np.int64)
    covered = np.zeros(T - 1, dtype=bool)
    lp = np.full(T, np.nan, dtype=np.float32)
    for i, (inp, out, r, start, lps) in enumerate(parsed):
        seq = np.concatenate([inp, out])
        if len(seq) > T or (tokens[: len(seq)] != seq).any():
            raise RolloutError(f"{where} turn {i}", "input_ids",
                               "this turn's tokens are not a prefix of the final sequence (turns out of order?)")
        routes[start : start + len(r)] = r
        covered[start : start + len(r)] = True
        if lps is not None:
            if len(lps) != len(out):
                raise RolloutError(f"{where} turn {i}", "meta_info.output_token_logprobs",
                                   f"{len(lps)} values for {len(out)} output tokens")
            lp[len(inp) : len(seq)] = lps
    if not covered.all():
        gaps = np.flatnonzero(~covered)
        raise RolloutError(where, "meta_info.routed_experts",
                           f"positions {gaps[0]}..{gaps[-1]} have no route ({len(gaps)} of {T - 1}): "
                           "a turn's routed experts are missing")
    has_lp = any(p[4] is not None for p in parsed)
    if has_lp and np.isnan(lp[len(parsed[0][0]) :]).any():
        lp = None  # tool/user tokens between turns carry no behaviour log-prob
    return [RolloutSample(tokens, len(parsed[0][0]), routes, lp if has_lp else None, _reward(rec, "reward"),
                          _text(rec, "answer", "label"), _text(rec, "group"))]


def write_sglang(s: RolloutSample, turns: list[int] | None = None, dtype: str = "int32") -> dict:
    """A /generate response; ``turns``: completion split points (multi-turn, each turn re-sends the prefix)."""
    P, T = s.prompt_len, len(s.tokens_T)
    cuts = [P, *(turns or []), T]
    out_turns = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        meta = {"routed_experts": base64.b64encode(s.routes_RXK[: b - 1].astype(dtype).tobytes()).decode()}
        if dtype != "int32":
            meta["routed_experts_dtype"] = dtype
        if s.logprobs_T is not None:
            meta["output_token_logprobs"] = [[float(v), int(t), None] for v, t in zip(s.logprobs_T[a:b], s.tokens_T[a:b])]
        out_turns.append({"input_ids": s.tokens_T[:a].tolist(), "output_ids": s.tokens_T[a:b].tolist(), "meta_info": meta})
    rec = {"turns": out_turns} if turns else out_turns[0]
    _extras(rec, s)
    return rec
