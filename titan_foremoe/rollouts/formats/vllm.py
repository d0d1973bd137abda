"""**vllm** (``--enable-return-routed-experts``; ``vllm/outputs.py``
``CompletionOutput.routed_experts``, filled by the v1 scheduler's
``_get_routed_experts`` with ``num_tokens = request.num_tokens - 1`` rows read
from an **int32** host buffer). Offline ``LLM.generate``: per completion
``routed_experts [prompt_len + gen_len - 1, L, K]`` covering prompt *and*
completion. vLLM 0.21.0's OpenAI server split it: response-level
``prompt_routed_experts [prompt_len, L, K]`` plus per-choice ``routed_experts
[gen_len - 1, L, K]`` (removed again in 0.21.1). The issue text describes the
split layout as the only one and says int16/uint8; the sources we read use
int32 for both. Record: ``{"prompt_token_ids", "outputs" | "choices": [{"token_ids",
"routed_experts", "logprobs"?}], "prompt_routed_experts"?, "reward"?, "answer"?}``;
arrays as nested lists, base64 ``.npy``, or ``{"data": base64, "dtype", "shape"}``;
``logprobs`` as floats or vLLM's ``[{token_id: {"logprob": x}}]``. Without a ``group``
field, consecutive samples with the same prompt (one record's ``n`` completions, or
``n = 1`` records in a row) form one GRPO group, in every format.

Prefix caching and multi-turn: ``routed_experts_prompt_start`` (record or completion) says the rows
begin at that position (the cached prefix was not recomputed); alone it is refused (the earlier
positions have no route), inside ``{"turns": [record, ...], "reward"?, "answer"?, "group"?}`` (one
completion per turn, each turn's prompt the conversation so far, optional ``"role"``) the turns are
stitched by ``turns.py``: earlier turns cover the offset, assistant outputs are trained, tokens a
later turn inserts (tool / user) are replayed but not trained.
"""

from __future__ import annotations

import numpy as np

from ..sample import RolloutError, RolloutSample
from .codec import _logprobs_full, _reward, _routes, _text, _tokens, encode_npy_b64
from .turns import Turn, stitch


def _vllm_logprobs(value, ids: np.ndarray, where: str) -> list[float]:
    out = []
    for i, entry in enumerate(value):
        if isinstance(entry, dict):  # vLLM's {token_id: Logprob}; JSON keys are strings
            hit = entry.get(str(int(ids[i])), entry.get(int(ids[i])))
            if hit is None:  # the token id was edited, or is not of this vocabulary: name it, not a "missing" log-prob
                held = ", ".join(str(k) for k in list(entry)[:4])
                raise RolloutError(where, "logprobs", f"no entry for the sampled token at completion position {i}: "
                                   f"token id {int(ids[i])}, the engine's log-probs name ids [{held}] (token ids "
                                   "changed after generation, or not of this model's vocabulary?)")
            out.append(float(hit["logprob"] if isinstance(hit, dict) else hit))
        else:
            out.append(float(entry))
    return out


def _prompt_start(rec: dict, out: dict) -> int:
    """Where the routes begin (a prefix-cache hit: earlier positions were not recomputed); 0 by default."""
    v = out.get("routed_experts_prompt_start", rec.get("routed_experts_prompt_start"))
    return int(v or 0)


def _vllm_turn(rec: dict, where: str) -> Turn:
    """One turn of a multi-turn conversation: a record with one completion."""
    prompt = _tokens(rec.get("prompt_token_ids"), where, "prompt_token_ids")
    outputs = rec.get("outputs", rec.get("choices"))
    if not outputs or len(outputs) != 1:
        raise RolloutError(where, "outputs", "a turn of a multi-turn record has exactly one completion")
    out = outputs[0]
    gen = _tokens(out.get("token_ids"), where, "token_ids")
    start = _prompt_start(rec, out)
    routes = _routes(out.get("routed_experts"), where, "routed_experts")
    if rec.get("prompt_routed_experts") is not None:  # split layout: [start, P) and [P, P + G - 1)
        head = _routes(rec["prompt_routed_experts"], where, "prompt_routed_experts")
        routes = np.concatenate([head, routes.reshape(-1, *head.shape[1:])])
    lp = _vllm_logprobs(out["logprobs"], gen, where) if out.get("logprobs") is not None else None
    return Turn(prompt, gen, routes, start, lp, where, "routed_experts_prompt_start",
                str(rec.get("role", "assistant")))


