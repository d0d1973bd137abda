"""A rank that receives no rows for any expert: no zero-row ``torch._grouped_mm``, zero gradients, no error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titan_foremoe.models import grouped_swiglu as gs
from titan_foremoe.models.slot_gemm import InPlaceSplit, SlotWeights
from titan_foremoe.placement.tables import slot_split

E, D, F = 4, 16, 8


def _weights(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in ((E, F, D), (E, D, F), (E, F, D))]


def test_torchs_zero_row_grouped_mm_backward_fails_on_cpu():
    """Why the guard exists (if torch ever accepts it, the guard is still free)."""
    w1 = torch.randn(E, F, D, requires_grad=True)
    x = torch.zeros(0, D, requires_grad=True)
    y = torch._grouped_mm(x, w1.transpose(-2, -1), offs=torch.zeros(E, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="Invalid strides/sizes"):
        y.sum().backward()


@pytest.mark.parametrize("path", ["dense", "inplace", "gather"])
def test_no_rows_gives_an_empty_output_and_zero_gradients_without_a_grouped_gemm(monkeypatch, path):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    dtype = torch.bfloat16
    ws = _weights(dtype)
    counts = torch.zeros(E, dtype=torch.int64)
    if path == "dense":
        weights = ws
    else:
        bank = [torch.zeros(1, *w.shape[1:], dtype=dtype, requires_grad=True) for w in ws]
        src = np.array([0, 1, 2, 3, 0])
        sp = slot_split(src, np.zeros((1, 5), dtype=np.int64), E)
        split = InPlaceSplit(sp.owned_rows, sp.spare_rows, torch.as_tensor(sp.spare_source_J)) if path == "inplace" \
            else None
        weights = [SlotWeights(w, b, torch.as_tensor(src), split) for w, b in zip(ws, bank)]
        counts = torch.zeros(5, dtype=torch.int64)
    x = torch.zeros(0, D, dtype=torch.float32, requires_grad=True)
    y = gs.grouped_swiglu(x, *weights, counts, dtype)
    assert y.shape == (0, D) and y.dtype == x.dtype
    y.sum().backward()
    assert calls == []
    assert x.grad.shape == (0, D)
    for w in ws:
        assert w.grad is not None and w.grad.abs().sum() == 0  # FSDP reduce-scatters a zero gradient
    if path != "dense":  # the bank's backward (ReplicaWeights) issues the EP group's gradient return: it must run
        for b in bank:
            assert b.grad is not None and b.grad.abs().sum() == 0


def test_rows_still_take_the_grouped_gemm():
    ws = _weights(torch.float32)
    x = torch.randn(6, D)
    y = gs.grouped_swiglu(x, *ws, torch.tensor([3, 0, 2, 1]), torch.float32)
    want = torch.cat([torch.nn.functional.silu(xe @ ws[0][e].T) * (xe @ ws[2][e].T) @ ws[1][e].T
                      for e, xe in zip(range(E), x.split([3, 0, 2, 1]))])
    torch.testing.assert_close(y, want)
