"""Grouped GEMMs over owned and bank weights: the same values and gradients as torch's ``_grouped_mm`` over
the materialized slots, and no copy of the slot weights saved for backward (``benchmarks/measure_saved_bytes.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_foremoe.models.moe import grouped_swiglu
from titan_foremoe.models.slot_gemm import InPlaceSplit, SlotWeights, slot_grouped_mm
from titan_foremoe.placement.tables import slot_split

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from measure_saved_bytes import layer_saved_bytes  # noqa: E402
from slot_gemm_bytes import slot_gemm_bytes  # noqa: E402


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
        # the in-place path gives the bank no gradient when no row runs on a spare slot: zeros, as the oracle's
        return [y, *torch.autograd.grad(y, [x, *owned, *bank], dy, allow_unused=True, materialize_grads=True)]

    ours = grads([SlotWeights(o, b, index_C) for o, b in zip(owned, bank)])
    ref = grads([SlotWeights(o, b, index_C).dense() for o, b in zip(owned, bank)])
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ours[3][1].abs().sum() > 0 and ours[-1].abs().sum() > 0  # owned row 1 and a bank row got gradients


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_slot_weight_copy_held_for_backward(dtype):
    """Beyond the parameters and the banks, static and foremoe save what torchtitan's path saves but
    ``silu(a)`` (the fused slot SwiGLU recomputes it; the old ``cat(...).index_select`` saved C slots'
    copies); foremoe <= static + its replica rows."""
    kw = dict(K=4, spare=2, F=16, D=32, rows=64, dtype=dtype, device="cpu")
    off, static, foremoe = (layer_saved_bytes(b, **kw) for b in ("off", "static", "foremoe"))
    assert off["held"] > 0 and off["params"] > 0
    slot_meta = (4 + 2) * (8 + 4)  # per slot: its int64 index and int32 offset, nothing of its weights
    silu_a = 64 * 16 * torch.empty(0, dtype=dtype).element_size()
    for r in (static, foremoe):
        assert off["held"] - silu_a <= r["held"] <= off["held"] - silu_a + slot_meta
    total = {n: r["held"] + r["params"] + r["banks"] for n, r in (("static", static), ("foremoe", foremoe))}
    assert total["foremoe"] <= total["static"] + foremoe["replica_rows_bytes"]


def _in_place(slot_source_C: list[int], counts_C: list[int], K: int, bank_rows: int = 2) -> InPlaceSplit | None:
    """The runtime's split (``placement.tables.slot_split``) from host tables, on the CPU, with the transfer engine's
    rule for reading the bank as it is (``bank_in_order``: spare slot s reads bank row s, every row)."""
    recv_SC = np.array([counts_C, [0] * len(counts_C)])  # two sources, everything from the first
    s = slot_split(np.array(slot_source_C), recv_SC, K)
    if s is None:
        return None
    J = len(s.spare_source_J)
    in_order = not len(s.spare_owned_U) and J == bank_rows and np.array_equal(s.spare_source_J, np.arange(J))
    return InPlaceSplit(s.owned_rows, s.spare_rows, torch.as_tensor(s.spare_source_J),
                        torch.as_tensor(s.spare_owned_U) if len(s.spare_owned_U) else None, bool(in_order))


IN_PLACE_CASES = {  # K = 3 owned slots, 3 spare; -1 an empty slot
    "mixed": ([0, 1, 2, 4, -1, 3], [3, 0, 5, 2, 0, 4]),  # an empty owned group, an empty spare slot
    "replica of an owned expert": ([0, -1, 2, 3, 1, 0], [2, 0, 1, 3, 4, 2]),  # spare slots read owned rows 1, 0
    "no owned rows": ([0, 1, 2, 3, 4, -1], [0, 0, 0, 3, 2, 0]),
    "no spare rows": ([0, 1, 2, 3, 4, -1], [4, 1, 3, 0, 0, 0]),
    "no rows": ([0, 1, 2, -1, -1, -1], [0, 0, 0, 0, 0, 0]),
    "bank in order": ([0, 1, 2, 3, 4, 5], [3, 0, 5, 2, 1, 4]),  # spare slot s reads bank row s: no gather
}


@pytest.mark.parametrize("case", list(IN_PLACE_CASES))
def test_in_place_slot_gemm_matches_torch_and_the_gather_path(case):
    """Oracle: ``torch._grouped_mm`` over the dense ``[C, X, Y]`` slots (torch autograd through ``cat +
    index_select``): values, grad x, grad owned, grad bank; the gather path and the per-GEMM in-place path
    (``slot_grouped_mm`` three times, torch's silu * mul between) give the same as the fused SwiGLU."""
    slot_source_C, counts = IN_PLACE_CASES[case]
    K, F, D = 3, 8, 12
    B = max(2, max(slot_source_C) - K + 1)
    g = torch.Generator().manual_seed(1)
    owned = [torch.randn(K, *s, generator=g, requires_grad=True) for s in ((F, D), (D, F), (F, D))]
    bank = [torch.randn(B, *s, generator=g, requires_grad=True) for s in ((F, D), (D, F), (F, D))]
    index_C = torch.tensor(slot_source_C).clip(0)
    counts_C = torch.tensor(counts)
    x = torch.randn(int(counts_C.sum()), D, generator=g, requires_grad=True)
    dy = torch.randn(x.shape[0], D, generator=g)
    split = _in_place(slot_source_C, counts, K, B)
    assert split is not None and split.bank_in_order == (case == "bank in order")

    def grads(y):
        if not y.numel():
            return [y]
        # the in-place path gives the bank no gradient when no row runs on a spare slot: zeros, as the oracle's
        return [y, *torch.autograd.grad(y, [x, *owned, *bank], dy, allow_unused=True, materialize_grads=True)]

    def swiglu(weights):
        return grads(grouped_swiglu(x, *weights, counts_C, torch.float32))

    def per_gemm(w1, w2, w3):
        offs = torch.cumsum(counts_C, 0, dtype=torch.int32)
        h = torch.nn.functional.silu(slot_grouped_mm(x, w1, offs)) * slot_grouped_mm(x, w3, offs)
        return grads(slot_grouped_mm(h, w2, offs))

    in_place = [SlotWeights(o, b, index_C, split) for o, b in zip(owned, bank)]
    y = grouped_swiglu(x, *in_place, counts_C, torch.float32)
    assert not y.numel() or type(y.grad_fn).__name__ == "_InPlaceSlotSwiGLUBackward"  # the fused function ran
    ours = swiglu(in_place)
    ref = swiglu([SlotWeights(o, b, index_C).dense() for o, b in zip(owned, bank)])
    gather = swiglu([SlotWeights(o, b, index_C) for o, b in zip(owned, bank)])
    unfused = per_gemm(*in_place)
    assert len(ours) == len(ref) == len(unfused)
    if y.numel() and not split.spare_rows:  # nothing ran on a spare slot: no bank-sized zeros are written
        y = grouped_swiglu(x, *in_place, counts_C, torch.float32)
        assert all(g is None for g in torch.autograd.grad(y, bank, dy, allow_unused=True))
    for a, b, c, d in zip(ours, ref, gather, unfused):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, d, rtol=1e-5, atol=1e-5)