def read_vllm(rec: dict, where: str, layers_topk) -> list[RolloutSample]:
    if "turns" in rec:  # one multi-turn conversation: every turn re-sends the sequence so far
        s = stitch([_vllm_turn(t, f"{where} turn {i}") for i, t in enumerate(rec["turns"])], where, layers_topk)
        return [RolloutSample(s.tokens_T, s.prompt_len, s.routes_RXK, s.logprobs_T, _reward(rec, "reward"),
                              _text(rec, "answer"), _text(rec, "group"), s.loss_mask_T)]
    prompt = _tokens(rec.get("prompt_token_ids"), where, "prompt_token_ids")
    outputs = rec.get("outputs", rec.get("choices"))
    if not outputs:
        raise RolloutError(where, "outputs", "no completions")
    split = rec.get("prompt_routed_experts") is not None
    prompt_routes = _routes(rec["prompt_routed_experts"], where, "prompt_routed_experts") if split else None
    if split and prompt_routes.shape[0] != len(prompt):
        raise RolloutError(where, "prompt_routed_experts",
                           f"{prompt_routes.shape[0]} rows for {len(prompt)} prompt tokens (expected one per prompt token)")
    samples = []
    for j, out in enumerate(outputs):
        w = f"{where} completion {j}"
        gen = _tokens(out.get("token_ids"), w, "token_ids")
        tokens = np.concatenate([prompt, gen])
        start = _prompt_start(rec, out)
        if start:
            raise RolloutError(w, "routed_experts_prompt_start",
                               f"routes start at position {start}: positions 0..{start - 1} need the earlier turns' "
                               'routes (send the conversation as {"turns": [record, ...]}) or routes from position 0')
        routes = _routes(out.get("routed_experts"), w, "routed_experts")
        if split:
            if routes.shape[0] != max(len(gen) - 1, 0):
                raise RolloutError(w, "routed_experts", f"{routes.shape[0]} rows for {len(gen)} generated tokens "
                                   "(the split layout has gen_len - 1: the last sampled token has none)")
            routes = np.concatenate([prompt_routes, routes.reshape(-1, *prompt_routes.shape[1:])])
        lp = None
        if out.get("logprobs") is not None:
            lp = _logprobs_full(len(tokens), len(prompt), _vllm_logprobs(out["logprobs"], gen, w), w, "logprobs")
        samples.append(RolloutSample(
            tokens, len(prompt), routes, lp, _reward(out, "reward") if "reward" in out else _reward(rec, "reward"),
            _text(rec, "answer"), _text(rec, "group"),  # else: consecutive samples of one prompt
        ))
    return samples


def write_vllm_turns(s: RolloutSample, cuts: list[int], starts: list[int], inserted: list[int]) -> dict:
    """One conversation as vLLM turns: turn i generates ``[cuts[i] + inserted[i], cuts[i + 1])`` (``cuts``
    starts at the prompt length, ends at T; ``inserted[0] = 0``), its routes from ``starts[i]``."""
    turns = []
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        a += inserted[i]
        out = {"token_ids": s.tokens_T[a:b].tolist(),
               "routed_experts": s.routes_RXK[starts[i] : b - 1].astype(np.int32).tolist()}
        if s.logprobs_T is not None:
            out["logprobs"] = s.logprobs_T[a:b].tolist()
        turns.append({"prompt_token_ids": s.tokens_T[:a].tolist(), "outputs": [out],
                      **({"routed_experts_prompt_start": starts[i]} if starts[i] else {})})
    rec = {"turns": turns}
    if s.reward is not None:
        rec["reward"] = s.reward
    return rec


def write_vllm(samples: list[RolloutSample], split: bool = False, logprob_dicts: bool = True) -> dict:
    """One vLLM record for samples sharing a prompt (a GRPO group)."""
    P = samples[0].prompt_len
    prompt = samples[0].tokens_T[:P]
    rec = {"prompt_token_ids": prompt.tolist(), "outputs": []}
    if split:
        rec["prompt_routed_experts"] = encode_npy_b64(samples[0].routes_RXK[:P].astype(np.int32))
    for s in samples:
        assert s.prompt_len == P and (s.tokens_T[:P] == prompt).all()
        gen = s.tokens_T[P:]
        routes = s.routes_RXK[P:] if split else s.routes_RXK
        out = {"token_ids": gen.tolist(), "routed_experts": routes.astype(np.int32).tolist() if not split
               else encode_npy_b64(routes.astype(np.int32))}
        if s.logprobs_T is not None:
            out["logprobs"] = ([{str(int(t)): {"logprob": float(v)}} for t, v in zip(gen, s.logprobs_T[P:])]
                               if logprob_dicts else s.logprobs_T[P:].tolist())
        if s.reward is not None:
            out["reward"] = s.reward
        rec["outputs"].append(out)
    if samples[0].answer is not None:
        rec["answer"] = samples[0].answer
    if samples[0].group is not None:
        rec["group"] = samples[0].group
    return rec
