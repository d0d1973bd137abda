"""The experts' SwiGLU over expert-sorted rows: ``torch._grouped_mm`` on owned experts or a placement's slots.

Kept apart from ``moe.py`` (torchtitan's modules) so that the kernels import without torchtitan: the GPU check
(``scripts/gpu_check.py``) runs them on machines where torchtitan does not import.

Legend: R expert-sorted rows, D model dim, E experts (groups), F expert hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .slot_gemm import SlotWeights, slot_grouped_mm
from .slot_swiglu import fuses, slot_swiglu


@torch.compiler.disable
def seam_call(fn, *args):
    """``fn(*args)`` eagerly: a graph break at a call into run-time placement (``models/seams.py``).

    Placement state (tables, transfers, timers) changes every micro-step; run outside the graph it is
    data, so a compiled block never recompiles for a new plan."""
    return fn(*args)


def _grouped_mm(x_RD: torch.Tensor, w, offsets_E: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x @ w_e^T`` per group; slot weights (a placement's) are never materialized for backward.

    The slot GEMM is a placement seam (eager): its in-place split is host ints of this micro-step's plan,
    which in a compiled graph would be guards (a recompile per plan)."""
    if isinstance(w, SlotWeights):
        return seam_call(slot_grouped_mm, x_RD, w, offsets_E)
    return torch._grouped_mm(x_RD, w.to(dtype).transpose(-2, -1), offs=offsets_E)


def no_rows(x_RD: torch.Tensor, *weights) -> torch.Tensor:
    """The ``[0, D]`` output of a rank that received no rows, without a zero-row ``torch._grouped_mm``: on CPU
    its backward raises (``Invalid strides/sizes, got [0, 0]``, torch 2.13) and CUDA's grouped GEMM is not
    promised to take an empty problem. The output still depends on x and on one element of every weight (times
    0), so backward gives them zero gradients and FSDP reduce-scatters them as on every other rank. A slot
    weight's bank is anchored too: its backward (``transfer/autograd.ReplicaWeights``) issues the layer's
    gradient-return all-to-all, which every rank of the EP group must join (without it the other ranks hang)."""
    parts = [t for w in weights for t in ((w,) if isinstance(w, torch.Tensor) else (w.owned_KXY, w.bank_BXY))]
    anchor = sum(t.reshape(-1)[:1].sum() for t in parts)
    return x_RD * 0 + anchor.to(x_RD.dtype) * 0


def grouped_swiglu(
    x_RD: torch.Tensor,
    w1_EFD: torch.Tensor | SlotWeights,
    w2_EDF: torch.Tensor | SlotWeights,
    w3_EFD: torch.Tensor | SlotWeights,
    num_tokens_per_expert_E: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """SwiGLU over expert-sorted rows: ``w2 (silu(w1 x) * w3 x)`` per expert group.

    ``torch._grouped_mm`` wants int32 offsets; rows past the last offset are
    left untouched, so callers pass exactly ``sum(num_tokens_per_expert_E)`` rows.
    Weights are tensors (owned experts) or ``SlotWeights`` (a placement's slots, already in ``dtype``); three
    in-place ``SlotWeights`` sharing one split run as one function (``slot_swiglu``: no per-GEMM join copy).
    """
    # a rank with no rows for any expert: no GEMM launched (``no_rows``). ``guard_or_false``: under compile the
    # rows are a data-dependent size, and a plain ``== 0`` there is a graph break inside torchtitan's
    # ``maybe_set_sparse_mesh`` context (new frames, and a recompile when step 2's plans arrive); there the
    # branch is not taken (the compiled graph runs the GEMM as it did before the guard)
    if guard_or_false(x_RD.shape[0] == 0):
        return no_rows(x_RD, w1_EFD, w2_EDF, w3_EFD)
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    x = x_RD.to(dtype)
    if fuses(w1_EFD, w2_EDF, w3_EFD):  # a placement seam (eager), as the per-GEMM slot path
        return seam_call(slot_swiglu, x, w1_EFD, w2_EDF, w3_EFD, offsets_E).type_as(x_RD)
    # both GEMMs before the gate: with slot weights (graph breaks) silu * mul stays one compiled fragment
    a_RF = _grouped_mm(x, w1_EFD, offsets_E, dtype)
    b_RF = _grouped_mm(x, w3_EFD, offsets_E, dtype)
    return _grouped_mm(F.silu(a_RF) * b_RF, w2_EDF, offsets_E, dtype).type_as(x_RD)
