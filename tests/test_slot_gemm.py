"""Grouped GEMMs over owned and bank weights: the same values and gradients as torch's ``_grouped_mm`` over
the materialized slots, and no copy of the slot weights saved for backward (``benchmarks/measure_saved_bytes.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from titan_foremoe.models.moe import grouped_swiglu
from titan_foremoe.models.slot_gemm import SlotWeights

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from measure_saved_bytes import layer_saved_bytes  # noqa: E402


def test_slot_swiglu_matches_torch_on_the_materialized_slots():
    """Oracle: torch autograd through ``cat + index_select + _grouped_mm``; slots repeat rows, one is empty."""
    g = torch.Generator().manual_seed(0)
    K, B, F, D = 3, 2, 8, 12
    owned = [torch.randn(K, *s, generator=g, requires_grad=True) for s in ((F, D), (D, F), (F, D))]
    bank = [torch.randn(B, *s, generator=g, requires_grad=True) for s in ((F, D), (D, F), (F, D))]
    index_C = torch.tensor([0, 1, 2, 3, 4, 1, 0])  # owned, replicas, a second copy of owned 1, an empty slot
    counts_C = torch.tensor([3, 0, 5, 2, 4, 3, 0])
    x = torch.randn(int(counts_C.sum()), D, generator=g, requires_grad=True)
    dy = torch.randn(x.shape[0], D, generator=g)

    def grads(weights):
        y = grouped_swiglu(x, *weights, counts_C, torch.float32)
        return [y, *torch.autograd.grad(y, [x, *owned, *bank], dy)]

    ours = grads([SlotWeights(o, b, index_C) for o, b in zip(owned, bank)])
    ref = grads([SlotWeights(o, b, index_C).dense() for o, b in zip(owned, bank)])
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ours[3][1].abs().sum() > 0 and ours[-1].abs().sum() > 0  # owned row 1 and a bank row got gradients


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_slot_weight_copy_held_for_backward(dtype):
    """Beyond the parameters and the banks, static and foremoe save what torchtitan's path saves (the old
    ``cat(...).index_select`` saved C slots' copies); foremoe <= static + its replica rows."""
    kw = dict(K=4, spare=2, F=16, D=32, rows=64, dtype=dtype, device="cpu")
    off, static, foremoe = (layer_saved_bytes(b, **kw) for b in ("off", "static", "foremoe"))
    assert off["held"] > 0 and off["params"] > 0
    slot_meta = (4 + 2) * (8 + 4)  # per slot: its int64 index and int32 offset, nothing of its weights
    for r in (static, foremoe):
        assert off["held"] <= r["held"] <= off["held"] + slot_meta
    total = {n: r["held"] + r["params"] + r["banks"] for n, r in (("static", static), ("foremoe", foremoe))}
    assert total["foremoe"] <= total["static"] + foremoe["replica_rows_bytes"]
