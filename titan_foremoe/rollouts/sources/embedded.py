"""The embedded source: sample prompts and decode them on the policy's own weights (``rollouts/generate.py``).

DAPO dynamic sampling with refill (``[rl] filter_groups_max_rounds`` > 0): a group whose (shaped) rewards
are all equal carries no GRPO signal; each extra round samples fresh prompts and puts informative groups
in the uniform ones' slots, until every rank is full or the rounds run out (groups still uniform stay and
are filtered by the trainer, counted). Generation is lock-step over the ranks (its decode all-to-alls), so
each round every rank decodes the same number of prompts (the most any rank lacks: one all-reduce per
round), a full rank discarding its share. Cost per round: one rollout of that many prompts per rank.
"""

from __future__ import annotations

import random

import torch

from ...distributed import collectives
from ...rl.dapo import uniform_groups_G
from ..dump import dump_rows, write_dump
from ..generate import GenerationConfig, Rollout, generate
from .base import RolloutBatch, score


class EmbeddedSource:
    """Sample prompts (the embedded task's, or a prompt file's: ``dataset``) and decode them on the policy
    itself (``rollouts/generate.py``)."""

    def __init__(self, *, model, tokenizer, task, reward_fn, gen_cfg: GenerationConfig, seed: int, dp_rank: int,
                 prompts_per_rank: int, samples_per_prompt: int, num_experts: int, device: torch.device,
                 dataset=None, dp_degree: int = 1, format_reward: float = 0.0, dump_dir: str | None = None,
                 refill_rounds: int = 0, shape=None):
        """``refill_rounds``: DAPO refill rounds per step (0: off); ``shape(rewards_N, response_len_N)``: the
        rewards groups are judged on (the trainer's shaping)."""
        self.model, self.tokenizer, self.task, self.reward_fn = model, tokenizer, task, reward_fn
        self.gen_cfg, self.seed, self.dp_rank, self.device = gen_cfg, seed, dp_rank, device
        self.prompts_per_rank, self.samples_per_prompt, self.num_experts = prompts_per_rank, samples_per_prompt, num_experts
        self.dataset, self.dp_degree, self.format_reward, self.dump_dir = dataset, dp_degree, format_reward, dump_dir
        self.refill_rounds, self.shape = refill_rounds, shape or (lambda r, n: r)

    def prompts(self, step: int, round: int = 0, n: int | None = None) -> tuple[list, list[list[int]]]:
        """This rank's examples and prompt token ids of ``step``, one per GRPO group (the vLLM source's too);
        ``round`` > 0: a refill round's ``n`` fresh prompts (seeded apart from the step's first round)."""
        n = self.prompts_per_rank if n is None else n
        tag = "" if round == 0 else f"/refill{round}"
        if self.dataset is not None:
            examples = self.dataset.take(n * self.dp_degree, self.dp_rank, self.dp_degree)
        else:
            rng = random.Random(f"{self.seed}/rollout/{step}/{self.dp_rank}{tag}")
            examples = [self.task.sample(rng) for _ in range(n)]
        if self.dataset is not None:
            return examples, [list(ex.prompt_ids) for ex in examples]
        return examples, [[self.tokenizer.bos_id, *self.tokenizer.encode(ex.prompt)] for ex in examples]

    def generate(self, step: int, round: int = 0, prompts: int | None = None) -> tuple[Rollout, list]:
        """This rank's prompts, each sampled ``samples_per_prompt`` times (consecutive rows); ``round`` > 0:
        a refill round's ``prompts`` fresh prompts (seeded apart from the step's first round)."""
        examples, prompt_ids = self.prompts(step, round, prompts)
        examples = [ex for ex in examples for _ in range(self.samples_per_prompt)]
        prompt_ids = [p for p in prompt_ids for _ in range(self.samples_per_prompt)]
        key = (self.seed, step, self.dp_rank) if round == 0 else (self.seed, step, self.dp_rank, round)
        generator = torch.Generator().manual_seed(hash(key) % 2**62)
        rollout = generate(
            self.model, prompt_ids, self.gen_cfg, eos_id=list(self.tokenizer.eos_ids),
            pad_id=self.tokenizer.pad_id, num_experts=self.num_experts, generator=generator, device=self.device,
        )
        return rollout, examples

    def _scored(self, step: int, round: int = 0, prompts: int | None = None):
        rollout, examples = self.generate(step) if round == 0 else self.generate(step, round, prompts)
        completions = [self.tokenizer.decode(rollout.completion(b)) for b in range(len(examples))]
        rewards, exact = score(self.reward_fn, self.task, examples, completions,
                                math_exact=self.dataset is not None, format_reward=self.format_reward)
        return rollout, examples, completions, rewards, exact

    def next_batch(self, step: int) -> RolloutBatch:
        rollout, examples, completions, rewards, exact = self._scored(step)
        refill = {}
        if self.refill_rounds > 0:
            rollout, examples, completions, rewards, exact, refill = self._refill(
                step, (rollout, examples, completions, rewards, exact))
        if self.dump_dir is not None:
            write_dump(self.dump_dir, step, dump_rows(step, self.dp_rank, rollout, examples, completions, rewards))
        return RolloutBatch(rollout, rewards, exact, refill=refill)

    def _uniform_G(self, rollout: Rollout, rewards: torch.Tensor) -> torch.Tensor:
        return uniform_groups_G(self.shape(rewards, rollout.lengths_B - rollout.prompt_lens_B), self.samples_per_prompt)

    def _refill(self, step: int, first):
        """Uniform groups' slots refilled from up to ``refill_rounds`` rounds of fresh prompts."""
        spp = self.samples_per_prompt
        parts = [first]
        slots = [(0, g) for g in range(len(first[1]) // spp)]  # (part, group) in each slot
        empty = [i for i, u in enumerate(self._uniform_G(first[0], first[3]).tolist()) if u]
        rounds = refilled = 0
        for r in range(1, self.refill_rounds + 1):
            need = int(collectives.all_reduce(torch.tensor([len(empty)], dtype=torch.int64), collectives.ReduceOp.MAX))
            if need == 0:
                break
            part = self._scored(step, r, need)
            parts.append(part)
            rounds += 1
            for g, u in enumerate(self._uniform_G(part[0], part[3]).tolist()):
                if not u and empty:
                    slots[empty.pop(0)] = (r, g)
                    refilled += 1
        rows = [(p, g * spp + i) for p, g in slots for i in range(spp)]
        rollout = Rollout.pick([p[0] for p in parts], rows, self.tokenizer.pad_id)
        examples = [parts[p][1][i] for p, i in rows]
        completions = [parts[p][2][i] for p, i in rows]
        rewards = torch.stack([parts[p][3][i] for p, i in rows])
        exact = torch.stack([parts[p][4][i] for p, i in rows])
        stats = {"rounds": rounds, "refilled": refilled, "unfilled": len(empty)}
        return rollout, examples, completions, rewards, exact, stats

    def state_dict(self) -> dict:
        return {}  # prompts and sampling are functions of (seed, step, rank)

    def load_state_dict(self, state: dict) -> None:
        pass
