"""Our own rollouts written in an engine's wire format (tests, examples, and the README's worked example).

``samples_from_rollout`` turns an embedded ``Rollout`` (tokens, routing log,
log-probs) into ``RolloutSample``s; ``write_engine_file`` writes them the way
``fmt``'s engine would have, so importing the file must give back exactly the
same tokens, routes and log-probs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..rollout import Rollout
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
