"""The whole grouped SwiGLU over a rank's slots on the in-place path, in one autograd function.

``slot_gemm.py``'s in-place path runs each of the three expert GEMMs as two ``torch._grouped_mm`` calls (owned
rows against the owned shard as it is, spare rows against their gathered bank rows) and copies the spare rows'
output into the joined output, per GEMM (``torch._grouped_mm`` has no ``out=``): forward the w1, w3, w2 output
widths (2F + D per spare row), backward the three data gradients (2D + F). Here the owned part (rows
``[:n_own]``) and the spare part (rows ``[n_own:]``) stay apart through the MLP; each part's elementwise
results are written straight into joined buffers with ``out=`` (the gate ``h``, the data gradient ``g_x``), and
the w2 GEMM of the owned part runs over all rows (it leaves the rows past its last offset unwritten), so the
only copy left is the spare rows' final output (D wide). The data gradient needs none: the w2 data gradient,
the SiLU x product backward and the w1 / w3 data gradients run per part, their sum written into ``g_x``'s rows.

Bytes copied per layer per micro-step (3 matrices, forward + backward) at Qwen3-30B-A3B, EP 8 (K = 16 owned +
J = 2 spare slots, 131,072 rows, bf16; ``benchmarks/slot_gemm_bytes.py --layer``): with 25% of the rows on the
spare slots, per-GEMM in place 629 MB (554 MB of it the spare rows' outputs), fused 210 MB (134 MB the spare
rows' final output, 75 MB the spare slots' weight rows and their gradients); with 10%, 297 MB -> 129 MB.
Saved for backward: x, a, b and h (``D + 3F`` per row; per GEMM autograd also kept ``silu(a)``: 1342 -> 1141 MB
held per layer, ``benchmarks/measure_saved_bytes.py``); backward recomputes ``silu(a)`` instead (one F-wide
elementwise write, 201 MB, counted apart as math).

The bank read in order (``InPlaceSplit.bank_in_order``: one spare slot with a replica, the default): the transfer
engine lays a bank row out w1 | w3 | w2 (``transfer/banks.py``), so the bank's w1 and w3 are one ``[B, 2F, D]``
view (``w13_view``, host metadata) and the spare part runs ONE GEMM ``x_s @ w13^T`` -> ``[P, 2F]`` (a, b its
halves, saved as views), backward ONE data gradient ``g_ab @ w13`` (the w1 and w3 data gradients' sum, no add)
and ONE weight gradient ``g_ab^T @ x_s`` -> ``[B, 2F, D]`` (w1's and w3's bank gradients its halves, as views),
``g_a`` and ``g_b`` written into one ``[P, 2F]`` buffer with ``out=``: 2 grouped GEMMs forward and 4 backward
instead of 3 and 6 (the owned part stays 3 / 6: torchtitan's w1, w3 are separate parameters). At Qwen3-30B-A3B
(D 2048, F 768, bf16) per layer and rank whose spare slot runs rows: 3 launches fewer per update micro-step
(1 forward, 2 backward; 1 in the recompute), 144 over 48 layers; per spare row 16 KiB less traffic (x_s read
once, not twice, forward and in the weight gradient: 2 x 4 KiB; one [P, D] data gradient and its copy into
``g_x`` instead of two and their add: 8 KiB); the same bytes saved for backward, the same weight bytes read, no
host sync. Separate w1 / w3 tensors (not so laid out): the three-GEMM spare part, as before.

Legend: R expert-sorted rows, D model dim, F expert hidden, C slots, K owned experts, J spare slots (C - K),
B bank rows, U owned rows read by spare slots (usually none), P a part's rows (owned or spare), 2F w1 and w3
stacked (``w13_B2FD``, ``ab_s`` / ``g_ab_P2F``: a, g_a the first F columns, b, g_b the last F).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .slot_gemm import SlotWeights, _spare_source

_gmm = torch._grouped_mm
_mm = torch.mm  # one bank row: a plain GEMM, which can write into a slice of its output (``out=``)


def _spare_rows(own_KYX, bank_BYX, owned_U, source_J, in_order=False):
    """The J spare slots' rows of one matrix (a J-row gather; never saved for backward); ``in_order`` (the spare
    slots read the bank's rows in order, all of them): the bank itself, no copy."""
    if in_order:
        return bank_BYX
    return _spare_source(own_KYX, bank_BYX, owned_U).index_select(0, source_J)


