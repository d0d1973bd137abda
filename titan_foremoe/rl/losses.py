"""The policy loss as verl / slime / NeMo-RL users configure it, one pure function.

Per token: PPO's clipped surrogate on ``rho = exp(logp - old_logp)`` with an asymmetric
range ``[1 - clip_eps_low, 1 + clip_eps_high]`` (DAPO's clip-higher) and, for negative
advantages, the dual-clip bound ``-A * clip_ratio_c`` (Ye et al., 2020) that stops one
token with a huge ratio from dominating; times a detached rollout-correction weight
(truncated or masked importance sampling of the recompute's log-probs ``old_logp``
against the engine's ``rollout_logp``, which come from another kernel and another
precision); plus ``kl_coef * KL(pi || pi_ref)`` (estimator ``k1 | k2 | k3 |
low_var_kl``) minus ``entropy_coef * H(pi)``.

Aggregation (``loss_agg_mode``, verl's names) over the *optimizer step*: the normalizers
(loss tokens, sequences) are counted over every micro-step and data-parallel rank before
the first micro-step and passed in as ``LossNorm``, so every micro-step's loss is already
its share of the step's loss; summing micro-steps (gradient accumulation) and ranks (FSDP
sums gradients) gives the loss and gradients of one big batch in every mode:

- ``token-mean``: sum over tokens / step tokens (DAPO; the default);
- ``seq-mean-token-mean``: mean over sequences of each sequence's token mean (GRPO paper);
- ``seq-mean-token-sum``: mean over sequences of each sequence's token sum;
- ``seq-mean-token-sum-norm``: mean over sequences of token sum / a constant (Dr. GRPO;
  ``loss_norm_tokens``, default ``max_new_tokens``). verl's mode of that name does not
  divide by the number of sequences; ours does, as Dr. GRPO's code.

Metrics are additive the same way: each is a sum divided by the step's normalizer, so
summing over micro-steps and ranks gives the step's value. Cost: elementwise on
``[B, L]``, no host sync.

Rows are padded sequences (one per row), or packed: several sequences in one row, each position naming its
sequence (``Segments``); per-sequence sums (the seq-mean modes, ``rollout_is = "sequence"``) are then one
``index_add_`` over the row and the advantages are per sequence, spread to positions by one gather.

Legend: B rows (padded: sequences), L positions, S sequences of packed rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


@dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """The loss options of ``[rl]`` (``from_rl``); see ``docs/rl.md`` for the table."""

    loss_agg_mode: AggMode = "token-mean"
    loss_norm_tokens: float = 1.0  # seq-mean-token-sum-norm's constant
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    clip_ratio_c: float = 0.0  # 0: no dual clip
    rollout_is: Literal["off", "token", "sequence"] = "off"
    rollout_is_threshold: float = 2.0
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    entropy_coef: float = 0.0

    @classmethod
    def from_rl(cls, rl) -> "PolicyLossConfig":
        """From the ``[rl]`` section: ``clip_eps`` fills an unset low/high bound."""
        return cls(
            loss_agg_mode=rl.loss_agg_mode,
            loss_norm_tokens=float(rl.loss_norm_tokens or rl.max_new_tokens),
            clip_eps_low=rl.clip_eps if rl.clip_eps_low is None else rl.clip_eps_low,
            clip_eps_high=rl.clip_eps if rl.clip_eps_high is None else rl.clip_eps_high,
            clip_ratio_c=rl.clip_ratio_c,
            rollout_is=rl.rollout_is,
            rollout_is_threshold=rl.rollout_is_threshold,
            rollout_is_mode=rl.rollout_is_mode,
            kl_coef=rl.kl_coef,
            kl_estimator=rl.kl_estimator,
            entropy_coef=rl.entropy_coef,
        )


@dataclass(frozen=True)
class Segments:
    """The sequence of each position of packed rows (``seq_BL``, index < ``count``; -1: none), for sums per
    sequence and per-sequence values per position. Vectorized over the row: no loop, no host sync."""

    seq_BL: torch.Tensor
    count: int  # S

    def _index_N(self) -> torch.Tensor:
        """Sequence of each flat position, -1 sent to an extra bucket ``count`` that is dropped."""
        return torch.where(self.seq_BL >= 0, self.seq_BL, self.count).reshape(-1)

    def sums(self, values_BL: torch.Tensor) -> torch.Tensor:
        """``[S]`` sum of each sequence's positions."""
        out = values_BL.new_zeros(self.count + 1)
        return out.index_add_(0, self._index_N(), values_BL.reshape(-1))[: self.count]

    def spread(self, values_S: torch.Tensor) -> torch.Tensor:
        """``[B, L]``: each position takes its sequence's value (0 where none)."""
        padded = torch.cat([values_S, values_S.new_zeros(1)])
        return padded[self._index_N()].view(self.seq_BL.shape)


