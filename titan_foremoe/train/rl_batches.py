"""Recompute/update micro-batches cut from a rollout: inputs, targets, masks and the replayed routes.

Two layouts of one ``RLMicroBatch``:

- padded (``pack=False``): one row per sequence, right-padded to the longest, ``[S, L]``; padding is
  computed by attention, the dense projections and the lm_head, and masked out of the MoE layers and the loss.
- packed (``pack=True``): the sequences' input positions (``tokens[:-1]`` of each) concatenated into ONE row
  ``[1, N]``, N = sum of (length - 1): nothing padded is computed. ``positions_BL`` restart at 0 for every
  sequence (RoPE; the attention mask is causal within each sequence, ``models/attention.py``), ``seq_BL``
  names each position's sequence (index into ``sequences``) for the loss's per-sequence sums and the
  advantages, ``cu_seqlens_S1`` bounds the sequences (varlen attention).

A micro-step with no sequence (a rank the step has no sequence for) is one masked position of token 0 in
either layout: forward, backward and every collective still run; it routes nothing and adds 0 to the loss.

Cost per micro-batch: host gathers over its N positions (packed) or S x L (padded); no device work.
Legend: B rows, L positions of a row, X MoE layers, K top-k, S sequences, N packed positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..rollouts.generate import Rollout


@dataclass
class RLMicroBatch:
    """One micro-step of the recompute/update stages for this rank."""

    sequences: list[int]  # rollout rows
    inputs_BL: torch.Tensor  # tokens[:-1]: right-padded rows, or one packed row
    targets_BL: torch.Tensor  # tokens[1:]
    token_mask_BL: torch.Tensor  # real (routed) input positions
    loss_mask_BL: torch.Tensor  # positions that predict a completion token
    routes_BLXK: torch.Tensor  # logged experts of every input position
    advantages_B: torch.Tensor  # per sequence (a padded row is a sequence)
    rollout_logp_BL: torch.Tensor
    old_logp_BL: torch.Tensor | None = None
    ref_logp_BL: torch.Tensor | None = None
    holes: bool = False  # routes_BLXK holds -1 rows (no route): the live router fills them
    positions_BL: torch.Tensor | None = None  # packed: position within its sequence; None: padded rows
    seq_BL: torch.Tensor | None = None  # packed: index into ``sequences`` of each position, -1: padding
    cu_seqlens_S1: torch.Tensor | None = None  # packed: int32 sequence bounds in the row
    max_len: int = 0  # packed: the longest sequence's input positions

    @property
    def packed(self) -> bool:
        return self.positions_BL is not None

    def computed_positions(self) -> int:
        """Positions the model computes (attention, dense projections, lm_head): B x L."""
        return self.inputs_BL.numel()

    def real_tokens(self) -> int:
        """Real (routed) input positions."""
        return int(self.token_mask_BL.sum())

    def rows(self, x_BL: torch.Tensor) -> torch.Tensor:
        """``x_BL[...]`` (host) as one right-padded row per sequence, ``[S, L, ...]`` (the routing log's
        layout); padded micro-batches are that already."""
        if not self.packed:
            return x_BL
        keep_N = self.seq_BL[0] >= 0
        out = x_BL.new_zeros(len(self.sequences), max(self.max_len, 1), *x_BL.shape[2:])
        out[self.seq_BL[0][keep_N], self.positions_BL[0][keep_N]] = x_BL[0][keep_N]
        return out


def build_micro_batch(rollout: Rollout, sequences: list[int], advantages_N: torch.Tensor,
                      trained_N: torch.Tensor | None = None, *, pack: bool = False) -> RLMicroBatch:
    """``trained_N``: rollout rows that enter the loss (others are replayed with an empty loss mask);
    ``pack``: the packed layout (see the module docstring)."""
    if not sequences:
        return empty_micro_batch(rollout, advantages_N)
    if pack:
        return _packed(rollout, sequences, advantages_N, trained_N)
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


def _packed(rollout: Rollout, sequences: list[int], advantages_N: torch.Tensor,
            trained_N: torch.Tensor | None) -> RLMicroBatch:
    """The sequences' input positions in one row: (rollout row, position) of each by one vectorized gather."""
    idx = torch.tensor(sequences, dtype=torch.int64)
    n_S = rollout.lengths_B[idx] - 1  # input positions of each sequence
    ends_S = torch.cumsum(n_S, 0)
    N = int(ends_S[-1])
    seq_N = torch.repeat_interleave(torch.arange(len(sequences)), n_S, output_size=N)
    pos_N = torch.arange(N) - (ends_S - n_S)[seq_N]
    row_N = idx[seq_N]
    loss_N = pos_N >= rollout.prompt_lens_B[row_N] - 1
    if rollout.loss_mask_BT is not None:  # multi-turn: position p predicts token p + 1
        loss_N &= rollout.loss_mask_BT[row_N, pos_N + 1]
    if trained_N is not None:
        loss_N &= trained_N[row_N]
    live = rollout.routes.live_BTX
    return RLMicroBatch(
        sequences=sequences,
        inputs_BL=rollout.tokens_BT[row_N, pos_N][None],
        targets_BL=rollout.tokens_BT[row_N, pos_N + 1][None],
        token_mask_BL=torch.ones(1, N, dtype=torch.bool),
        loss_mask_BL=loss_N[None],
        routes_BLXK=rollout.routes.routes_at(row_N, pos_N)[None],
        advantages_B=advantages_N[idx],
        rollout_logp_BL=rollout.logprobs_BT[row_N, pos_N + 1][None],
        holes=live is not None and bool(live[row_N, pos_N].any()),
        positions_BL=pos_N[None],
        seq_BL=seq_N[None],
        cu_seqlens_S1=torch.cat([ends_S.new_zeros(1), ends_S]).to(torch.int32),
        max_len=int(n_S.max()),
    )


