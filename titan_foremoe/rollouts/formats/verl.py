"""**verl** (router replay "R3", ``verl/experimental/agent_loop/agent_loop.py``):
batch tensors padded to ``[batch, prompt_len + response_len, L, K]``; prompts
left-padded, responses right-padded, the engine's ``seq_len - 1`` rows copied in
from the first real prompt token, so the **last real token's row and every padding
row are zero filler** that looks like expert 0. We keep rows where
``attention_mask`` is 1, drop the last, and refuse (for top-k > 1) a filler row
that is not zero, which is what a route shifted by one position or a padding row
counted as a route looks like. Record (one batch row): ``{"input_ids",
"attention_mask", "prompts" | "prompt_length", "routed_experts", "rollout_log_probs"?
(response positions), "response_mask"? (response positions, 0 on multi-turn tool / user
tokens), "reward"?, "answer"?, "uid"?}``.
"""

from __future__ import annotations

import numpy as np

from ..sample import RolloutError, RolloutSample
from .codec import _extras, _logprobs_full, _reward, _routes, _text, _tokens, decode_array


def read_verl(rec: dict, where: str, layers_topk) -> list[RolloutSample]:
    ids = _tokens(rec.get("input_ids"), where, "input_ids")
    mask = decode_array(rec.get("attention_mask"), where, "attention_mask").astype(np.int64)
    if mask.shape != ids.shape:
        raise RolloutError(where, "attention_mask", f"shape {mask.shape} != input_ids {ids.shape}")
    P_pad = len(rec["prompts"]) if rec.get("prompts") is not None else rec.get("prompt_length")
    if P_pad is None:
        raise RolloutError(where, "prompts", "need 'prompts' (left-padded) or 'prompt_length' (its padded width)")
    P_pad = int(P_pad)
    real = np.flatnonzero(mask)
    if len(real) == 0 or (np.diff(real) != 1).any() or real[0] > P_pad or real[-1] < P_pad:
        raise RolloutError(where, "attention_mask",
                           "real tokens must be one run: prompt left-padded, response right-padded, both non-empty")
    lo, hi = int(real[0]), int(real[-1]) + 1
    routes = _routes(rec.get("routed_experts"), where, "routed_experts")
    if routes.ndim != 3 or routes.shape[0] != len(ids):
        raise RolloutError(where, "routed_experts",
                           f"shape {routes.shape}, expected [{len(ids)} (prompt_len + response_len, padded), layers, top_k]")
    if routes.shape[2] > 1:
        filler = np.concatenate([np.arange(0, lo), np.arange(hi - 1, len(ids))])
        nonzero = filler[(routes[filler] != 0).any(axis=(1, 2))]
        if len(nonzero):
            raise RolloutError(
                where, "routed_experts",
                f"row {nonzero[0]} is padding or the last real token (real tokens at {lo}..{hi - 1}) but holds "
                f"experts {routes[nonzero[0], 0].tolist()}: routes are shifted against the tokens",
            )
    tokens = ids[lo:hi]
    lp = None
    if rec.get("rollout_log_probs") is not None:
        resp = np.asarray(rec["rollout_log_probs"], dtype=np.float64)[: hi - P_pad]
        lp = _logprobs_full(len(tokens), P_pad - lo, resp, where, "rollout_log_probs")
    loss_mask = None
    if rec.get("response_mask") is not None:  # multi-turn agent loop: 0 on tool / user tokens of the response
        rm = decode_array(rec["response_mask"], where, "response_mask")
        if rm.ndim != 1 or len(rm) < hi - P_pad or not np.isin(rm[: hi - P_pad], (0, 1)).all():
            raise RolloutError(where, "response_mask",
                               f"expected >= {hi - P_pad} values of 0/1 (the response), got shape {rm.shape}")
        loss_mask = np.concatenate([np.zeros(P_pad - lo, bool), rm[: hi - P_pad].astype(bool)])
    return [RolloutSample(tokens, P_pad - lo, routes[lo : hi - 1], lp, _reward(rec, "reward", "score"),
                          _text(rec, "answer", "ground_truth"), _text(rec, "uid", "group"), loss_mask)]


def write_verl(s: RolloutSample, prompt_width: int, response_width: int) -> dict:
    P, T = s.prompt_len, len(s.tokens_T)
    R = T - P
    assert P <= prompt_width and R <= response_width
    W = prompt_width + response_width
    lo = prompt_width - P
    ids = np.zeros(W, dtype=np.int64)
    mask = np.zeros(W, dtype=np.int64)
    ids[lo : lo + T] = s.tokens_T
    mask[lo : lo + T] = 1
    routes = np.zeros((W, *s.routes_RXK.shape[1:]), dtype=np.int32)
    routes[lo : lo + T - 1] = s.routes_RXK
    rec = {"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "prompts": ids[:prompt_width].tolist(),
           "responses": ids[prompt_width:].tolist(), "routed_experts": routes.tolist()}
    if s.logprobs_T is not None:
        rec["rollout_log_probs"] = np.pad(s.logprobs_T[P:], (0, response_width - R)).tolist()
    if s.loss_mask_T is not None:
        rec["response_mask"] = np.pad(s.loss_mask_T[P:].astype(np.int64), (0, response_width - R)).tolist()
    _extras(rec, s, group_key="uid")
    return rec