def _seq_sums(values_BL: torch.Tensor, segments: Segments | None) -> torch.Tensor:
    """Per-sequence sums: of each padded row, or of each packed sequence."""
    return values_BL.sum(-1) if segments is None else segments.sums(values_BL)


@dataclass(frozen=True)
class LossNorm:
    """The optimizer step's normalizers, over all its micro-steps and data-parallel ranks."""

    tokens: float  # loss tokens
    sequences: float  # sequences with at least one loss token

    @staticmethod
    def local_counts(mask_BL: torch.Tensor, segments: Segments | None = None) -> torch.Tensor:
        """``[tokens, sequences]`` of one micro-batch (fp64): sum them over micro-steps, all-reduce, ``of``.
        ``segments``: packed rows' sequences (default: one per row)."""
        m = mask_BL.bool()
        if segments is None:
            return torch.stack([m.sum(), m.any(-1).sum()]).double()
        return torch.stack([m.sum(), (segments.sums(m.double()) > 0).sum()]).double()

    @classmethod
    def of(cls, counts: torch.Tensor) -> "LossNorm":
        tokens, sequences = (max(float(c), 1.0) for c in counts.tolist())
        return cls(tokens, sequences)


def aggregate(values_BL: torch.Tensor, mask_BL: torch.Tensor, mode: str, norm: LossNorm,
              norm_tokens: float = 1.0, segments: Segments | None = None) -> torch.Tensor:
    """This batch's share of the step's ``mode`` aggregate of ``values_BL`` over ``mask_BL``
    (``segments``: packed rows' sequences; default one sequence per row)."""
    masked = values_BL * mask_BL.to(values_BL.dtype)
    if mode == "token-mean":
        return masked.sum() / norm.tokens
    if mode == "seq-mean-token-mean":
        per_seq = _seq_sums(masked, segments) / _seq_sums(mask_BL.to(values_BL.dtype), segments).clamp_min(1)
        return per_seq.sum() / norm.sequences
    if mode == "seq-mean-token-sum":
        return masked.sum() / norm.sequences
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (norm.sequences * norm_tokens)
    raise ValueError(f"unknown loss_agg_mode {mode!r} ({' | '.join(AGG_MODES)})")


def kl_penalty(logp_BL: torch.Tensor, ref_logp_BL: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3;
    ``low_var_kl`` is verl's k3 with the log-ratio clamped to [-20, 20] and the result to [-10, 10])."""
    log_ratio = ref_logp_BL - logp_BL  # log pi_ref / pi
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1
    if estimator == "low_var_kl":
        log_ratio = log_ratio.clamp(-20, 20)
        return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10, 10)
    raise ValueError(f"unknown kl_estimator {estimator!r} ({' | '.join(KL_ESTIMATORS)})")