def _one_row_grads(g_ab_P2F, x_PD, g_PD, h_PF):
    """One bank row's weight gradients (w1, w2, w3) ``[1, F, D], [1, D, F], [1, F, D]``, written by two GEMMs
    straight into ONE ``[1, 3*F*D]`` row laid out w1 | w3 | w2 as the bank's (``transfer/banks.py``): the
    gradient return sends that row as it is (``banks.grad_rows``), no packing copy and no gather (at
    gpt-oss-20b's expert, 2 x 2 x 50 MB of traffic per layer and update micro-step on a rank whose spare slot ran
    rows; Qwen3-30B-A3B's 2 x 2 x 9.4 MB)."""
    F2, D, Fh = g_ab_P2F.shape[1], x_PD.shape[1], g_ab_P2F.shape[1] // 2
    row = x_PD.new_empty((1, F2 * D + D * Fh))
    _mm(g_ab_P2F.t(), x_PD, out=row[0, :F2 * D].view(F2, D))
    _mm(g_PD.t(), h_PF, out=row[0, F2 * D:].view(D, Fh))
    g13 = row[:, :F2 * D].view(1, F2, D)
    return g13[:, :Fh], row[:, F2 * D:].view(1, D, Fh), g13[:, Fh:]


def w13_view(w1_BFD: torch.Tensor, w3_BFD: torch.Tensor) -> torch.Tensor | None:
    """w1 and w3 as ONE ``[B, 2F, D]`` view when they lie so in memory (each row's w3 right after its w1: the
    transfer engine's banks, ``transfer/banks.py``, and autograd views of them), else None (e.g. separate
    tensors: the spare part then runs w1 and w3 apart). Host metadata only, no device work."""
    B, Fd, D = w1_BFD.shape
    if (w3_BFD.shape != w1_BFD.shape or w3_BFD.dtype != w1_BFD.dtype or w3_BFD.device != w1_BFD.device
            or w1_BFD.stride() != w3_BFD.stride() or w1_BFD.stride()[1:] != (D, 1)
            or (B > 1 and w1_BFD.stride(0) < 2 * Fd * D)
            or w3_BFD.storage_offset() != w1_BFD.storage_offset() + Fd * D
            or w1_BFD.untyped_storage().data_ptr() != w3_BFD.untyped_storage().data_ptr()):
        return None
    return w1_BFD.as_strided((B, 2 * Fd, D), (w1_BFD.stride(0), D, 1), w1_BFD.storage_offset())


