"""The embedded source: sample prompts and decode them on the policy's own weights (``rollouts/generate.py``)."""

from __future__ import annotations

import random

import torch

from ..dump import dump_rows, write_dump
from ..generate import GenerationConfig, Rollout, generate
from .base import RolloutBatch, score


class EmbeddedSource:
    """Sample prompts (the embedded task's, or a prompt file's: ``dataset``) and decode them on the policy
    itself (``rollouts/generate.py``)."""

    def __init__(self, *, model, tokenizer, task, reward_fn, gen_cfg: GenerationConfig, seed: int, dp_rank: int,
                 prompts_per_rank: int, samples_per_prompt: int, num_experts: int, device: torch.device,
                 dataset=None, dp_degree: int = 1, format_reward: float = 0.0, dump_dir: str | None = None):
        self.model, self.tokenizer, self.task, self.reward_fn = model, tokenizer, task, reward_fn
        self.gen_cfg, self.seed, self.dp_rank, self.device = gen_cfg, seed, dp_rank, device
        self.prompts_per_rank, self.samples_per_prompt, self.num_experts = prompts_per_rank, samples_per_prompt, num_experts
        self.dataset, self.dp_degree, self.format_reward, self.dump_dir = dataset, dp_degree, format_reward, dump_dir

    def prompts(self, step: int) -> tuple[list, list[list[int]]]:
        """This rank's examples and prompt token ids of ``step``, one per GRPO group (the vLLM source's too)."""
        if self.dataset is not None:
            examples = self.dataset.take(self.prompts_per_rank * self.dp_degree, self.dp_rank, self.dp_degree)
        else:
            rng = random.Random(f"{self.seed}/rollout/{step}/{self.dp_rank}")
            examples = [self.task.sample(rng) for _ in range(self.prompts_per_rank)]
        if self.dataset is not None:
            return examples, [list(ex.prompt_ids) for ex in examples]
        return examples, [[self.tokenizer.bos_id, *self.tokenizer.encode(ex.prompt)] for ex in examples]

    def generate(self, step: int) -> tuple[Rollout, list]:
        """This rank's prompts, each sampled ``samples_per_prompt`` times (consecutive rows)."""
        examples, prompts = self.prompts(step)
        examples = [ex for ex in examples for _ in range(self.samples_per_prompt)]
        prompts = [p for p in prompts for _ in range(self.samples_per_prompt)]
        generator = torch.Generator().manual_seed(hash((self.seed, step, self.dp_rank)) % 2**62)
        rollout = generate(
            self.model, prompts, self.gen_cfg, eos_id=list(self.tokenizer.eos_ids),
            pad_id=self.tokenizer.pad_id, num_experts=self.num_experts, generator=generator, device=self.device,
        )
        return rollout, examples

    def next_batch(self, step: int) -> RolloutBatch:
        rollout, examples = self.generate(step)
        completions = [self.tokenizer.decode(rollout.completion(b)) for b in range(len(examples))]
        rewards, exact = score(self.reward_fn, self.task, examples, completions,
                                math_exact=self.dataset is not None, format_reward=self.format_reward)
        if self.dump_dir is not None:
            write_dump(self.dump_dir, step, dump_rows(step, self.dp_rank, rollout, examples, completions, rewards))
        return RolloutBatch(rollout, rewards, exact)

    def state_dict(self) -> dict:
        return {}  # prompts and sampling are functions of (seed, step, rank)

    def load_state_dict(self, state: dict) -> None:
        pass