def rollout_is_weights(
    old_logp_BL: torch.Tensor, rollout_logp_BL: torch.Tensor, mask_BL: torch.Tensor, cfg: PolicyLossConfig,
    segments: Segments | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached ``(weights_BL, rejected_BL)``: ``pi_old / pi_rollout`` per token (or its product over a
    sequence's loss tokens, broadcast), truncated at the threshold or zeroed above it (``rejected``)."""
    with torch.no_grad():
        m = mask_BL.bool()
        log_w = torch.where(m, old_logp_BL - rollout_logp_BL, torch.zeros_like(old_logp_BL))
        if cfg.rollout_is == "sequence" and segments is None:
            log_w = log_w.sum(-1, keepdim=True).expand_as(old_logp_BL)
        elif cfg.rollout_is == "sequence":
            log_w = segments.spread(segments.sums(log_w))
        log_thr = math.log(cfg.rollout_is_threshold)
        over = log_w > log_thr
        w = torch.exp(log_w.clamp(max=log_thr))  # clamped before exp: no overflow of a sequence's product
        if cfg.rollout_is_mode == "mask":
            w = torch.where(over, torch.zeros_like(w), w)
        return w, over & m


def policy_loss(
    logp_BL: torch.Tensor,
    old_logp_BL: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BL: torch.Tensor,
    cfg: PolicyLossConfig,
    *,
    rollout_logp_BL: torch.Tensor | None = None,
    ref_logp_BL: torch.Tensor | None = None,
    entropy_BL: torch.Tensor | None = None,
    norm: LossNorm | None = None,
    segments: Segments | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)`` of this batch as its share of the optimizer step normalized by ``norm``
    (default: this batch is the whole step). Metrics are detached, additive over micro-steps and ranks.
    ``segments``: the rows are packed, ``advantages_B`` is per sequence ``[S]``; default: one per row."""
    if norm is None:
        norm = LossNorm.of(LossNorm.local_counts(mask_BL, segments))
    mask = mask_BL.to(logp_BL.dtype)
    if segments is None:
        adv_BL = advantages_B[:, None].to(logp_BL.dtype)
    else:
        adv_BL = segments.spread(advantages_B.to(logp_BL.dtype))
    ratio = torch.exp(logp_BL - old_logp_BL)
    pg_unclipped = -adv_BL * ratio
    pg_clipped = -adv_BL * ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    metrics: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        metrics["rl/clip_frac"] = ((pg_clipped > pg_unclipped) * mask).sum() / norm.tokens
    if cfg.clip_ratio_c > 0:
        pg_dual = -adv_BL * cfg.clip_ratio_c
        dual = (adv_BL < 0) & (pg_dual < pg)
        pg = torch.where(adv_BL < 0, torch.minimum(pg, pg_dual), pg)
        metrics["rl/dual_clip_frac"] = (dual * mask).sum().detach() / norm.tokens
    if cfg.rollout_is != "off":
        if rollout_logp_BL is None:
            raise ValueError("rollout_is needs the rollout's (behaviour) log-probs")
        w_BL, rejected_BL = rollout_is_weights(old_logp_BL, rollout_logp_BL, mask_BL, cfg, segments)
        pg = pg * w_BL
        with torch.no_grad():
            log_r = torch.where(mask_BL.bool(), old_logp_BL - rollout_logp_BL, torch.zeros_like(w_BL))
            metrics["rollout_is/weight_mean"] = (w_BL * mask).sum() / norm.tokens
            metrics["rollout_is/weight_sq_mean"] = (w_BL.square() * mask).sum() / norm.tokens  # the spread's part
            metrics["rollout_is/rejected_frac"] = (rejected_BL * mask).sum() / norm.tokens
            # KL(behaviour || recompute) from the behaviour's samples, k3: r - 1 - log r with r = pi_old / pi_rollout
            metrics["rollout_is/kl_rollout_recompute"] = ((log_r.exp() - 1 - log_r) * mask).sum() / norm.tokens
    per_token = pg
    if cfg.kl_coef > 0:
        if ref_logp_BL is None:
            raise ValueError("kl_coef > 0 needs reference log-probs")
        kl = kl_penalty(logp_BL, ref_logp_BL, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
        metrics["rl/kl"] = (kl.detach() * mask).sum() / norm.tokens
    else:
        metrics["rl/kl"] = logp_BL.new_zeros(())
    if cfg.entropy_coef > 0 and entropy_BL is None:
        raise ValueError("entropy_coef > 0 needs the entropy")
    if entropy_BL is not None:
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * entropy_BL
        metrics["rl/entropy"] = (entropy_BL.detach() * mask).sum() / norm.tokens
    loss = aggregate(per_token, mask_BL, cfg.loss_agg_mode, norm, cfg.loss_norm_tokens, segments)
    metrics["loss"] = loss.detach()
    return loss, metrics
