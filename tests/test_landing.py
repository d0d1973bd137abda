"""The owners' landing of returned replica gradients off the compute stream (``transfer/landing.py``).

One process, one rank under the checked backend (CUDA's stream semantics on CPU, torch's sanitizer analysis):
a replica of owned expert 1 in bank row 0 runs rows; its gradient is returned (to this rank) and must be added
into expert 1's gradient. The landing starts on the engine's landing stream from the owned parameters'
post-accumulate-grad hooks, before the block's gate; the gate (``finish_gradients``) makes the compute stream
wait for it. Oracle: torch's autograd of the same SwiGLU with expert 1's weights read twice. The multi-rank path
(FSDP2 + EP, DTensor parameters) is ``test_ep_fsdp.py``'s (every return landed early, equal parameters).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titan_foremoe.distributed.checked import StreamError, checking
from titan_foremoe.models.grouped_swiglu import grouped_swiglu
from titan_foremoe.placement.tables import slot_split
from titan_foremoe.transfer.engine import TransferEngine
from titan_foremoe.transfer.schedule import Exchange, LayerTransfers

K, D, F = 2, 8, 4
COUNTS = [3, 2, 4]  # rows of owned expert 0, owned expert 1, the replica of expert 1 (bank row 0)


def _ex(send_row, recv_row) -> Exchange:
    n, m = len(send_row), len(recv_row)
    return Exchange(np.zeros(n, np.int64), np.asarray(send_row, np.int64), np.zeros(m, np.int64),
                    np.asarray(recv_row, np.int64))


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(K, *s, generator=g, device="cpu").requires_grad_(True) for s in ((F, D), (D, F), (F, D))]
    empty = _ex([], [])
    # the replica's gradient goes back to expert 1's owner (this rank, the one-rank exchange copies it)
    lt = LayerTransfers(direct=empty, host=empty, grad=_ex([0], [1]), keep_prev_row_U=np.zeros(0, np.int64),
                        keep_row_U=np.zeros(0, np.int64), send_inter_T=np.zeros(0, bool), stale=True)
    engine = TransferEngine(None, 0, 1, np.zeros(1, dtype=np.int64))
    engine.grad_sink = lambda layer: params
    lb = engine.banks(0, tuple(params), 1, torch.float32)
    with torch.no_grad():
        for b, p in zip(lb.banks[0], params):  # the replica holds expert 1's weights, as a transfer would
            b.copy_(p[1:2])
    x = torch.randn(sum(COUNTS), D, generator=g, device="cpu")
    dy = torch.randn(sum(COUNTS), D, generator=g, device="cpu")
    return engine, params, lt, x, dy


def _backward(engine, params, lt, x, dy, in_place: bool = True) -> None:
    """The layer's experts as the runtime runs them: the in-place split (the fused SwiGLU, whose backward issues
    the return before its owned part) or the gather path (``ReplicaWeights`` issues it)."""
    source = np.array([0, 1, K])
    split = slot_split(source, np.array([COUNTS]), K) if in_place else None
    ws = engine.slot_weights(0, tuple(params), source, lt, 0, torch.float32, split=split)
    grouped_swiglu(x, *ws, torch.tensor(COUNTS), torch.float32).backward(dy)


def _reference(params, x, dy) -> list[torch.Tensor]:
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    grouped_swiglu(x, *[torch.cat([w, w[1:2]]) for w in leaves], torch.tensor(COUNTS), torch.float32).backward(dy)
    return [w.grad for w in leaves]


@pytest.mark.parametrize("in_place", [True, False])
def test_landing_starts_before_the_gate_and_adds_the_returned_rows(in_place):
    """The return issued from the fused SwiGLU's backward (in place) or by ``ReplicaWeights`` (gather path),
    once either way; the landing started by the hooks; the values autograd's."""
    with checking():
        engine, params, lt, x, dy = _setup()
        _backward(engine, params, lt, x, dy, in_place)
        assert engine._grad_pending[0].landed is not None  # started on the landing stream by the hooks, gate not reached
        assert not engine._landing.watched  # fired and removed
        assert not engine._early  # ReplicaWeights took the flag and issued nothing more
        engine.finish_gradients(0)  # the block's gate: the compute stream waits for the landing's event
        got = [p.grad.clone() for p in params]
    assert engine.early_landings == engine.async_returns == 1
    assert engine.early_returns == int(in_place)
    for name, a, b in zip(("w1", "w2", "w3"), got, _reference(params, x, dy)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_the_return_is_issued_before_the_owned_part_of_the_backward(monkeypatch):
    """The fused SwiGLU's backward calls ``bank_grads_ready`` with the bank's gradient before any GEMM of the
    owned part: the return's all-to-all then travels while the owned part computes (the window the simulator
    grants it, ``simulator/timing._landing_exposed``)."""
    from titan_foremoe.models import slot_swiglu

    engine, params, lt, x, dy = _setup(3)
    events = []
    gmm, issue = slot_swiglu._gmm, engine.return_gradients_async

    def counting_gmm(a, b, *args, **kw):
        events.append(("gemm", a.shape[0]))
        return gmm(a, b, *args, **kw)

    def recording_issue(*args, **kw):
        events.append(("return", None))
        return issue(*args, **kw)

    monkeypatch.setattr(slot_swiglu, "_gmm", counting_gmm)
    monkeypatch.setattr(engine, "return_gradients_async", recording_issue)
    _backward(engine, params, lt, x, dy)
    assert events.count(("return", None)) == 1
    after = events[events.index(("return", None)) + 1:]
    assert ("gemm", sum(COUNTS[:2])) in after  # the owned part's data gradient (its rows) comes after the return
    engine.finish_gradients(0)


def test_reading_the_gradients_without_the_gates_wait_is_a_race():
    """The fault the gate prevents: FSDP's reduce-scatter (here a sum) reads the expert gradients on the compute
    stream while the landing stream still adds into them."""
    with checking():
        engine, params, lt, x, dy = _setup(1)
        _backward(engine, params, lt, x, dy)
        with pytest.raises(StreamError, match="unsynchronized"):
            params[1].grad.sum()


def test_no_autograd_no_watch_and_the_gate_lands_as_before():
    """Without grad (the recompute stage) nothing is watched; with sink tensors that cannot be watched (here:
    no grad required) the gate lands on the compute stream itself."""
    engine, params, lt, x, dy = _setup(2)
    with torch.no_grad():
        engine.slot_weights(0, tuple(params), np.array([0, 1, K]), lt, 0, torch.float32)
    assert not engine._landing.watched
    views = [torch.zeros_like(p) for p in params]  # require no grad: cannot be watched
    engine.grad_sink = lambda layer: views
    _backward(engine, params, lt, x, dy)
    assert engine._grad_pending[0].landed is None
    engine.finish_gradients(0)
    assert engine.early_landings == 0 and engine.async_returns == 1
    ref = _reference(params, x, dy)
    # the sink's gradients hold only the returned row, added into expert 1
    torch.testing.assert_close(views[0].grad[1], ref[0][1] - params[0].grad[1], rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_recompute_keeps_the_forwards_hooks():
    """torch's non-reentrant checkpoint around the layer (the recompute reads the same bank, ``wait=False``, as
    ``_Placement.for_recompute``): only the original graph runs backward, so the forward's hooks start the
    landing once; the recompute registers none of its own (they would stay on the parameters, which FSDP2 keeps
    from micro-step to micro-step, after the forward's fired). Values: autograd's."""
    from torch.utils.checkpoint import checkpoint

    with checking():
        engine, params, lt, x, dy = _setup(5)
        source = np.array([0, 1, K])
        split = slot_split(source, np.array([COUNTS]), K)
        before = [dict(p._post_accumulate_grad_hooks or {}) for p in params]
        forwards = []

        def layer(x_):
            ws = engine.slot_weights(0, tuple(params), source, lt, 0, torch.float32, wait=not forwards, split=split)
            forwards.append(len(engine._landing.watched))
            return grouped_swiglu(x_, *ws, torch.tensor(COUNTS), torch.float32)

        checkpoint(layer, x.clone().requires_grad_(True), use_reentrant=False).backward(dy)
        assert forwards == [1, 1]  # the forward and its recompute, one watch between them
        assert engine._grad_pending[0].landed is not None and not engine._early
        assert [dict(p._post_accumulate_grad_hooks or {}) for p in params] == before  # none left behind
        engine.finish_gradients(0)
        got = [p.grad.clone() for p in params]
    assert engine.early_landings == engine.early_returns == 1
    for a, b in zip(got, _reference(params, x, dy)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
