"""Grouped GEMMs over a rank's slots without a materialized copy of the slot weights held for backward.

A rank's C slots hold its K owned experts (rows of its EP shard) and B replicas (rows of a bank).
``torch._grouped_mm`` over ``cat([owned, bank]).index_select(slots)`` would save that ``[C, F, D]`` copy
for backward: at Qwen3-30B-A3B, EP 8 (17-18 slots x 3.1 MB per matrix x 3 x 48 layers) ~8 GB per rank
held from forward to backward, the very bytes FSDP's reshard-after-forward frees. ``slot_grouped_mm``
gathers in forward and again in backward and saves only the sources (the owned shard, which FSDP frees
and re-gathers, and the bank, a persistent buffer) and the C slot indices. Extra cost: one transient
gather of one matrix's slots per GEMM in backward (~55 MB bf16 per matrix at that size, ~0.04 ms of
HBM traffic), no extra GEMM. Gradients are torch's own ``_grouped_mm`` formulas, summed back onto the
owned and bank rows by ``index_add`` (a slot's gradient reaches the row it was read from).

Legend: R expert-sorted rows, D model dim, F expert hidden, C slots, K owned experts, B bank rows,
X / Y a matrix's two dims (``[F, D]`` for w1, w3; ``[D, F]`` for w2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotWeights:
    """One expert matrix over a rank's C slots: slot c is row ``index_C[c]`` of ``cat([owned_KXY, bank_BXY])``.

    Never materialized for backward (``slot_grouped_mm``); ``dense()`` builds the ``[C, X, Y]`` tensor
    (differentiable) for tests and reference paths.
    """

    owned_KXY: torch.Tensor
    bank_BXY: torch.Tensor
    index_C: torch.Tensor

    def dense(self) -> torch.Tensor:
        return torch.cat([self.owned_KXY, self.bank_BXY]).index_select(0, self.index_C)


def _gather(owned_KXY: torch.Tensor, bank_BXY: torch.Tensor, index_C: torch.Tensor) -> torch.Tensor:
    """``[C, X, Y]`` transient copy (no autograd): freed by the caller after its GEMM."""
    return torch.cat([owned_KXY, bank_BXY]).index_select(0, index_C)


class _SlotGroupedMM(torch.autograd.Function):
    """``x_RD @ w_c^T`` per slot group, ``w`` gathered in forward and re-gathered in backward."""

    @staticmethod
    def forward(ctx, x_RX, offsets_C, index_C, owned_KYX, bank_BYX):
        w_CYX = _gather(owned_KYX, bank_BYX, index_C)
        ctx.save_for_backward(x_RX, offsets_C, index_C, owned_KYX, bank_BYX)
        return torch._grouped_mm(x_RX, w_CYX.transpose(-2, -1), offs=offsets_C)

    @staticmethod
    def backward(ctx, g_RY):
        x_RX, offsets_C, index_C, owned_KYX, bank_BYX = ctx.saved_tensors
        g_RY = g_RY.contiguous()
        grad_x = grad_owned = grad_bank = None
        if ctx.needs_input_grad[0]:  # torch's formula: grad_mat1 = grad @ mat2^T, mat2 = w^T
            grad_x = torch._grouped_mm(g_RY, _gather(owned_KYX, bank_BYX, index_C), offs=offsets_C)
        if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:  # grad_mat2 = mat1^T @ grad, per group
            g_CXY = torch._grouped_mm(x_RX.t(), g_RY, offs=offsets_C)
            K = owned_KYX.shape[0]
            g_all = owned_KYX.new_zeros((K + bank_BYX.shape[0], *owned_KYX.shape[1:]))
            g_all.index_add_(0, index_C, g_CXY.transpose(-2, -1).to(g_all.dtype))
            grad_owned, grad_bank = g_all[:K], g_all[K:]
        return grad_x, None, None, grad_owned, grad_bank


def slot_grouped_mm(x_RX: torch.Tensor, w: SlotWeights, offsets_C: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w.dense().transpose(-2, -1), offs)`` with only indices saved for the slots."""
    return _SlotGroupedMM.apply(x_RX, offsets_C, w.index_C, w.owned_KXY, w.bank_BXY)
