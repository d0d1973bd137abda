"""Group Relative Policy Optimization (Shao et al., DeepSeekMath, 2024).

Each prompt is sampled n times; a sample's advantage is its reward relative to
its group: ``A_i = (r_i - mean(r)) / (std(r) + eps)``, shared by all its tokens.
The policy loss is PPO's clipped surrogate on the per-token ratio
``rho = exp(logp - logp_old)``: ``-min(rho A, clip(rho, 1-eps, 1+eps) A)``,
optionally plus ``beta * KL(pi || pi_ref)`` with the k3 estimator
``exp(ref - logp) - (ref - logp) - 1``, averaged over all response tokens of
the optimizer step (token-level averaging, as in DAPO / verl's
``token-mean``), not per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards_N: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Advantages for rewards laid out as consecutive groups of ``group_size`` samples."""
    if rewards_N.numel() % group_size:
        raise ValueError(f"{rewards_N.numel()} rewards do not split into groups of {group_size}")
    r_GN = rewards_N.view(-1, group_size).float()
    mean = r_GN.mean(-1, keepdim=True)
    std = r_GN.std(-1, unbiased=False, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    return ((r_GN - mean) / (std + eps)).flatten()


@dataclass
class PolicyLossParts:
    loss_sum: torch.Tensor  # summed over masked tokens; divide by the step's token count
    clipped: torch.Tensor  # tokens where the clipped branch was taken
    kl_sum: torch.Tensor
    tokens: torch.Tensor


def grpo_token_loss(
    logp_BL: torch.Tensor,
    old_logp_BL: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BL: torch.Tensor,
    *,
    clip_eps: float,
    ref_logp_BL: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> PolicyLossParts:
    """Summed clipped-surrogate (+ KL) loss over the response tokens in ``mask_BL``."""
    mask = mask_BL.to(logp_BL.dtype)
    adv_BL = advantages_B[:, None].to(logp_BL.dtype)
    ratio = torch.exp(logp_BL - old_logp_BL)
    unclipped = ratio * adv_BL
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv_BL
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(per_token)
    if kl_coef > 0:
        if ref_logp_BL is None:
            raise ValueError("kl_coef > 0 needs reference log-probs")
        diff = ref_logp_BL - logp_BL
        kl = torch.exp(diff) - diff - 1
        per_token = per_token + kl_coef * kl
    with torch.no_grad():
        took_clip = ((clipped < unclipped) & mask_BL.bool()).sum()
    return PolicyLossParts(
        loss_sum=(per_token * mask).sum(),
        clipped=took_clip,
        kl_sum=(kl.detach() * mask).sum(),
        tokens=mask.sum().detach(),
    )


def token_logprobs(logits_BLV: torch.Tensor, targets_BL: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi_T(target) at every position, in fp32, for the policy at sampling temperature T
    (``softmax(logits / T)``, as verl; T = 0, greedy, counts as 1)."""
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits_BLV.float() / scale, dim=-1)
    return logp.gather(-1, targets_BL.clamp_min(0)[..., None]).squeeze(-1)