def empty_micro_batch(rollout: Rollout, advantages_N: torch.Tensor) -> RLMicroBatch:
    """A micro-step with no sequence: one position of token 0, masked out of the MoE layers (no route is
    dispatched) and of the loss, in the packed layout (``seq_BL`` -1, no sequence); it still runs the forward,
    the backward and every collective, and adds exactly 0 to the loss and its gradients."""
    X, K = rollout.routes.num_layers, rollout.routes.top_k
    false = torch.zeros(1, 1, dtype=torch.bool)
    return RLMicroBatch(
        sequences=[],
        inputs_BL=torch.zeros(1, 1, dtype=rollout.tokens_BT.dtype),
        targets_BL=torch.zeros(1, 1, dtype=rollout.tokens_BT.dtype),
        token_mask_BL=false,
        loss_mask_BL=false.clone(),
        routes_BLXK=torch.zeros(1, 1, X, K, dtype=torch.int64),  # a masked position's filler, as padding's
        advantages_B=advantages_N.new_zeros(0),
        rollout_logp_BL=torch.zeros(1, 1, dtype=rollout.logprobs_BT.dtype),
        positions_BL=torch.zeros(1, 1, dtype=torch.int64),
        seq_BL=torch.full((1, 1), -1, dtype=torch.int64),
        cu_seqlens_S1=torch.tensor([0, 1], dtype=torch.int32),
        max_len=1,
    )


def split_recomputed(merged: list[RLMicroBatch], parts: list[RLMicroBatch], k: int) -> None:
    """Each part's ``old_logp_BL`` / ``ref_logp_BL`` as views of its merged micro-batch's
    (``schedule.merge.merged_cells``; ``_packed`` keeps the order, so a merged row is its parts' rows end to end):
    packed, the part's positions; padded, its rows and its own length. A part with no sequence has no position in
    the merged row: its one masked position gets 0, which the update replaces by its own log-prob
    (``loss_references``)."""
    for i, mb in enumerate(merged):
        row = 0
        for part in parts[i * k : (i + 1) * k]:
            n = part.inputs_BL.shape[1]
            for name in ("old_logp_BL", "ref_logp_BL"):
                whole = getattr(mb, name)
                if whole is None:
                    continue
                if not part.sequences:
                    piece = whole.new_zeros(1, 1)
                elif mb.packed:
                    piece = whole[:, row : row + n]
                else:
                    piece = whole[row : row + len(part.sequences), :n]
                setattr(part, name, piece)
            if part.sequences:
                row += n if mb.packed else len(part.sequences)


def loss_references(mb: RLMicroBatch, logp_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(old, reference) log-probs the update's loss compares ``logp_BL`` with. A micro-step with no sequence
    compares its one masked position with its own log-prob: its recomputed values may be a merged recompute's
    filler (``split_recomputed``), and a masked position still enters the loss as ``value x 0``, so a filler far
    from its log-prob (k3's ``exp(ref - logp)`` overflowing) would make the step's loss and gradients NaN."""
    if mb.sequences:
        return mb.old_logp_BL, mb.ref_logp_BL
    own = logp_BL.detach()
    return own, None if mb.ref_logp_BL is None else own
