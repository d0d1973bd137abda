"""Grouped GEMMs over a rank's slots, reading the owned experts in place.

A rank's C slots hold its K owned experts (rows of its EP shard) and J = C - K spare slots (replicas: rows of
a bank). Two paths, one autograd function each; neither saves a copy of the slot weights for backward (only
the sources, which FSDP frees and re-gathers, and the bank, a persistent buffer):

* **in place** (``SlotWeights.split`` given; every balancer whose owned slot c reads owned row c): the received
  rows are slot-major, so the first ``owned_rows`` (a host int from the plan's tables) belong to the owned
  slots. One ``torch._grouped_mm`` over all rows reads the owned ``[K, X, Y]`` shard as it is (it leaves the
  rows past its last offset unwritten); a second one over the spare rows reads the J spare slots' rows, gathered
  from the bank (J rows only), and its output is copied into those rows (no ``out=`` in ``_grouped_mm``).
  Backward: the two data-gradient GEMMs the same way, the owned weight gradient straight from its 2-D x 2-D GEMM
  (empty groups come back zero: torch's CPU kernel and Hopper's; pytorch issue 172439 reports otherwise on B200)
  and the spare slots' weight gradient ``index_add``-ed onto the bank rows. A part with no rows (host-known) is
  not run.
* **gather** (``split`` None: an owned slot holds another expert, e.g. EPLB-style plans): ``cat([owned,
  bank]).index_select(slots)`` in forward and again in backward, ``index_add`` of the ``[C, X, Y]`` weight
  gradient onto a zeroed ``cat(owned, bank)``-sized gradient.

``grouped_swiglu`` runs the in-place path's three GEMMs as one function (``slot_swiglu.py``: the owned and spare
parts kept apart through the MLP, joined with ``out=`` writes, so only the spare rows' final output is copied: per
layer 629 MB -> 210 MB at 25% spare rows); ``slot_grouped_mm`` stays for the gather path and for single GEMMs.
Bytes copied per call, one matrix (768 x 2048 bf16, 3.1 MB a slot) at Qwen3-30B-A3B, EP 8 (K = 16 owned + J = 2
spare, 131,072 rows; ``benchmarks/slot_gemm_bytes.py``): gather 113 MB forward (``cat`` + ``index_select`` of 18
slots), 227 MB backward; in place 6.3 MB forward (the 2 spare slots), 19 MB backward, plus the spare rows' outputs
(74 MB forward + backward with 10% of the rows on the spare slots, 185 MB with 25%). Per layer (3 matrices,
``--layer``) at 10%: gather 1019 MB, in place per GEMM 297 MB, fused 129 MB.

Legend: R expert-sorted rows, D model dim, F expert hidden, C slots, K owned experts, J spare slots (C - K),
B bank rows, U owned rows read by spare slots (usually none), X / Y a matrix's two dims (``[F, D]`` for w1,
w3; ``[D, F]`` for w2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class InPlaceSplit:
    """How the in-place path reads a rank's slots (device indices from the plan's host tables).

    ``owned_rows``/``spare_rows``: received rows of slots 0..K-1 / K..C-1 (host ints; rows are slot-major).
    Spare slot s reads row ``spare_source_J[s]`` of ``cat([owned[spare_owned_U], bank])`` (0 if empty);
    ``spare_owned_U`` is None when no spare slot reads an owned row (then that is the bank itself).
    ``bank_in_order`` (host bool): spare slot s reads bank row s, every row (one spare slot with a replica, the
    default): the fused SwiGLU reads the bank as it is and its weight gradient is the bank's, no gather, no
    ``index_add`` (``slot_swiglu.py``).
    ``bank_grads_ready``: called by the fused SwiGLU's backward with the bank rows' gradients as soon as it has
    them, before the owned part's backward (the transfer engine issues their return to the owners there, so the
    return overlaps the owned part; ``transfer/engine.py``); None: nothing to call.
    """

    owned_rows: int
    spare_rows: int
    spare_source_J: torch.Tensor
    spare_owned_U: torch.Tensor | None = None
    bank_in_order: bool = False
    bank_grads_ready: Callable[[list[torch.Tensor]], None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class SlotWeights:
    """One expert matrix over a rank's C slots: slot c is row ``index_C[c]`` of ``cat([owned_KXY, bank_BXY])``.

    ``split``: read the owned slots in place (``InPlaceSplit``); None: the gather path. Never materialized for
    backward (``slot_grouped_mm``); ``dense()`` builds the ``[C, X, Y]`` tensor (differentiable) for tests and
    reference paths.
    """

    owned_KXY: torch.Tensor
    bank_BXY: torch.Tensor
    index_C: torch.Tensor
    split: InPlaceSplit | None = None

    def dense(self) -> torch.Tensor:
        return torch.cat([self.owned_KXY, self.bank_BXY]).index_select(0, self.index_C)


def _gather(owned_KXY: torch.Tensor, bank_BXY: torch.Tensor, index_C: torch.Tensor) -> torch.Tensor:
    """``[C, X, Y]`` transient copy (no autograd): freed by the caller after its GEMM."""
    return torch.cat([owned_KXY, bank_BXY]).index_select(0, index_C)


class _SlotGroupedMM(torch.autograd.Function):
    """Gather path: ``x_RD @ w_c^T`` per slot group, ``w`` gathered in forward and re-gathered in backward."""

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


def _spare_source(owned_KYX, bank_BYX, owned_U):
    return bank_BYX if owned_U is None else torch.cat([owned_KYX.index_select(0, owned_U), bank_BYX])


def _joined(n_own: int, n_spare: int, own, spare, empty):
    """``own()``: the owned slots' GEMM over ALL rows (``torch._grouped_mm`` leaves the rows past its last offset
    unwritten); ``spare()``: the spare rows' GEMM, copied into those rows (spare rows only, not a ``cat`` of
    all rows). A part with no rows is not run."""
    if not n_spare:
        return own() if n_own else empty()
    if not n_own:
        return spare()
    out = own()
    out[n_own:] = spare()
    return out


class _InPlaceSlotMM(torch.autograd.Function):
    """In-place path: owned rows against the owned shard as it is, spare rows against their J gathered rows."""

    @staticmethod
    def forward(ctx, x_RX, offsets_C, n_own, n_spare, source_J, owned_U, owned_KYX, bank_BYX):
        K = owned_KYX.shape[0]
        ctx.sizes = (n_own, n_spare)
        ctx.save_for_backward(x_RX, offsets_C, source_J, owned_U, owned_KYX, bank_BYX)
        return _joined(
            n_own, n_spare,
            lambda: torch._grouped_mm(x_RX, owned_KYX.transpose(-2, -1), offs=offsets_C[:K]),
            lambda: torch._grouped_mm(
                x_RX[n_own:], _spare_source(owned_KYX, bank_BYX, owned_U).index_select(0, source_J).transpose(-2, -1),
                offs=offsets_C[K:] - n_own),
            lambda: x_RX.new_empty((0, owned_KYX.shape[1])),
        )

    @staticmethod
    def backward(ctx, g_RY):
        x_RX, offsets_C, source_J, owned_U, owned_KYX, bank_BYX = ctx.saved_tensors
        n_own, n_spare = ctx.sizes
        K = owned_KYX.shape[0]
        g_RY = g_RY.contiguous()
        offs_J = offsets_C[K:] - n_own if n_spare else None
        grad_x = grad_owned = grad_bank = None
        if ctx.needs_input_grad[0]:  # torch's formula: grad_mat1 = grad @ mat2^T, mat2 = w^T
            grad_x = _joined(
                n_own, n_spare,
                lambda: torch._grouped_mm(g_RY, owned_KYX, offs=offsets_C[:K]),
                lambda: torch._grouped_mm(
                    g_RY[n_own:], _spare_source(owned_KYX, bank_BYX, owned_U).index_select(0, source_J), offs=offs_J),
                lambda: g_RY.new_empty((0, owned_KYX.shape[2])),
            )
        if ctx.needs_input_grad[6] or ctx.needs_input_grad[7]:  # w^T's gradient mat1^T @ grad, as g^T @ x
            if n_own:  # [K, Y, X], empty groups zero; the shard's own layout: no copy, no index_add
                grad_owned = torch._grouped_mm(g_RY[:n_own].t(), x_RX[:n_own], offs=offsets_C[:K])
                grad_owned = grad_owned.to(owned_KYX.dtype)
            else:
                grad_owned = torch.zeros_like(owned_KYX)
            U = 0 if owned_U is None else owned_U.shape[0]
            g_src = bank_BYX.new_zeros((U + bank_BYX.shape[0], *bank_BYX.shape[1:]))
            if n_spare:
                g_JYX = torch._grouped_mm(g_RY[n_own:].t(), x_RX[n_own:], offs=offs_J)
                g_src.index_add_(0, source_J, g_JYX.to(g_src.dtype))
                if U:
                    grad_owned.index_add_(0, owned_U, g_src[:U].to(grad_owned.dtype))
            grad_bank = g_src[U:]
        return grad_x, None, None, None, None, None, grad_owned, grad_bank


def slot_grouped_mm(x_RX: torch.Tensor, w: SlotWeights, offsets_C: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w.dense().transpose(-2, -1), offs)`` without the dense weights: in place when
    ``w.split`` is given, else the gather path. ``x_RX`` has exactly the slots' rows (``offsets_C[-1]``)."""
    s = w.split
    if s is None:
        return _SlotGroupedMM.apply(x_RX, offsets_C, w.index_C, w.owned_KXY, w.bank_BXY)
    if x_RX.shape[0] != s.owned_rows + s.spare_rows:
        raise ValueError(f"slot GEMM: {x_RX.shape[0]} rows, the plan's slots receive {s.owned_rows} owned + "
                         f"{s.spare_rows} spare rows")
    return _InPlaceSlotMM.apply(x_RX, offsets_C, s.owned_rows, s.spare_rows, s.spare_source_J, s.spare_owned_U,
                                w.owned_KXY, w.bank_BXY)
