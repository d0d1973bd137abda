"""**slime** (``slime/utils/types.py`` ``Sample.rollout_routed_experts``; its Megatron
actor asserts ``experts.shape[0] == tokens.shape[0] - 1``): ``[seq_len - 1, L, K]``
per sample, int32 from SGLang. Record: ``{"tokens", "response_length",
"rollout_routed_experts", "rollout_log_probs"? (response), "loss_mask"? (response,
0 on tool / user tokens of a multi-turn sample), "reward"?, "label"?, "group_index"?}``.
"""

from __future__ import annotations

import numpy as np

from ..sample import RolloutError, RolloutSample
from .codec import _extras, _logprobs_full, _reward, _routes, _text, _tokens


def read_slime(rec: dict, where: str, layers_topk) -> list[RolloutSample]:
    tokens = _tokens(rec.get("tokens"), where, "tokens")
    R = int(rec.get("response_length", 0))
    if not 1 <= R < len(tokens):
        raise RolloutError(where, "response_length", f"{R} for {len(tokens)} tokens")
    routes = _routes(rec.get("rollout_routed_experts"), where, "rollout_routed_experts")
    lp = None
    if rec.get("rollout_log_probs") is not None:
        vals = rec["rollout_log_probs"]
        if len(vals) != R:
            raise RolloutError(where, "rollout_log_probs", f"{len(vals)} values for response_length {R}")
        lp = _logprobs_full(len(tokens), len(tokens) - R, vals, where, "rollout_log_probs")
    mask = None
    if rec.get("loss_mask") is not None:  # slime's multi-turn mask over the response: 0 on tool / user tokens
        m = np.asarray(rec["loss_mask"])
        if m.shape != (R,) or not np.isin(m, (0, 1)).all():
            raise RolloutError(where, "loss_mask", f"expected {R} values of 0/1 (response_length), got shape {m.shape}")
        mask = np.concatenate([np.zeros(len(tokens) - R, bool), m.astype(bool)])
    return [RolloutSample(tokens, len(tokens) - R, routes, lp, _reward(rec, "reward"), _text(rec, "label", "answer"),
                          _text(rec, "group_index", "group"), mask)]


def write_slime(s: RolloutSample) -> dict:
    T = len(s.tokens_T)
    rec = {"tokens": s.tokens_T.tolist(), "response_length": T - s.prompt_len,
           "rollout_routed_experts": s.routes_RXK.astype(np.int32).tolist()}
    if s.logprobs_T is not None:
        rec["rollout_log_probs"] = s.logprobs_T[s.prompt_len :].tolist()
    if s.loss_mask_T is not None:
        rec["loss_mask"] = s.loss_mask_T[s.prompt_len :].astype(int).tolist()
    _extras(rec, s, answer_key="label", group_key="group_index")
    return rec
