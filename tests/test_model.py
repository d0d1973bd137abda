"""Model shapes, the router-replay seam, and the grouped expert math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titan_foremoe.config import load_config
from titan_foremoe.config.validate import model_args
from titan_foremoe.distributed.parallelize import build_model
from titan_foremoe.models.flavors import FLAVORS, get_flavor
from titan_foremoe.models.moe import ReplayRouter, grouped_swiglu


def _model(**overrides):
    cfg = load_config(None, ["--model.expert_dtype=float32", *[f"--model.{k}={v}" for k, v in overrides.items()]])
    torch.manual_seed(0)
    return build_model(cfg, model_args(cfg, vocab_size=64), None, torch.device("cpu")), cfg


def _routers(model):
    return [m for m in model.modules() if isinstance(m, ReplayRouter)]


def test_flavors_carry_the_named_shapes():
    tiny = FLAVORS["debug_tiny"]
    assert tiny.num_experts >= 8 and tiny.top_k >= 2 and tiny.num_experts % 4 == 0
    q = FLAVORS["qwen3_30b_a3b"]
    assert (q.n_layers, q.num_experts, q.top_k) == (48, 128, 8)
    g = FLAVORS["gpt_oss_20b"]
    assert (g.n_layers, g.num_experts, g.top_k) == (24, 32, 4)
    with pytest.raises(ValueError, match="unknown model flavor"):
        get_flavor("llama")


def test_forward_backward_shapes():
    model, _ = _model()
    tokens = torch.randint(0, 64, (3, 11))
    logits = model(tokens)
    assert logits.shape == (3, 11, 64)
    logits.float().logsumexp(-1).mean().backward()
    experts = model.layers["0"].moe.routed_experts.inner_experts
    assert experts.w1_EFD.grad.shape == (8, 64, 64) and experts.w2_EDF.grad.shape == (8, 64, 64)
    assert all(p.grad is not None for p in model.parameters())


def test_shared_expert_is_optional():
    model, _ = _model(shared_expert_hidden_dim=32)
    assert model.layers["0"].moe.shared_experts is not None
    assert model(torch.randint(0, 64, (1, 5))).shape == (1, 5, 64)


def test_replaying_the_live_routes_changes_nothing():
    model, _ = _model()
    tokens = torch.randint(0, 64, (2, 9))
    routers = _routers(model)
    for r in routers:
        r.record = True
    live = model(tokens)
    recorded = [r.recorded_expert_ids_BLK.clone() for r in routers]
    assert all(ids.shape == (2, 9, 2) for ids in recorded)
    for r, ids in zip(routers, recorded):
        r.logged_expert_ids_BLK = ids
    replayed = model(tokens)
    torch.testing.assert_close(replayed, live, rtol=0, atol=1e-6)
    assert sum(r.mismatch_count for r in routers) == 0
    assert sum(r.replayed_count for r in routers) == 4 * 18


def test_replayed_routes_are_used_and_gate_stays_differentiable():
    model, _ = _model()
    tokens = torch.randint(0, 64, (2, 9))
    router = _routers(model)[0]
    forced = torch.zeros(2, 9, 2, dtype=torch.int64)
    forced[..., 1] = 7  # every token to experts 0 and 7
    router.logged_expert_ids_BLK = forced
    router.record = True
    out = model(tokens)
    assert torch.equal(router.recorded_expert_ids_BLK, forced)
    assert router.mismatch_count > 0
    assert model.layers["0"].moe.tokens_per_expert_E[[0, 7]].sum() == 2 * 9 * 2
    out.float().pow(2).mean().backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0
    router.logged_expert_ids_BLK = torch.zeros(2, 9, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="logged expert ids have shape"):
        model(tokens)


def test_grouped_swiglu_matches_a_loop_over_experts():
    torch.manual_seed(0)
    E, D, F_, counts = 4, 8, 16, torch.tensor([3, 0, 5, 2])
    w1, w3 = torch.randn(E, F_, D), torch.randn(E, F_, D)
    w2 = torch.randn(E, D, F_)
    x = torch.randn(int(counts.sum()), D)
    out = grouped_swiglu(x, w1, w2, w3, counts, torch.float32)
    ref, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start : start + n]
        ref.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        start += n
    torch.testing.assert_close(out, torch.cat(ref), rtol=1e-5, atol=1e-5)
