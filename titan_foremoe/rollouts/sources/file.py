"""The file source: the next rows of a rollout directory written by ``python -m titan_foremoe.rollouts import``.

File mode: step b (the b-th RL step) takes global rows ``[b N, (b + 1) N)``,
``N = global_batch_size x updates_per_rollout``, and data-parallel rank d reads
only its slice ``[b N + d n, b N + (d + 1) n)``, ``n = N / DP``, memory-mapped:
per rank and step that is ``n`` rows' tokens and ``n x tokens x layers x top_k``
route bytes, whatever the world size.
"""

from __future__ import annotations

import torch

from ...data.tasks import Example
from ..fit import check_fits, check_length
from ..sample import RolloutError
from ..store import RolloutStore
from .base import RolloutBatch, rollout_of_samples, score


class FileSource:
    """The next batch of rows of a rollout directory (``python -m titan_foremoe.rollouts import``)."""

    def __init__(self, path: str, *, tokenizer, task, reward_fn, dp_rank: int, dp_degree: int,
                 rows_per_step: int, samples_per_prompt: int, steps: int, seq_len: int, overlong: str,
                 num_layers: int, top_k: int, num_experts: int, math_exact: bool = False, format_reward: float = 0.0):
        self.store = RolloutStore(path)
        self.math_exact, self.format_reward = math_exact, format_reward  # a prompt file's scoring, as embedded
        self.tokenizer, self.task, self.reward_fn = tokenizer, task, reward_fn
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.rows_per_step, self.per_rank = rows_per_step, rows_per_step // dp_degree
        self.samples_per_prompt, self.seq_len, self.overlong = samples_per_prompt, seq_len, overlong
        self.num_experts = num_experts
        self.position = 0
        check_fits(self.store, num_layers=num_layers, top_k=top_k, num_experts=num_experts, steps=steps,
                   rows_per_step=rows_per_step, seq_len=seq_len, overlong=overlong,
                   ranges=[self.rows(b) for b in range(steps)])  # before any work: this rank's rows only

    def rows(self, b: int) -> range:
        first = b * self.rows_per_step + self.dp_rank * self.per_rank
        return range(first, first + self.per_rank)

    def next_batch(self, step: int) -> RolloutBatch:
        rows = [self.store.read(r) for r in self.rows(self.position)]
        where = f"{self.store.path} rows {self.rows(self.position).start}..{self.rows(self.position).stop - 1}"
        self.position += 1
        spp = self.samples_per_prompt
        groups = [r.group for r in rows]
        for g in range(0, len(rows), spp):
            chunk = groups[g : g + spp]
            if len(set(chunk)) != 1 or (g >= spp and groups[g - 1] == chunk[0]):
                raise RolloutError(where, "groups", f"rows {g}..{g + spp - 1} of this step are not exactly one prompt's "
                                   f"{spp} samples (group ids {chunk}): [rl] samples_per_prompt does not match the file")
        first = self.rows(self.position - 1).start
        truncated = 0
        for i, r in enumerate(rows):
            check_length(self.store, first + i, len(r.tokens_T), self.seq_len, self.overlong)
            if len(r.tokens_T) - 1 > self.seq_len:
                if r.prompt_len > self.seq_len:
                    raise RolloutError(f"{self.store.path} row {first + i}", "prompt_len",
                                       f"a prompt of {r.prompt_len} tokens leaves no completion within seq_len {self.seq_len}")
                r.tokens_T, r.routes_RXK = r.tokens_T[: self.seq_len + 1], r.routes_RXK[: self.seq_len]
                r.logprobs_T = r.logprobs_T[: self.seq_len + 1]
                if r.loss_mask_T is not None:
                    r.loss_mask_T = r.loss_mask_T[: self.seq_len + 1]
                truncated += 1
        rollout = rollout_of_samples(rows, pad_id=self.tokenizer.pad_id, eos_ids=self.tokenizer.eos_ids,
                                     num_experts=self.num_experts)
        completions = [self.tokenizer.decode(rollout.completion(b)) for b in range(len(rows))]
        rewards = torch.tensor([r.reward for r in rows], dtype=torch.float32)
        missing = torch.isnan(rewards)
        has_answer = torch.tensor([r.answer is not None for r in rows])
        exact = torch.tensor([float(r.answer is not None and c == r.answer) for r, c in zip(rows, completions)])
        if missing.any() or self.math_exact:  # the configured reward (and exactness), from the stored answer
            for i in torch.nonzero(missing).flatten().tolist():
                if rows[i].answer is None:
                    raise RolloutError(f"{self.store.path} row {first + i}", "reward",
                                       "neither a reward nor an answer to compute one from")
            examples = [Example(prompt=self.tokenizer.decode(r.tokens_T[: r.prompt_len].tolist()), answer=r.answer or "")
                        for r in rows]
            scored, scored_exact = score(self.reward_fn, self.task, examples, completions,
                                          math_exact=self.math_exact, format_reward=self.format_reward)
            rewards = torch.where(missing, scored, rewards)
            if self.math_exact:  # a prompt file's answers: math-verify, as in embedded mode
                exact = torch.where(has_answer, scored_exact, torch.zeros_like(exact))
        has_lp = bool(self.store.index.get("has_logprobs"))
        return RolloutBatch(rollout, rewards, exact, truncated, has_lp,
                            holes_possible=bool(self.store.index.get("has_no_route")))

    def state_dict(self) -> dict:
        return {"position": torch.tensor(self.position)}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
