"""Every rollout source behind one interface (``RolloutSource``): a module per source.

``embedded`` decodes on the policy itself, ``file`` reads an imported rollout directory, ``vllm`` and ``sglang``
have a live engine generate from the policy's current weights (synced every step); each returns a
``RolloutBatch`` of this data-parallel rank's rows, so foresight, recompute and update run the same after any.
"""

from __future__ import annotations

import os

import torch

from ...rl.dapo import shaped_rewards_N
from ..generate import GenerationConfig
from .base import RolloutBatch, RolloutSource, score
from .embedded import EmbeddedSource
from .file import FileSource
from .sglang import SGLangSource
from .vllm import VLLMSource

__all__ = ["EmbeddedSource", "FileSource", "RolloutBatch", "RolloutSource", "SGLangSource", "VLLMSource",
           "build_sources", "engine_section", "score"]

LIVE_SOURCES = {"vllm": VLLMSource, "sglang": SGLangSource}


def engine_section(cfg):
    """The live engine's config section (``[sglang_engine]`` for SGLang, else ``[rollout_engine]``)."""
    return cfg.sglang_engine if cfg.rl.rollout_source == "sglang" else cfg.rollout_engine


def build_sources(cfg, resolved, model_args, *, model, tokenizer, task, reward_fn, gen_cfg: GenerationConfig,
                  dp_rank: int, device: torch.device, dataset=None, engine_hooks: dict | None = None
                  ) -> tuple[EmbeddedSource, RolloutSource]:
    """The embedded source (always: tests and evaluation use it) and the one ``[rl] rollout_source`` picks.

    ``engine_hooks`` (vllm, sglang): ``export(folder)``, ``policy_logprobs(tokens_T, routes_RXK)`` and ``rank``."""
    rl = cfg.rl
    embedded = EmbeddedSource(
        model=model, tokenizer=tokenizer, task=task, reward_fn=reward_fn, gen_cfg=gen_cfg, seed=cfg.job.seed,
        dp_rank=dp_rank, prompts_per_rank=resolved.rollout_sequences // resolved.dp_degree // rl.samples_per_prompt,
        samples_per_prompt=rl.samples_per_prompt, num_experts=resolved.num_experts, device=device,
        dataset=dataset, dp_degree=resolved.dp_degree, format_reward=rl.format_reward,
        dump_dir=os.path.join(cfg.job.dump_folder, "rollouts") if rl.dump_rollouts else None,
        refill_rounds=rl.filter_groups_max_rounds if rl.filter_groups else 0,
        shape=lambda rewards, response_len: shaped_rewards_N(rewards, response_len, rl),
    )
    if rl.rollout_source in LIVE_SOURCES:
        from ..sample import ModelSpec

        spec = ModelSpec(model_args.n_layers, model_args.top_k, model_args.num_experts, model_args.vocab_size)
        live = LIVE_SOURCES[rl.rollout_source]
        return embedded, live(cfg, prompts=embedded, tokenizer=tokenizer, task=task, reward_fn=reward_fn, spec=spec,
                              dp_rank=dp_rank, math_exact=dataset is not None, **engine_hooks)
    if rl.rollout_source != "file":
        return embedded, embedded
    return embedded, FileSource(
        rl.rollout_dir, tokenizer=tokenizer, task=task, reward_fn=reward_fn, dp_rank=dp_rank,
        dp_degree=resolved.dp_degree, rows_per_step=resolved.rollout_sequences, samples_per_prompt=rl.samples_per_prompt,
        steps=cfg.training.steps, seq_len=cfg.training.seq_len, overlong=rl.rollout_overlong,
        num_layers=model_args.n_layers, top_k=model_args.top_k, num_experts=model_args.num_experts,
        math_exact=dataset is not None, format_reward=rl.format_reward,
    )