def test_in_place_split_falls_back_when_an_owned_slot_holds_another_row():
    """EPLB-style plans put any expert in any slot: the owned slots cannot be read in place, the GEMM gathers."""
    counts = [1, 2, 3, 4]
    assert _in_place([0, 1, 2, 3], counts, 2) is not None
    assert _in_place([0, -1, 3, 2], counts, 2) is not None  # an empty owned slot; bank rows in either order
    assert _in_place([1, 0, 2, 3], counts, 2) is None  # owned experts swapped
    assert _in_place([0, 2, 3, -1], counts, 2) is None  # a bank row in an owned slot


def test_in_place_copies_only_the_spare_slots_weights():
    """Weight-shaped bytes copied per call (``benchmarks/slot_gemm_bytes.py``): the gather path copies all
    C slots (and more), the in-place path only the spare slots' bank rows (forward) and their gradient rows."""
    kw = dict(K=16, spare=2, F=16, D=32, rows=256, dtype=torch.float32, device="cpu")
    gather, in_place = slot_gemm_bytes(**kw, in_place=False), slot_gemm_bytes(**kw, in_place=True)
    m = gather["matrix_bytes"]
    assert gather["forward"] >= 18 * m and in_place["forward"] == 2 * m
    assert in_place["backward"] <= 3 * 2 * m < gather["backward"]


