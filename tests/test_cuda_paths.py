"""What only CUDA would show, checked on CPU (issue 38): the router gates in fp32 by one explicit path on every
device, whatever the parameters' dtype (FSDP2 mixed precision) or an outer autocast; device index caches keyed
by a live host array, never by a reusable ``id()``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from titan_foremoe.models import moe as moe_mod
from titan_foremoe.models.build import Linear, _LINEAR_INIT
from titan_foremoe.models.moe import ReplayRouter

E, K, D = 16, 4, 64


def _router(score_func: str = "softmax") -> ReplayRouter:
    torch.manual_seed(0)
    r = ReplayRouter(ReplayRouter.Config(num_experts=E, top_k=K, score_func=score_func, route_norm=False,
                                         gate=Linear.Config(in_features=D, out_features=E, param_init=_LINEAR_INIT)))
    with torch.no_grad():
        r.gate.weight.normal_()
    return r


def _reference(x_BLD: torch.Tensor, w_ED: torch.Tensor, score_func: str):
    """Independent fp32 reference from the bf16 values the router sees: float64 matmul, rounded to fp32."""
    logits = (x_BLD.double() @ w_ED.double().T).float()
    scores = torch.sigmoid(logits) if score_func == "sigmoid" else F.softmax(logits, dim=-1)
    return scores, scores.topk(K, dim=-1).indices.sort(-1).values


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_gate_is_fp32_with_bf16_params_under_bf16_autocast(score_func):
    """bf16 parameters and input, inside a bf16 autocast (what a GPU job could wrap it in): the gate still
    computes in fp32, equal to an fp32 reference; a bf16 gate (what the removed CUDA branch risked) is not."""
    r = _router(score_func).to(torch.bfloat16)
    x = torch.randn(3, 50, D).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        top_BLK, ids_BLK, scores_BLE = r(x)
    assert scores_BLE.dtype == torch.float32
    ref_scores, ref_ids = _reference(x.float(), r.gate.weight.float(), score_func)
    torch.testing.assert_close(scores_BLE, ref_scores, rtol=1e-5, atol=1e-6)
    assert torch.equal(ids_BLK.sort(-1).values, ref_ids)
    bf16 = F.linear(x, r.gate.weight).float()  # the same gate in bf16: routes differ somewhere
    bf16 = torch.sigmoid(bf16) if score_func == "sigmoid" else F.softmax(bf16, -1)
    assert (bf16 - ref_scores).abs().max() > 1e-4


def test_gate_weight_under_fsdp2_mixed_precision(monkeypatch):
    """FSDP2 with ``param_dtype=bf16`` (``mixed_precision_param = "bfloat16"``) hands the router a bf16 gate
    weight in forward; the one gating path casts it up: fp32 scores equal to the reference, and the gradient
    reaches the sharded fp32 parameter."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    seen = []

    def spy(gate, x):
        seen.append((gate.weight.dtype, x.dtype))
        out = gate_fp32(gate, x)
        seen.append(out.dtype)
        return out

    gate_fp32 = moe_mod.gate_fp32
    monkeypatch.setattr(moe_mod, "gate_fp32", spy)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        r = _router()
        full_w = r.gate.weight.detach().clone()
        fully_shard(r, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        x = torch.randn(2, 40, D)
        _, ids_BLK, scores_BLE = r(x)
        assert seen == [(torch.bfloat16, torch.bfloat16), torch.float32]
        ref_scores, ref_ids = _reference(x.to(torch.bfloat16).float(), full_w.to(torch.bfloat16).float(), "softmax")
        torch.testing.assert_close(scores_BLE, ref_scores, rtol=1e-5, atol=1e-6)
        assert torch.equal(ids_BLK.sort(-1).values, ref_ids)
        scores_BLE.square().sum().backward()
        g = r.gate.weight.grad
        assert g is not None and g.dtype == torch.float32 and g.full_tensor().abs().sum() > 0
    finally:
        dist.destroy_process_group()


def test_one_gating_path():
    """No device branch: the router's forward has no autocast of its own (the module's one use is the
    ``enabled=False`` guard in ``gate_fp32``)."""
    import inspect

    src = inspect.getsource(moe_mod)
    assert src.count("torch.autocast(") == 1 and "enabled=False" in inspect.getsource(moe_mod.gate_fp32)
    assert "device.type ==" not in inspect.getsource(ReplayRouter.forward)


def _dispatch(seed: int):
    from titan_foremoe.placement.tables import LayerDispatch

    rng = np.random.default_rng(seed)
    return LayerDispatch(tokens_E=rng.integers(0, 100, 8), seg_end_Q=np.cumsum(rng.integers(1, 9, 6)),
                         seg_rank_Q=rng.integers(0, 2, 6), seg_slot_Q=rng.integers(0, 5, 6),
                         recv_SC=rng.integers(0, 9, (2, 5)), slot_expert_C=np.arange(5))


def test_index_cache_survives_reused_ids():
    """A stage's uploaded indices are looked up by their host array: after the tables that filled the cache
    are dropped, new tables (which CPython may give the freed arrays' ids) get their own indices, never the
    old ones (``id()`` keys returned another table's indices without an error)."""
    from titan_foremoe.placement.tables import dispatch_arrays
    from titan_foremoe.transfer.engine import TransferEngine

    engine = TransferEngine(None, 0, 1, np.zeros(1, dtype=np.int64))
    cpu = torch.device("cpu")
    for trial in range(50):
        d = _dispatch(trial)
        engine.stage_indices = {k: torch.as_tensor(v).clone() for k, v in dispatch_arrays(d).items()}
        assert torch.equal(engine._index(d.tokens_E, cpu), torch.as_tensor(d.tokens_E))
        del d  # the runtime's tables go; the cache stays until the stage ends
        new = _dispatch(1000 + trial)
        for name in ("tokens_E", "seg_end_Q", "seg_rank_Q", "seg_slot_Q"):
            host = getattr(new, name)
            assert torch.equal(engine._index(host, cpu), torch.as_tensor(host)), (trial, name)
        got = engine._index(new.recv_SC, cpu, "flat", lambda: new.recv_SC.reshape(-1))
        assert torch.equal(got, torch.as_tensor(new.recv_SC.reshape(-1)))


def test_host_key_is_identity():
    from titan_foremoe.transfer.host_key import HostKey

    a = np.arange(4)
    b = a.copy()
    assert HostKey(a) == HostKey(a) and HostKey(a) != HostKey(b) and HostKey(a, "flat") != HostKey(a)
    assert {HostKey(a): 1}.get(HostKey(a, "")) == 1 and {HostKey(a): 1}.get(HostKey(b)) is None
