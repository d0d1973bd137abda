"""**sglang** (``--enable-return-routed-experts``, request ``return_routed_experts``;
``meta_info["routed_experts"]`` = base64 of a flat **int32** array, decoded by
``extract_routed_experts_from_meta_info``; newer versions add
``meta_info["routed_experts_dtype"]``). It covers positions
``[routed_experts_start_len, len(input_ids) + len(output_ids) - 1)``, start 0 by
default (slime checks ``len(tokens) - 1 - start_len`` rows). Record: ``{"input_ids",
"output_ids", "meta_info": {"routed_experts", "routed_experts_start_len"?,
"output_token_logprobs"?: [[logprob, id, text]]}, "reward"?, "answer"?, "group"?}``.
Multi-turn: ``{"turns": [record + "role"?, ...]}``, each turn's ``input_ids`` the
conversation so far; ``turns.py`` stitches the turns' routes (a start offset is filled
from earlier turns, or refused naming the uncovered positions) and trains only the
assistant turns' output tokens (tool / user tokens are replayed, not trained).
"""

from __future__ import annotations

import base64

import numpy as np

from ..sample import RolloutError, RolloutSample
from .codec import _extras, _reward, _routes, _text, _tokens
from .turns import Turn, stitch


def _sglang_turn(turn: dict, where: str, layers_topk) -> Turn:
    meta = turn.get("meta_info") or {}
    lps = meta.get("output_token_logprobs")
    return Turn(
        input_ids=_tokens(turn.get("input_ids"), where, "input_ids"),
        output_ids=_tokens(turn.get("output_ids"), where, "output_ids"),
        routes_RXK=_routes(meta.get("routed_experts"), where, "meta_info.routed_experts", layers_topk,
                           meta.get("routed_experts_dtype")),
        start=int(meta.get("routed_experts_start_len", 0) or 0),
        logprobs=[float(e[0]) for e in lps] if lps is not None else None,
        where=where, start_field="meta_info.routed_experts_start_len", role=str(turn.get("role", "assistant")),
    )


def read_sglang(rec: dict, where: str, layers_topk) -> list[RolloutSample]:
    turns = rec["turns"] if "turns" in rec else [rec]
    parsed = [_sglang_turn(t, f"{where} turn {i}" if "turns" in rec else where, layers_topk)
              for i, t in enumerate(turns)]
    s = stitch(parsed, where, layers_topk)
    return [RolloutSample(s.tokens_T, s.prompt_len, s.routes_RXK, s.logprobs_T, _reward(rec, "reward"),
                          _text(rec, "answer", "label"), _text(rec, "group"), s.loss_mask_T)]


def write_sglang(s: RolloutSample, turns: list[int] | None = None, dtype: str = "int32",
                 starts: list[int] | None = None, inserted: list[int] | None = None) -> dict:
    """A /generate response; ``turns``: completion split points (multi-turn, each turn re-sends the prefix);
    ``starts``: each turn's ``routed_experts_start_len`` (a cached prefix: routes from there on);
    ``inserted``: per later turn, how many tokens at its start are tool / user tokens (not the assistant's:
    they end the previous turn's output and open this turn's input)."""
    P, T = s.prompt_len, len(s.tokens_T)
    cuts = [P, *(turns or []), T]
    ins = [0, *(inserted or [0] * (len(cuts) - 2))]
    out_turns = []
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        a += ins[i]  # the inserted tokens belong to this turn's input
        start = (starts or [0] * len(cuts))[i]
        meta = {"routed_experts": base64.b64encode(s.routes_RXK[start : b - 1].astype(dtype).tobytes()).decode()}
        if start:
            meta["routed_experts_start_len"] = start
        if dtype != "int32":
            meta["routed_experts_dtype"] = dtype
        if s.logprobs_T is not None:
            meta["output_token_logprobs"] = [[float(v), int(t), None] for v, t in zip(s.logprobs_T[a:b], s.tokens_T[a:b])]
        out_turns.append({"input_ids": s.tokens_T[:a].tolist(), "output_ids": s.tokens_T[a:b].tolist(), "meta_info": meta})
    rec = {"turns": out_turns} if turns else out_turns[0]
    _extras(rec, s)
    return rec
