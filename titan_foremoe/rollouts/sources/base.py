"""The one interface every rollout source implements, and the scoring they share.

Every source (``embedded``, ``file``, ``vllm``, ``sglang``) hands the trainer the same thing, a ``RolloutBatch``
of this data-parallel rank's rows (a ``Rollout`` with its routing log, plus rewards), so foresight,
recompute and update run identically after any of them. Groups of
``samples_per_prompt`` consecutive rows share a prompt (GRPO advantages).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from ...rl.rewards import format_ok, math_reward
from ...routing_log import RoutingLog
from ..generate import Rollout


@dataclass
class RolloutBatch:
    rollout: Rollout
    rewards_B: torch.Tensor
    exact_B: torch.Tensor
    """1 where the completion equals the known answer (0 where there is none)."""
    truncated: int = 0
    """Rows cut to ``seq_len`` (file mode with ``rollout_overlong = "truncate"``)."""
    has_logprobs: bool = True
    refill: dict | None = None
    """DAPO refill of this rank (``rounds``, ``refilled``, ``unfilled`` groups); None or empty: off."""
    holes_possible: bool = False
    """Rows may carry positions without a route (-1), on any rank (file mode: the directory's index says so)."""
    versions_BT: torch.Tensor | None = None
    """Partial rollouts: the weights version (step) that sampled each completion token, -1 elsewhere; the
    behaviour log-probs ``rollout.logprobs_BT`` are per token too, so ``rollout_is`` corrects each token against
    the weights that sampled it. None: every token of the batch is of one version."""


class RolloutSource(Protocol):
    def next_batch(self, step: int) -> RolloutBatch: ...
    # optional ``settle()``: collective, what the rollout left running on the devices (colocated engines falling
    # asleep) finished before the trainer's first GPU work; ``settle`` below calls it where a source has it

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def settle(source) -> float:
    """Collective: ``source.settle()`` where the source has one (the vLLM fleet's colocated engines falling asleep
    while the trainer schedules and plans, ``fleet/sleep.py``); the seconds it waited."""
    fn = getattr(source, "settle", None)
    if fn is None:
        return 0.0
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def score(reward_fn, task, examples: list, completions: list[str], *, math_exact: bool = False,
           format_reward: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards and exact answers; ``math_exact``: a prompt file's answers are checked by math-verify, not
    string equality; ``format_reward``: added for a final answer in ``\\boxed{}``."""
    rewards = torch.tensor([float(reward_fn(task, ex, c)) for ex, c in zip(examples, completions)])
    if math_exact and getattr(reward_fn, "fn", reward_fn) is math_reward:  # the trainer's CheckedReward
        exact = rewards.clone()
    elif math_exact:
        exact = torch.tensor([math_reward(task, ex, c) for ex, c in zip(examples, completions)])
    else:
        exact = torch.tensor([float(c == ex.answer) for ex, c in zip(examples, completions)])
    if format_reward > 0:
        rewards += format_reward * torch.tensor([float(format_ok(c)) for c in completions])
    return rewards, exact


def rollout_of_samples(rows, *, pad_id: int, eos_ids, num_experts: int) -> Rollout:
    """Validated ``RolloutSample``s (file rows or engine completions) as one right-padded ``Rollout``;
    behaviour log-probs NaN where the source gave none (the prompt)."""
    B = len(rows)
    lengths = torch.tensor([len(r.tokens_T) for r in rows])
    W = int(lengths.max())
    tokens = torch.full((B, W), pad_id, dtype=torch.int64)
    logp = torch.full((B, W), float("nan"))
    loss_mask = None
    if any(r.loss_mask_T is not None for r in rows):
        loss_mask = torch.arange(W)[None, :] >= torch.tensor([r.prompt_len for r in rows])[:, None]
    for b, r in enumerate(rows):
        tokens[b, : len(r.tokens_T)] = torch.from_numpy(r.tokens_T)
        if r.logprobs_T is not None:
            logp[b, : len(r.tokens_T)] = torch.from_numpy(r.logprobs_T)
        if r.loss_mask_T is not None:
            loss_mask[b, : len(r.tokens_T)] = torch.from_numpy(r.loss_mask_T)
    return Rollout(
        tokens_BT=tokens, prompt_lens_B=torch.tensor([r.prompt_len for r in rows]), lengths_B=lengths,
        logprobs_BT=logp, finished_B=torch.isin(tokens[torch.arange(B), lengths - 1], torch.tensor(list(eos_ids))),
        routes=RoutingLog.from_sequences([torch.from_numpy(r.routes_RXK) for r in rows], lengths.tolist(), num_experts),
        loss_mask_BT=loss_mask,
    )