def _plain_swiglu(x, w1_C, w2_C, w3_C, counts):
    """Oracle: plain matmuls per slot group (torch's own autograd), no grouped GEMM."""
    ys, start = [], 0
    for c, n in enumerate(counts):
        xs = x[start:start + n]
        ys.append((torch.nn.functional.silu(xs @ w1_C[c].T) * (xs @ w3_C[c].T)) @ w2_C[c].T)
        start += n
    return torch.cat(ys)


@pytest.mark.parametrize("bank_rows", [1, 3])
def test_bank_in_order_runs_w1_and_w3_as_one_gemm(bank_rows, monkeypatch):
    """The banks' rows are laid out w1 | w3 | w2 (``transfer/banks.py``), so with the bank read in order the spare
    part reads w1 and w3 as ONE ``[B, 2F, D]`` matrix: 2 grouped GEMMs forward (w13, w2) and 4 backward (w2's and
    w13's data and weight gradients) instead of 3 and 6 (with one bank row the w2 forward and the w13 data gradient
    are plain GEMMs writing their rows in place). Values and every gradient (x, owned, the bank rows'
    w1 / w2 / w3 through the packing) against plain per-group matmuls under torch's autograd."""
    from titan_foremoe.models import slot_swiglu as mod
    from titan_foremoe.transfer.banks import pack_rows, unpack_rows

    K, F, D = 3, 8, 12
    g = torch.Generator().manual_seed(2)
    shapes = ((F, D), (D, F), (F, D))
    owned = [torch.randn(K, *s, generator=g, requires_grad=True) for s in shapes]
    bank = [torch.randn(bank_rows, *s, generator=g, requires_grad=True) for s in shapes]
    slot_source_C = list(range(K + bank_rows))
    counts = [3, 0, 5, *[2 * j + 1 for j in range(bank_rows)]]
    counts_C = torch.tensor(counts)
    x = torch.randn(sum(counts), D, generator=g, requires_grad=True)
    dy = torch.randn(x.shape[0], D, generator=g)
    split = _in_place(slot_source_C, counts, K, bank_rows)
    assert split.bank_in_order
    views = unpack_rows(pack_rows(*bank), shapes)  # the bank as the engine holds it (differentiable here)
    assert mod.w13_view(views[0], views[2]) is not None and mod.w13_view(bank[0], bank[2]) is None
    for b, v in zip(bank, views):
        assert torch.equal(b, v)

    calls = []

    def counting(*a, **kw):
        calls.append(tuple(a[1].shape))
        return torch._grouped_mm(*a, **kw)

    def counting_mm(*a, **kw):  # one bank row: the spare part's GEMMs that write in place (out=)
        calls.append(tuple(a[1].shape))
        return torch.mm(*a, **kw)

    monkeypatch.setattr(mod, "_gmm", counting)
    monkeypatch.setattr(mod, "_mm", counting_mm)

    def run(bank_views):
        calls.clear()
        y = grouped_swiglu(x, *[SlotWeights(o, b, torch.tensor(slot_source_C), split)
                                for o, b in zip(owned, bank_views)], counts_C, torch.float32)
        n_fwd = len(calls)
        out = [y, *torch.autograd.grad(y, [x, *owned, *bank], dy)]
        return out, n_fwd, len(calls) - n_fwd

    fused, fwd, bwd = run(views)
    assert (fwd, bwd) == (3 + 2, 6 + 4)  # owned part 3 / 6, spare part 2 / 4
    assert (bank_rows, D, 2 * F) in calls  # the w13 GEMM (forward: x @ w13^T)
    apart, fwd_apart, bwd_apart = run(bank)  # separate tensors: w1 and w3 apart
    assert (fwd_apart, bwd_apart) == (3 + 3, 6 + 6)
    dense = [torch.cat([o, b]) for o, b in zip(owned, bank)]
    y_ref = _plain_swiglu(x, *dense, counts)
    ref = [y_ref, *torch.autograd.grad(y_ref, [x, *owned, *bank], dy)]
    for name, a, b, c in zip(["y", "x", "w1", "w2", "w3", "bank w1", "bank w2", "bank w3"], fused, apart, ref):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} (apart): {m}")
    assert all(fused[i].abs().sum() > 0 for i in (5, 6, 7))