class _InPlaceSlotSwiGLU(torch.autograd.Function):
    """``w2 (silu(w1 x) * w3 x)`` per slot group: owned rows against the owned shards in place, spare rows
    against their J gathered rows, joined through ``out=`` writes (see the module docstring)."""

    @staticmethod
    def forward(ctx, x_RD, offsets_C, n_own, n_spare, source_J, owned_U, in_order, bank_grads_ready,
                w1_KFD, w2_KDF, w3_KFD, w1_BFD, w2_BDF, w3_BFD):
        K, Fd, D = w1_KFD.shape
        R = n_own + n_spare
        offs_K, offs_J = offsets_C[:K], offsets_C[K:] - n_own
        h_RF = x_RD.new_empty((R, Fd))
        saved_ab = []  # a_o, b_o, a_s, b_s (a part with no rows: absent)
        if n_own:
            x_o = x_RD[:n_own]
            a_o = _gmm(x_o, w1_KFD.transpose(-2, -1), offs=offs_K)
            b_o = _gmm(x_o, w3_KFD.transpose(-2, -1), offs=offs_K)
            torch.mul(F.silu(a_o), b_o, out=h_RF[:n_own])
            saved_ab += [a_o, b_o]
        w13_B2FD = w13_view(w1_BFD, w3_BFD) if in_order and n_spare else None
        if n_spare:
            x_s = x_RD[n_own:]
            if w13_B2FD is not None:  # one GEMM: [P, 2F], a the first F columns, b the last F (views, saved so)
                ab_s = _gmm(x_s, w13_B2FD.transpose(-2, -1), offs=offs_J)
                a_s, b_s = ab_s[:, :Fd], ab_s[:, Fd:]
            else:
                a_s = _gmm(x_s, _spare_rows(w1_KFD, w1_BFD, owned_U, source_J, in_order).transpose(-2, -1),
                           offs=offs_J)
                b_s = _gmm(x_s, _spare_rows(w3_KFD, w3_BFD, owned_U, source_J, in_order).transpose(-2, -1),
                           offs=offs_J)
            torch.mul(F.silu(a_s), b_s, out=h_RF[n_own:])
            saved_ab += [a_s, b_s]
        if not R:
            y_RD = x_RD.new_empty((0, D))
        elif not n_spare:
            y_RD = _gmm(h_RF, w2_KDF.transpose(-2, -1), offs=offs_K)
        elif not n_own:
            y_RD = _gmm(h_RF, _spare_rows(w2_KDF, w2_BDF, owned_U, source_J, in_order).transpose(-2, -1), offs=offs_J)
        else:  # over all rows: the rows past n_own are left unwritten, then the spare rows' output (D wide)
            y_RD = _gmm(h_RF, w2_KDF.transpose(-2, -1), offs=offs_K)
            if in_order and w2_BDF.shape[0] == 1:  # one bank row: a plain GEMM writes its rows in place, no copy
                _mm(h_RF[n_own:], w2_BDF[0].t(), out=y_RD[n_own:])
            else:
                y_RD[n_own:] = _gmm(h_RF[n_own:], _spare_rows(w2_KDF, w2_BDF, owned_U, source_J,
                                                              in_order).transpose(-2, -1), offs=offs_J)
        ctx.sizes, ctx.in_order, ctx.fused13 = (n_own, n_spare), in_order, w13_B2FD is not None
        ctx.bank_grads_ready = bank_grads_ready
        ctx.save_for_backward(x_RD, h_RF, offsets_C, source_J, owned_U, w1_KFD, w2_KDF, w3_KFD,
                              w1_BFD, w2_BDF, w3_BFD, *saved_ab)
        return y_RD

    @staticmethod
    def backward(ctx, g_RD):
        x_RD, h_RF, offsets_C, source_J, owned_U, *w = ctx.saved_tensors
        own, bank, ab = w[:3], w[3:6], w[6:]
        n_own, n_spare = ctx.sizes
        in_order = ctx.in_order
        K = own[0].shape[0]
        R, D = x_RD.shape
        g_RD = g_RD.contiguous()
        need_x = ctx.needs_input_grad[0]
        need_w = any(ctx.needs_input_grad[8:14])  # the six weights (after x and seven host / index inputs)
        g_x_RD = x_RD.new_empty((R, D)) if need_x else None
        # owned weights' gradients straight from their GEMMs ([K, X, Y], empty groups zero); bank ones index_add-ed
        grad_own = [None if n_own or not need_w else torch.zeros_like(o) for o in own]
        U = 0 if owned_U is None else owned_U.shape[0]
        # no spare rows (host-known): the bank's gradient is None, not a zero-filled bank (ReplicaWeights then has
        # nothing to return either): such a rank pays the owned part alone, as torchtitan's path
        # bank rows in order: the spare part's weight gradient is the bank's as it comes (no zeros, no index_add)
        g_src = [b.new_zeros((U + b.shape[0], *b.shape[1:])) for b in bank] if need_w and n_spare and not in_order \
            else None
        grad_bank = [None] * 3
        parts = []  # the spare part first: its weight gradient (the bank's) goes back to the owners at once
        if n_spare:
            spare = [_spare_rows(o, b, owned_U, source_J, in_order) for o, b in zip(own, bank)]
            w13 = w13_view(bank[0], bank[2]) if ctx.fused13 else None
            parts.append((slice(n_own, R), offsets_C[K:] - n_own, spare, ab[-2:], False, w13))
        if n_own:
            parts.append((slice(0, n_own), offsets_C[:K], own, ab[:2], True, None))
        for rows, offs, (w1, w2, w3), (a_PF, b_PF), owned, w13_B2FD in parts:
            g_PD, x_PD, h_PF = g_RD[rows], x_RD[rows], h_RF[rows]
            # torch's formulas: grad_mat1 = grad @ mat2^T (mat2 = w^T); w^T's gradient as g^T @ input
            g_h_PF = _gmm(g_PD, w2, offs=offs)
            s_PF = F.silu(a_PF)
            # w1 and w3 as one [2F, D] matrix (the bank in order): g_a, g_b written into one [P, 2F] buffer
            g_ab_P2F = None if w13_B2FD is None else g_PD.new_empty((g_PD.shape[0], 2 * a_PF.shape[1]))
            g_a_PF, g_b_PF = (None, None) if g_ab_P2F is None else g_ab_P2F.tensor_split(2, dim=1)
            g_b_PF = torch.mul(g_h_PF, s_PF, out=g_b_PF)
            del s_PF
            g_h_PF.mul_(b_PF)
            if g_a_PF is None:
                g_a_PF = torch.ops.aten.silu_backward(g_h_PF, a_PF)
            else:
                torch.ops.aten.silu_backward.grad_input(g_h_PF, a_PF, grad_input=g_a_PF)
            del g_h_PF
            if need_x:
                if w13_B2FD is not None and w13_B2FD.shape[0] == 1:  # one GEMM, the w1 and w3 data gradients'
                    _mm(g_ab_P2F, w13_B2FD[0], out=g_x_RD[rows])  # sum, written in place (one bank row)
                elif w13_B2FD is not None:
                    g_x_RD[rows] = _gmm(g_ab_P2F, w13_B2FD, offs=offs)
                else:
                    torch.add(_gmm(g_a_PF, w1, offs=offs), _gmm(g_b_PF, w3, offs=offs), out=g_x_RD[rows])
            if need_w:
                if w13_B2FD is not None and w13_B2FD.shape[0] == 1 and x_PD.dtype == w13_B2FD.dtype:
                    gw = _one_row_grads(g_ab_P2F, x_PD, g_PD, h_PF)
                elif w13_B2FD is not None:  # one weight-gradient GEMM: [B, 2F, D], w1's rows then w3's
                    g13 = _gmm(g_ab_P2F.t(), x_PD, offs=offs)
                    gw = (g13[:, :a_PF.shape[1]], _gmm(g_PD.t(), h_PF, offs=offs), g13[:, a_PF.shape[1]:])
                else:
                    gw = (_gmm(g_a_PF.t(), x_PD, offs=offs), _gmm(g_PD.t(), h_PF, offs=offs),
                          _gmm(g_b_PF.t(), x_PD, offs=offs))
                if owned:
                    grad_own = [g.to(o.dtype) for g, o in zip(gw, own)]
                else:
                    if in_order:
                        grad_bank = [g.to(b.dtype) for g, b in zip(gw, bank)]
                    else:
                        for src, g in zip(g_src, gw):
                            src.index_add_(0, source_J, g.to(src.dtype))
                        grad_bank = [src[U:] for src in g_src]
                    if ctx.bank_grads_ready is not None:  # before the owned part's kernels are issued
                        ctx.bank_grads_ready(grad_bank)
        if g_src is not None and U:  # spare slots that read owned rows: their gradient back into the owned part's
            for go, src in zip(grad_own, g_src):
                go.index_add_(0, owned_U, src[:U].to(go.dtype))
        return (g_x_RD, None, None, None, None, None, None, None, *grad_own, *grad_bank)


