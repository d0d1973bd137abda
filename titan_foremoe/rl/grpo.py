"""Group Relative Policy Optimization (Shao et al., DeepSeekMath, 2024): advantages.

Each prompt is sampled n times; a sample's advantage is its reward relative to
its group, shared by all its tokens: ``A_i = (r_i - b_i) / (std(r) + eps)`` with
the group mean as baseline ``b_i`` (GRPO), or the mean of the *other* samples
(RLOO, Ahmadian et al., 2024), and the division by the group's std optional
(Dr. GRPO, Liu et al., 2025, drops it: it up-weights groups of nearly equal rewards).
The policy loss is in ``losses.py``; log-probs and entropy in ``logprobs.py``.

Legend: N samples, G groups, S samples per group.
"""

from __future__ import annotations

from typing import Literal

import torch

from .logprobs import token_logprobs  # noqa: F401  (the rollout's decode imports it from here)


def group_advantages(
    rewards_N: torch.Tensor,
    group_size: int,
    eps: float = 1e-6,
    *,
    std_norm: bool = True,
    baseline: Literal["mean", "leave_one_out"] = "mean",
) -> torch.Tensor:
    """Advantages for rewards laid out as consecutive groups of ``group_size`` samples."""
    if rewards_N.numel() % group_size:
        raise ValueError(f"{rewards_N.numel()} rewards do not split into groups of {group_size}")
    if baseline not in ("mean", "leave_one_out"):
        raise ValueError(f"unknown advantage baseline {baseline!r} (mean | leave_one_out)")
    r_GS = rewards_N.view(-1, group_size).float()
    mean = r_GS.mean(-1, keepdim=True)
    if baseline == "mean" or group_size == 1:
        centred = r_GS - mean
    else:  # r_i - mean of the others = S / (S - 1) * (r_i - mean)
        centred = (r_GS - mean) * (group_size / (group_size - 1))
    if not std_norm:
        return centred.flatten()
    std = r_GS.std(-1, unbiased=False, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    return (centred / (std + eps)).flatten()
