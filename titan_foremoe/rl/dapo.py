"""DAPO's batch shaping (Yu et al., 2025): dynamic sampling and overlong reward shaping.

A group whose rewards are all equal has zero advantage under a group baseline: it adds
no gradient but still counts in the token normalizer and dilutes the others. Dynamic
sampling drops such groups. Here a dropped (or overlong-filtered) sequence keeps its
place in the replayed micro-steps, so the foresight loads and plans stay those of the
rollout, and only its loss mask is cleared: it is out of the loss and out of every
normalizer. (DAPO re-samples prompts to refill the batch; that is not done here.)

Legend: N samples, G groups, S samples per group.
"""

from __future__ import annotations

import torch


def uniform_groups_N(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per sample: its group's rewards are all equal (bool)."""
    r_GS = rewards_N.view(-1, group_size)
    same_G = (r_GS == r_GS[:, :1]).all(-1)
    return same_G.repeat_interleave(group_size)


def overlong_penalty_N(response_len_N: torch.Tensor, max_new_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to ``max_new_tokens - buffer``
    tokens, then falling linearly to ``-factor`` at ``max_new_tokens``."""
    exceed = response_len_N.float() - (max_new_tokens - buffer)
    return (-exceed / buffer * factor).clamp(-factor, 0.0)


def uniform_groups_G(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per group: its rewards are all equal (no learning signal under GRPO), bool ``[N / group_size]``."""
    r_GS = rewards_N.view(-1, group_size)
    return (r_GS == r_GS[:, :1]).all(-1)


def shaped_rewards_N(rewards_N: torch.Tensor, response_len_N: torch.Tensor, rl) -> torch.Tensor:
    """The rewards advantages are computed from: with ``[rl] overlong_buffer`` the soft overlong punishment
    added. Dynamic sampling judges groups on these, so the source and the trainer agree on which are uniform."""
    if rl.overlong_buffer <= 0:
        return rewards_N
    return rewards_N + overlong_penalty_N(response_len_N, rl.max_new_tokens, rl.overlong_buffer, rl.overlong_penalty)
