"""GRPO advantages and the clipped token-level loss (``rl/losses.py`` defaults) on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from titan_foremoe.rl.grpo import group_advantages, token_logprobs
from titan_foremoe.rl.losses import LossNorm, PolicyLossConfig, policy_loss


def test_group_relative_advantages():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5]), group_size=2, eps=0.0)
    # groups (1, 0), (0, 1), (0.5, 0.5): mean 0.5, std 0.5 -> +-1; equal rewards -> 0 (eps avoids 0/0)
    assert adv[:4].tolist() == [1.0, -1.0, -1.0, 1.0]
    assert group_advantages(torch.tensor([0.5, 0.5]), 2).tolist() == [0.0, 0.0]
    adv3 = group_advantages(torch.tensor([3.0, 0.0, 0.0]), group_size=3, eps=0.0)
    std = math.sqrt(((2.0) ** 2 + 1 + 1) / 3)  # population std of (3, 0, 0) around mean 1
    assert adv3.tolist() == pytest.approx([2 / std, -1 / std, -1 / std])
    with pytest.raises(ValueError, match="do not split into groups"):
        group_advantages(torch.ones(5), 2)


def test_clipped_surrogate_token_level():
    logp_old = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.9, 2.0]]))
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    loss, metrics = policy_loss(logp, logp_old, adv, mask, PolicyLossConfig(), norm=LossNorm(tokens=1, sequences=1))
    # row 0 (A=+1): min(1.5, 1.2) = 1.2 -> -1.2 (clipped); min(0.5, 0.8) = 0.5 -> -0.5; masked
    # row 1 (A=-1): min(-1.5, -1.2) = -1.5 -> +1.5; min(-0.9, -0.9) -> +0.9; min(-2.0, -1.2) -> +2.0
    assert loss.item() == pytest.approx(-1.2 - 0.5 + 1.5 + 0.9 + 2.0)
    assert LossNorm.local_counts(mask).tolist() == [5, 2]
    assert metrics["rl/clip_frac"].item() == 1
    assert metrics["rl/kl"].item() == 0


def test_kl_penalty_k3():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    cfg = PolicyLossConfig(kl_coef=0.1)
    loss, metrics = policy_loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 1, dtype=torch.bool), cfg,
                                ref_logp_BL=ref)
    kl = 0.5 - math.log(0.5) - 1  # exp(d) - d - 1 with d = log(0.25 / 0.5)
    assert metrics["rl/kl"].item() == pytest.approx(kl)
    assert loss.item() == pytest.approx(0.1 * kl)
    with pytest.raises(ValueError, match="needs reference log-probs"):
        policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 1, dtype=torch.bool), cfg)


def test_gradient_is_the_policy_gradient_at_ratio_one():
    logits = torch.zeros(1, 1, 4, requires_grad=True)
    logp = token_logprobs(logits, torch.tensor([[2]]))
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool),
                          PolicyLossConfig())
    loss.backward()
    # d(-A * logp)/dlogits = -(onehot - softmax) = softmax - onehot
    assert logits.grad[0, 0].tolist() == pytest.approx([0.25, 0.25, -0.75, 0.25])
