"""A token dispatcher that follows the plan, on torchtitan's dispatcher seam.

torchtitan's ``AllToAllTokenDispatcher`` sends every token-expert pair to the
expert's owner and learns the receive counts with an all-to-all of counts.
``PlannedTokenDispatcher`` sends each pair to the rank *and slot* the plan
assigned (an owner or a replica): the n-th pair of expert e on source s goes
to the host whose cumulative share ``tokens_SER[s, e, :]`` first exceeds n.
Every rank knows the whole plan, so send and receive splits are known without
exchanging counts. Combine is torchtitan's (reverse permute, all-to-all back,
weight by the routing score, scatter-add). With no active placement the
dispatcher is torchtitan's unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed._functional_collectives import all_to_all_single
from torchtitan.models.common.token_dispatcher import AllToAllDispatchMetadata, AllToAllTokenDispatcher

from ..models.moe import compiled
from .active import ActivePlacement


def route_pairs(
    e_N: torch.Tensor, send_ER: torch.Tensor, dest_slot_ER: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Send order of this source's token-expert pairs, and each pair's destination rank and slot.

    Pairs of expert e (in their original order) fill the hosts of e in rank
    order, ``send_ER[e, r]`` pairs each. The send buffer is ordered by
    (destination rank, destination slot), the layout the receivers expect.
    Returns ``order_N`` (pair indices in send order), ``rank_N``, ``slot_N``.
    """
    by_expert_N = torch.argsort(e_N, stable=True)
    e_sorted_N = e_N[by_expert_N]
    planned_E = send_ER.sum(1)
    starts_E = torch.cumsum(planned_E, 0) - planned_E
    pos_N = torch.arange(e_N.numel(), device=e_N.device) - starts_E[e_sorted_N]
    rank_sorted_N = (pos_N[:, None] >= torch.cumsum(send_ER, dim=1)[e_sorted_N]).sum(1)
    slot_sorted_N = dest_slot_ER[e_sorted_N, rank_sorted_N]
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
        self.placement: ActivePlacement | None = None
        self.compile_regions = False  # run the pair routing under torch.compile

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        p = self.placement
        if p is None or self.ep_mesh is None:
            return super().dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
        lay = p.layout
        device = x_TD.device
        send_ER = torch.as_tensor(lay.send_ER, device=device)
        planned_E = send_ER.sum(1)
        if not torch.equal(num_local_tokens_per_expert_E.to(planned_E.dtype), planned_E):
            raise RuntimeError(
                f"layer {p.layer}: this micro-step's routes {num_local_tokens_per_expert_E.tolist()} differ from the "
                f"loads the plan was made for {planned_E.tolist()}"
            )
        K = topk_expert_ids_TK.shape[1]
        fn = compiled(route_pairs) if self.compile_regions else route_pairs
        order_N, _, _ = fn(
            topk_expert_ids_TK.reshape(-1), send_ER, torch.as_tensor(lay.dest_slot_ER, device=device),
            len(lay.slot_expert_C),
        )
        token_indices_N = order_N // K
        scores_N = topk_scores_TK.reshape(-1)[order_N]

        input_splits = lay.input_splits_R.tolist()
        output_splits = lay.output_splits_S.tolist()
        routed_input_RD = all_to_all_single(x_TD[token_indices_N], output_splits, input_splits, self.ep_mesh)
        input_shape, routed_input_RD, permuted_indices, tokens_per_slot_C = self._permute(
            routed_input_RD, torch.as_tensor(lay.recv_SC.reshape(-1), device=device)
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
