"""Recompute/update micro-batches cut from a rollout: inputs, targets, masks and the replayed routes.

Legend: B sequences, L input positions (``tokens[:-1]``), X MoE layers, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..rollouts.generate import Rollout


@dataclass
class RLMicroBatch:
    """One micro-step of the recompute/update stages for this rank."""

    sequences: list[int]  # rollout rows
    inputs_BL: torch.Tensor  # tokens[:-1], right-padded
    targets_BL: torch.Tensor  # tokens[1:]
    token_mask_BL: torch.Tensor  # real (routed) input positions
    loss_mask_BL: torch.Tensor  # positions that predict a completion token
    routes_BLXK: torch.Tensor  # logged experts of every input position
    advantages_B: torch.Tensor
    rollout_logp_BL: torch.Tensor
    old_logp_BL: torch.Tensor | None = None
    ref_logp_BL: torch.Tensor | None = None
    holes: bool = False  # routes_BLXK holds -1 rows (no route): the live router fills them


def build_micro_batch(rollout: Rollout, sequences: list[int], advantages_N: torch.Tensor,
                      trained_N: torch.Tensor | None = None, *, pack: bool = False) -> RLMicroBatch:
    """``trained_N``: rollout rows that enter the loss (others are replayed with an empty loss mask)."""
    idx = torch.tensor(sequences)
    lengths = rollout.lengths_B[idx]
    prompt_lens = rollout.prompt_lens_B[idx]
    L = int(lengths.max()) - 1
    tokens = rollout.tokens_BT[idx, : L + 1]
    pos = torch.arange(L)[None, :]
    token_mask = pos < (lengths[:, None] - 1)
    loss_mask = (pos >= prompt_lens[:, None] - 1) & token_mask
    if rollout.loss_mask_BT is not None:  # multi-turn: position p predicts token p + 1
        loss_mask &= rollout.loss_mask_BT[idx, 1 : L + 1]
    if trained_N is not None:
        loss_mask &= trained_N[idx][:, None]
    log = rollout.routes.select(sequences)
    return RLMicroBatch(
        sequences=sequences,
        inputs_BL=tokens[:, :L],
        targets_BL=tokens[:, 1 : L + 1],
        token_mask_BL=token_mask,
        loss_mask_BL=loss_mask,
        routes_BLXK=log.routes_for_inputs(L),
        advantages_B=advantages_N[idx],
        rollout_logp_BL=rollout.logprobs_BT[idx, 1 : L + 1],
        holes=getattr(log, "live_BTX", None) is not None and log.holes() > 0,  # no log scan without holes
    )
