"""A token dispatcher that follows a placement plan, on torchtitan's dispatcher seam.

torchtitan's ``AllToAllTokenDispatcher`` sends every token-expert pair to the expert's owner and learns
the receive counts with an all-to-all of counts. ``PlannedTokenDispatcher`` sends each pair to the rank
*and slot* the plan assigned (an owner or a replica): the n-th pair of expert e goes to the segment of
e whose cumulative count first exceeds n (segments in (expert, destination rank) order). The tables
come from the ``PlacementSeam`` set on it (``models/seams.py``), so send and receive splits are known
without exchanging counts. Combine is torchtitan's. With no placement set the dispatcher is
torchtitan's, with one seam: ``expert_rows_E`` (set by the runtime when experts have been re-laid out
across EP ranks, ``placement/relayout.py``) maps logical expert ids to the rows of the EP-sharded weights
that hold them; routes and logs stay logical.

Legend: N token-expert pairs of this rank, Q send segments, T tokens, K top-k, D model dim, C slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed._functional_collectives import all_to_all_single
from torchtitan.models.common.token_dispatcher import AllToAllDispatchMetadata, AllToAllTokenDispatcher

from ..distributed.device import expected_sync
from ..distributed.uploads import upload_one
from .moe import seam_call


def route_pairs(
    e_N: torch.Tensor, seg_end_Q: torch.Tensor, seg_rank_Q: torch.Tensor, seg_slot_Q: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Send order of this source's token-expert pairs, and each pair's destination rank and slot.

    Pairs sorted by expert (stable, so token order within an expert) fill the segments in order. The
    send buffer is ordered by (destination rank, destination slot), the layout the receivers expect.
    Returns ``order_N`` (pair indices in send order), ``rank_N``, ``slot_N``.
    """
    by_expert_N = torch.argsort(e_N, stable=True)
    pos_N = torch.arange(e_N.numel(), device=e_N.device)
    seg_N = torch.searchsorted(seg_end_Q, pos_N, right=True).clamp_max(seg_end_Q.numel() - 1)  # in range always
    rank_sorted_N = seg_rank_Q[seg_N]
    slot_sorted_N = seg_slot_Q[seg_N]
    send_order = torch.argsort(rank_sorted_N * num_slots + slot_sorted_N, stable=True)
    rank_N = torch.empty_like(rank_sorted_N).scatter_(0, by_expert_N, rank_sorted_N)
    slot_N = torch.empty_like(slot_sorted_N).scatter_(0, by_expert_N, slot_sorted_N)
    return by_expert_N[send_order], rank_N, slot_N


class PlannedTokenDispatcher(AllToAllTokenDispatcher):
    @dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.placement = None  # a models.seams.PlacementSeam while a plan runs
        self.expert_rows_E: np.ndarray | None = None  # logical expert -> row of the EP-sharded weights
        self._rows_on_device: torch.Tensor | None = None

    def set_expert_rows(self, rows_E) -> None:
        """Where each logical expert's weights are now (None: row e, the DTensor default)."""
        self.expert_rows_E = None if rows_E is None else np.asarray(rows_E, dtype=np.int64)
        self._rows_on_device = None

    def expert_rows_on(self, device: torch.device) -> torch.Tensor | None:
        """``expert_rows_E`` on the device: uploaded once per layout change (pinned, no sync)."""
        if self.expert_rows_E is not None and self._rows_on_device is None:
            self._rows_on_device = upload_one(self.expert_rows_E, device)
        return self._rows_on_device

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        p = self.placement
        if p is None or self.ep_mesh is None:
            rows_E = self.expert_rows_on(topk_expert_ids_TK.device)
            if rows_E is not None:  # to the rows that hold the experts now
                topk_expert_ids_TK = rows_E[topk_expert_ids_TK]
                num_local_tokens_per_expert_E = torch.zeros_like(num_local_tokens_per_expert_E).index_copy_(
                    0, rows_E, num_local_tokens_per_expert_E)
            with expected_sync("torchtitan's dispatcher reads its split sizes"):
                return super().dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
        # The planned path reads this micro-step's host tables: eager (a graph break) under torch.compile.
        return seam_call(self._dispatch_planned, x_TD, topk_scores_TK, topk_expert_ids_TK,
                         num_local_tokens_per_expert_E)

    def combine(self, routed_output_RD, metadata, x_TD):
        if self.placement is None or self.ep_mesh is None:
            return super().combine(routed_output_RD, metadata, x_TD)
        combine_tokens = getattr(self.placement, "combine_tokens", None)
        if combine_tokens is not None:  # a placement with its own transport (exact, placement/exact.py)
            return seam_call(combine_tokens, routed_output_RD, metadata, x_TD)
        # the planned splits are host ints of this micro-step: eager, so a new plan is no recompile
        return seam_call(super().combine, routed_output_RD, metadata, x_TD)

    def _dispatch_planned(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        p = self.placement
        dispatch_tokens = getattr(p, "dispatch_tokens", None)
        if dispatch_tokens is not None:  # plans on the device and moves tokens itself (exact, placement/exact.py)
            return dispatch_tokens(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E,
                                   self.ep_mesh)
        prepare = getattr(p, "prepare", None)
        if prepare is not None:  # a placement planned here, from this layer's counts (reactive)
            prepare(num_local_tokens_per_expert_E)
        d = p.dispatch
        device = x_TD.device
        p.check_loads(num_local_tokens_per_expert_E)  # no sync: a device flag, read once per stage
        K = topk_expert_ids_TK.shape[1]
        order_N, _, _ = route_pairs(
            topk_expert_ids_TK.reshape(-1), *(p.index(n, device) for n in ("seg_end_Q", "seg_rank_Q", "seg_slot_Q")),
            d.num_slots,
        )
        token_indices_N = order_N // K
        scores_N = topk_scores_TK.reshape(-1)[order_N]

        input_splits = d.input_splits()
        output_splits = d.output_splits()
        if topk_expert_ids_TK.numel() != sum(input_splits):  # shapes are host-known: no sync, before any collective
            raise RuntimeError(f"layer {p.layer}: {topk_expert_ids_TK.numel()} token-expert pairs to send, the plan "
                               f"sends {sum(input_splits)} (the micro-batch is not the one the plan was made for)")
        routed_input_RD = all_to_all_single(x_TD[token_indices_N], output_splits, input_splits, self.ep_mesh)
        p.record_received(routed_input_RD.shape[0])
        input_shape, routed_input_RD, permuted_indices, tokens_per_slot_C = self._permute(
            routed_input_RD, p.index("recv_C", device)
        )
        metadata = AllToAllDispatchMetadata(
            token_indices_experts_sorted_N=token_indices_N,
            topk_scores_experts_sorted_N=scores_N,
            input_shape=input_shape,
            permuted_indices=permuted_indices,
            input_splits=input_splits,
            output_splits=output_splits,
        )
        return routed_input_RD, tokens_per_slot_C, metadata
