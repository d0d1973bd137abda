"""Our own (or transformers') rollouts written in an engine's wire format (tests, examples, the README's worked examples).

``samples_from_rollout`` turns an embedded ``Rollout`` (tokens, routing log,
log-probs) into ``RolloutSample``s; ``write_engine_file`` writes them the way
``fmt``'s engine would have, so importing the file must give back exactly the
same tokens, routes and log-probs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .generate import Rollout
from .formats import write_records, write_sglang, write_slime, write_verl, write_vllm
from .sample import RolloutSample


def samples_from_rollout(rollout: Rollout, *, answers: list[str | None] | None = None,
                         rewards: list[float | None] | None = None, groups: list[str] | None = None) -> list[RolloutSample]:
    out = []
    for b in range(rollout.tokens_BT.shape[0]):
        T, P = int(rollout.lengths_B[b]), int(rollout.prompt_lens_B[b])
        lp = rollout.logprobs_BT[b, :T].numpy().astype(np.float32).copy()
        lp[:P] = np.nan  # a rollout has no log-prob for prompt tokens
        out.append(RolloutSample(
            tokens_T=rollout.tokens_BT[b, :T].numpy().astype(np.int64),
            prompt_len=P,
            routes_RXK=rollout.routes.experts_BTXK[b, : T - 1].numpy().astype(np.int64),
            logprobs_T=lp,
            reward=None if rewards is None else rewards[b],
            answer=None if answers is None else answers[b],
            group=None if groups is None else groups[b],
        ))
    return out


def write_engine_file(fmt: str, samples: list[RolloutSample], path: str | Path, *,
                      samples_per_prompt: int = 1, prompt_width: int | None = None,
                      response_width: int | None = None) -> None:
    """``samples``: consecutive groups of ``samples_per_prompt`` (vLLM writes one record per group).

    JSONL mixes layouts (vLLM offline and split records, SGLang single- and two-turn
    samples) to exercise each; Parquet needs one schema, so it keeps the plain ones.
    """
    mixed = Path(path).suffix != ".parquet"
    if fmt == "vllm":
        records = [write_vllm(samples[i : i + samples_per_prompt], split=mixed and (i // samples_per_prompt) % 2 == 1,
                              logprob_dicts=mixed)
                   for i in range(0, len(samples), samples_per_prompt)]
    elif fmt == "sglang":
        records = [write_sglang(s, turns=[s.prompt_len + 1] if mixed and len(s.tokens_T) - s.prompt_len > 2 and i % 2
                                else None) for i, s in enumerate(samples)]
    elif fmt == "verl":
        pw = prompt_width or max(s.prompt_len for s in samples)
        rw = response_width or max(len(s.tokens_T) - s.prompt_len for s in samples)
        records = [write_verl(s, pw, rw) for s in samples]
    elif fmt == "slime":
        records = [write_slime(s) for s in samples]
    else:
        raise ValueError(f"unknown format {fmt!r}")
    write_records(path, records)


def samples_from_transformers(hf_path: str, prompts: list[tuple[str, str]], *, system_prompt: str = "",
                              samples_per_prompt: int = 1, max_new_tokens: int = 8, temperature: float = 0.7,
                              seed: int = 0) -> list[RolloutSample]:
    """An engine we did not write: transformers' Qwen3-MoE ``generate`` on chat-templated ``(prompt, answer)``s.

    Each completion runs through its first EOS (any of ``HFTokenizer.eos_ids``);
    one forward with ``output_router_logits=True`` over the fed tokens (all but the
    last) gives every position's top-k experts (per layer ``[tokens, experts]``;
    ``norm_topk_prob`` rescales the weights, not the ids) and the behaviour log-probs
    at ``temperature`` (full softmax: sampling uses no top-k / top-p). One sequence per
    forward: no padding to get wrong. Group ids ``p0, p1, ...`` in prompt order.
    """
    import torch
    from transformers import Qwen3MoeForCausalLM

    from ..data.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(hf_path)  # the trainer's chat template and EOS ids
    model = Qwen3MoeForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    eos = set(tok.eos_ids)
    K = model.config.num_experts_per_tok
    torch.manual_seed(seed)
    samples = []
    for i, (text, answer) in enumerate(prompts):
        prompt = torch.tensor([tok.chat_prompt(text, system_prompt)])
        P = prompt.shape[1]
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                 temperature=temperature if temperature > 0 else None, top_k=0, top_p=1.0,
                                 num_return_sequences=samples_per_prompt)
        for seq in out.tolist():
            end = next((t + 1 for t in range(P, len(seq)) if seq[t] in eos), len(seq))
            seq_T = torch.tensor(seq[:end])
            with torch.no_grad():
                fwd = model(seq_T[None, :-1], output_router_logits=True)
            routes = torch.stack([r.softmax(-1).topk(K, dim=-1).indices for r in fwd.router_logits], dim=1)
            logits = fwd.logits[0].float() / (temperature if temperature > 0 else 1.0)
            lp = np.full(len(seq_T), np.nan, dtype=np.float32)
            lp[P:] = torch.log_softmax(logits, -1)[torch.arange(len(seq_T) - 1), seq_T[1:]][P - 1:].numpy()
            samples.append(RolloutSample(tokens_T=seq_T.numpy().astype(np.int64), prompt_len=P,
                                         routes_RXK=routes.numpy().astype(np.int64), logprobs_T=lp,
                                         answer=str(answer), group=f"p{i}"))
    return samples