def slot_swiglu(x_RD: torch.Tensor, w1: SlotWeights, w2: SlotWeights, w3: SlotWeights,
                offsets_C: torch.Tensor) -> torch.Tensor:
    """``w2 (silu(w1 x) * w3 x)`` per slot group over in-place slot weights sharing one ``split`` (the same
    ``InPlaceSplit`` object: the transfer engine builds one per layer). ``x_RD`` is in the weights' dtype and
    has exactly the slots' rows."""
    s = w1.split
    if s is None or w2.split is not s or w3.split is not s:
        raise ValueError("slot SwiGLU: w1, w2, w3 must share one in-place split (SlotWeights.split)")
    if x_RD.shape[0] != s.owned_rows + s.spare_rows:
        raise ValueError(f"slot SwiGLU: {x_RD.shape[0]} rows, the plan's slots receive {s.owned_rows} owned + "
                         f"{s.spare_rows} spare rows")
    in_order = s.bank_in_order and s.spare_owned_U is None and w1.bank_BXY.shape[0] == s.spare_source_J.shape[0]
    return _InPlaceSlotSwiGLU.apply(x_RD, offsets_C, s.owned_rows, s.spare_rows, s.spare_source_J,
                                    s.spare_owned_U, in_order, s.bank_grads_ready, w1.owned_KXY, w2.owned_KXY,
                                    w3.owned_KXY, w1.bank_BXY, w2.bank_BXY, w3.bank_BXY)


def fuses(w1, w2, w3) -> bool:
    """True when ``slot_swiglu`` applies: three in-place ``SlotWeights`` sharing one split."""
    return (isinstance(w1, SlotWeights) and w1.split is not None
            and isinstance(w2, SlotWeights) and isinstance(w3, SlotWeights)
            and w2.split is w1.split and w3.split is w1.split)
