"""Rollout decode without host syncs: the fixed-capacity dispatch equals the exact one (1 rank and EP 2),
one sync per decoded token for the whole model, and prefill logits at the last position only."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distributed_helpers import run_ranks
from titan_foremoe.config import load_config
from titan_foremoe.config.validate import model_args
from titan_foremoe.distributed.parallelize import build_model
from titan_foremoe.models.seams import moe_layers
from titan_foremoe.rollouts.generate import GenerationConfig, generate
from titan_foremoe.rollouts.generate import last_position_logits

PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 3, 4, 5, 6, 7], [1, 2]]
aten = torch.ops.aten
_ALWAYS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
           aten.equal.default, aten.bincount.default, aten._unique2.default, aten.unique_consecutive.default,
           aten.unique_dim.default}


class SyncCount(TorchDispatchMode):
    """Ops that make the host wait for the device on CUDA (shape from data, or a value read)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALWAYS:
            self.n += 1
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            self.n += any(i is not None and i.dtype == torch.bool for i in args[1])
        elif func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
            self.n += kwargs.get("output_size") is None
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def model():
    cfg = load_config(None, ["--model.expert_dtype=float32"])
    torch.manual_seed(0)
    return build_model(cfg, model_args(cfg, vocab_size=64), None, torch.device("cpu"))


def _generate(model, prompts=PROMPTS, seed=0, eos_id=2, max_new_tokens=6, **kw):
    return generate(model, prompts, GenerationConfig(max_new_tokens=max_new_tokens), eos_id=eos_id, pad_id=0,
                    num_experts=8, generator=torch.Generator().manual_seed(seed), **kw)


def _assert_same(a, b):
    assert torch.equal(a.tokens_BT, b.tokens_BT)
    assert torch.equal(a.lengths_B, b.lengths_B) and torch.equal(a.finished_B, b.finished_B)
    assert torch.equal(a.routes.experts_BTXK, b.routes.experts_BTXK)
    torch.testing.assert_close(a.logprobs_BT, b.logprobs_BT, rtol=1e-5, atol=1e-5)


def test_padded_decode_equals_exact_dispatch(model):
    mixed = 0
    for seed in range(3):  # ten EOS ids: rows finish at different steps and decode on masked
        a, b = (_generate(model, seed=seed, eos_id=list(range(2, 12)), **kw) for kw in ({}, {"padded_dispatch": False}))
        _assert_same(a, b)
        mixed += bool(a.finished_B.any() and len(set(a.lengths_B.tolist())) > 1)
    assert mixed


def _syncs_per_token(model, **kw) -> float:
    counts = []
    for n in (3, 7):
        with SyncCount() as c:  # eos -1 is never sampled: every row decodes n tokens
            _generate(model, eos_id=-1, max_new_tokens=n, **kw)
        counts.append(c.n)
    return (counts[1] - counts[0]) / 4


def test_one_host_sync_per_decoded_token(model, monkeypatch):
    assert _syncs_per_token(model) <= 1
    # the exact path finds its real tokens once per forward (a nonzero): the counter sees it
    assert _syncs_per_token(model, padded_dispatch=False) > _syncs_per_token(model)
    import titan_foremoe.models.decode_dispatch as dd

    local = dd._local_experts

    def one_more_sync(experts, x_RD, slot_R, e):
        int(slot_R.sum())  # an injected .item() in every MoE layer
        return local(experts, x_RD, slot_R, e)

    monkeypatch.setattr(dd, "_local_experts", one_more_sync)
    assert _syncs_per_token(model) >= 1 + len(moe_layers(model))


def test_prefill_computes_logits_at_the_last_position_only(model):
    tokens_BP = torch.randint(3, 64, (3, 5))
    shapes = []
    handle = model.lm_head.register_forward_hook(lambda _, __, out: shapes.append(tuple(out.shape)))
    try:
        with torch.no_grad():
            full_BPV = model(tokens_BP)
            with last_position_logits(model):
                last_B1V = model(tokens_BP)
    finally:
        handle.remove()
    assert shapes == [(3, 5, 64), (3, 1, 64)]
    torch.testing.assert_close(last_B1V, full_BPV[:, -1:], rtol=1e-6, atol=1e-6)


def _ep_decode(rank, world_size, out_path):
    import torch.distributed as dist

    from titan_foremoe.distributed.parallelize import build_parallel_dims, init_distributed

    cfg = load_config("train_configs/debug_tiny_rl.toml", ["--model.expert_dtype=float32",
                                                          f"--parallelism.expert_parallel_degree={world_size}"])
    init_distributed(cfg)
    torch.manual_seed(0)
    m = build_model(cfg, model_args(cfg, vocab_size=64), build_parallel_dims(cfg, world_size), torch.device("cpu"))
    E = moe_layers(m)[0].router.num_experts
    prompts = PROMPTS[rank::world_size] + [[1, 9, 9, 4 + rank]]  # different rows per rank
    runs = [generate(m, prompts, GenerationConfig(max_new_tokens=8), eos_id=list(range(2, 12)), pad_id=0,
                     num_experts=E, generator=torch.Generator().manual_seed(rank), padded_dispatch=padded)
            for padded in (True, False)]
    results = [None] * world_size
    dist.all_gather_object(results, runs)
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


def test_padded_decode_equals_exact_dispatch_on_ep2(tmp_path):
    out = tmp_path / "ep.pt"
    run_ranks(_ep_decode, 2, str(out))
    for padded, exact in torch.load(out, weights_only=False):
        _assert_same(padded, exact)