@pytest.mark.parametrize("bank_rows", [1, 2])
def test_one_bank_row_returns_its_gradient_without_a_copy(bank_rows):
    """Through the runtime's path (packed bank -> ``unpack_rows`` views -> ``ReplicaWeights`` -> the fused SwiGLU),
    the gradients the return receives: with one bank row (one spare slot, the default) they ARE one packed
    ``[1, 3*F*D]`` row laid out as the bank's, so ``grad_rows`` sends it as it is (same storage: no pack, no
    gather); with two rows they are packed by a copy. Values against plain matmuls under torch's autograd either
    way, and the packed row unpacks to the bank's three gradients."""
    from types import SimpleNamespace

    from titan_foremoe.transfer.autograd import ReplicaWeights
    from titan_foremoe.transfer.banks import grad_rows, pack_rows, packed_view, unpack_rows

    K, F, D = 2, 8, 12
    g = torch.Generator().manual_seed(5)
    shapes = ((F, D), (D, F), (F, D))
    owned = [torch.randn(K, *s, generator=g) for s in shapes]
    bank = [torch.randn(bank_rows, *s, generator=g) for s in shapes]
    counts = [3, 4, *[2 * j + 3 for j in range(bank_rows)]]
    split = _in_place(list(range(K + bank_rows)), counts, K, bank_rows)
    assert split.bank_in_order
    x = torch.randn(sum(counts), D, generator=g)
    dy = torch.randn(x.shape[0], D, generator=g)
    packed = pack_rows(*bank).requires_grad_(True)  # the engine's bank: one packed tensor, views of it
    got = {}

    class Engine:  # the transfer engine's side of ReplicaWeights: the async return records what it would send
        grad_sink = object()

        def returned_early(self, layer):  # no InPlaceSplit.bank_grads_ready here: ReplicaWeights issues it
            return False

        def return_gradients_async(self, layer, ex, grads, owned_rows):
            got["grads"] = grads
            got["send"] = grad_rows(*grads, ex.send_row_T, lambda: torch.as_tensor(ex.send_row_T))

    ex = SimpleNamespace(send_row_T=np.arange(bank_rows))
    views = unpack_rows(packed, shapes)
    assert packed_view(*views).data_ptr() == packed.data_ptr()  # the bank's own views are its rows
    reps = ReplicaWeights.apply(Engine(), 0, ex, *owned, *views)
    y = grouped_swiglu(x, *[SlotWeights(o, b, torch.arange(K + bank_rows), split) for o, b in zip(owned, reps)],
                       torch.tensor(counts), torch.float32)
    y.backward(dy)
    grads, send = got["grads"], got["send"]
    zero_copy = packed_view(*grads) is not None and send.data_ptr() == grads[0].data_ptr()
    assert zero_copy == (bank_rows == 1)
    bank_ref = [b.clone().requires_grad_(True) for b in bank]
    y_ref = _plain_swiglu(x, *[torch.cat([o, b]) for o, b in zip(owned, bank_ref)], counts)
    ref = torch.autograd.grad(y_ref, bank_ref, dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert tuple(send.shape) == (bank_rows, 3 * F * D)
    for name, a, b in zip(["w1", "w2", "w3"], unpack_rows(send, shapes), ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"bank {name}: {m}")
    gathered = grad_rows(*grads, np.array([bank_rows - 1]), lambda: torch.tensor([bank_rows - 1]))
    torch.testing.assert_close(unpack_rows(gathered, shapes)[1], ref[1][-1:], rtol=1e-5, atol=1e-5)
