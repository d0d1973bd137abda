"""Attention kernel choice on faked SM80 / SM90 / SM100 devices, its one-line refusals, and the rollout's
flash KV-cache decode checked against the masked SDPA path (CPU: a reference of ``_flash_attention_forward``'s
varlen contract stands in for the CUDA kernel)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import _registry

from titan_foremoe.config import load_config
from titan_foremoe.config.loader import ConfigError
from titan_foremoe.config.validate import model_args
from titan_foremoe.distributed.parallelize import build_model
from titan_foremoe.models import attention, attention_kernels as ak
from titan_foremoe.rollouts.generate import GenerationConfig, generate
from test_rollout import PROMPTS, model  # noqa: F401  (the rollout tests' model: the oracle path's own)

CUDA = torch.device("cuda", 0)


class _FlashFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``flash_attn_interface`` installed (or not) as far as the import system can tell; records real imports."""

    def __init__(self, present: bool):
        self.present, self.imported = present, []

    def find_spec(self, name, path=None, target=None):
        if name == ak.FA3_MODULE and self.present:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.imported.append(module.__name__)


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(cap, fa3)``: CUDA available with capability ``cap``; ``fa3``: flash_attn_interface findable.
    The FA3 / FA4 registry entries are replaced by recorders (torch's would import the packages)."""
    calls = []

    def make(cap: tuple[int, int], fa3: bool) -> _FlashFinder:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(torch.version, "hip", None)
        for impl in ("FA3", "FA4"):
            monkeypatch.setitem(_registry._FLASH_ATTENTION_IMPLS, impl, lambda impl=impl: calls.append(impl))
        monkeypatch.setattr(_registry, "_FLASH_ATTENTION_ACTIVE", None)
        monkeypatch.delitem(sys.modules, ak.FA3_MODULE, raising=False)
        finder = _FlashFinder(fa3)
        monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
        finder.activated = calls
        return finder

    return make


@pytest.mark.parametrize("cap,fa3,impl,packed", [
    ((8, 0), False, "FA2", "fa2"), ((8, 0), True, "FA2", "fa2"),
    ((9, 0), False, "FA2", "fa2"), ((9, 0), True, "FA3", "fa3"),
    ((10, 0), False, "FA2", "fa2"), ((10, 0), True, "FA2", "fa2"),
])
def test_varlen_kernel_follows_the_device_and_what_is_installed(fake_gpu, cap, fa3, impl, packed):
    finder = fake_gpu(cap, fa3)
    kernels = ak.choose_kernels(CUDA, torch.bfloat16, 128)
    assert (kernels.packed, kernels.decode, kernels.padded) == (packed, "flash_kvcache", "cudnn/flash")
    assert ak.activate_varlen_impl(CUDA) == impl
    assert finder.activated == (["FA3"] if impl == "FA3" else [])  # FA4 never; FA3 only where installed
    assert finder.imported == [] and ak.FA3_MODULE not in sys.modules  # the choice imports nothing
    assert ak.attention_problem(CUDA, torch.bfloat16, 128, pack_sequences=True) is None


def test_torchtitans_varlen_attention_would_import_fa3_on_sm90(fake_gpu):
    """The bug this module fixes: torchtitan's constructor activates FA3 on every SM90 (torch's FA3 register
    function then imports flash_attn_interface); ours does not where it is absent."""
    from torchtitan.models.common.attention import VarlenAttention

    finder = fake_gpu((9, 0), fa3=False)
    ak.activate_varlen_impl(CUDA)
    assert finder.activated == []
    VarlenAttention.Config().build()
    assert finder.activated == ["FA3"]


def test_an_fa3_activated_elsewhere_is_restored_where_fa2_is_the_choice(fake_gpu, monkeypatch):
    fake_gpu((9, 0), fa3=False)
    removed = []
    monkeypatch.setattr(_registry, "_FLASH_ATTENTION_ACTIVE", ("FA3", type("H", (), {"remove": lambda s: removed.append(1)})()))
    assert ak.activate_varlen_impl(CUDA) == "FA2"
    assert removed == [1] and _registry._FLASH_ATTENTION_ACTIVE is None


@pytest.mark.parametrize("cap,dtype,head_dim,words", [
    ((7, 5), torch.bfloat16, 128, "sm75 is outside"),
    ((9, 0), torch.float32, 128, "bf16/fp16, not float32"),
    ((9, 0), torch.bfloat16, 320, "head_dim 320"),
    ((8, 6), torch.bfloat16, 256, "backward does not run on sm86"),
])
def test_attention_that_cannot_run_is_refused_in_one_line(fake_gpu, cap, dtype, head_dim, words):
    fake_gpu(cap, fa3=False)
    why = ak.attention_problem(CUDA, dtype, head_dim, pack_sequences=True)
    assert why is not None and words in why and "\n" not in why and why.startswith("[training] pack_sequences")
    assert ak.attention_problem(CUDA, dtype, head_dim, pack_sequences=False) is None  # padded rows: SDPA
    assert ak.attention_problem(torch.device("cpu"), dtype, head_dim, pack_sequences=True) is None


def test_model_build_and_preflight_refuse_before_any_work(fake_gpu, capsys, monkeypatch):
    """fp32 activations with packed rows on a GPU: refused at the pre-flight and at every rank's model build."""
    from titan_foremoe.config import check

    fake_gpu((9, 0), fa3=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = load_config("train_configs/debug_tiny_rl.toml", [])
    assert cfg.rl.enable and cfg.training.pack_sequences and cfg.training.mixed_precision_param == "float32"
    with pytest.raises(ConfigError, match=r"^\[training\] pack_sequences: no varlen attention kernel on cuda:0"):
        build_model(cfg, model_args(cfg), None, CUDA)
    assert check.main(["train_configs/debug_tiny_rl.toml", "--world-size", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "float32" in err[0] and "mixed_precision_param" in err[0]
    assert check.main(["train_configs/debug_tiny_rl.toml", "--world-size", "4",
                       "--training.mixed_precision_param=bfloat16"]) == 0


def test_varlen_kwargs_follow_the_installed_signature(monkeypatch):
    """torch 2.11's varlen_attn has neither enable_gqa nor num_splits (FA2 reads fewer KV heads as GQA)."""
    monkeypatch.setattr(ak, "_varlen_params", lambda: frozenset({"query", "scale", "window_size", "return_aux"}))
    assert ak.varlen_kwargs(True, "FA2") == {"window_size": (-1, 0)}
    monkeypatch.setattr(ak, "_varlen_params", lambda: frozenset({"window_size", "enable_gqa", "num_splits"}))
    assert ak.varlen_kwargs(True, "FA2") == {"window_size": (-1, 0), "enable_gqa": True, "num_splits": 1}
    assert ak.varlen_kwargs(False, "FA3") == {"window_size": (-1, 0)}


def flash_varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                           scale=None, seqused_k=None, **unused):
    """FlashAttention-2's varlen contract, written out: row b's queries ``q[cu_q[b]:cu_q[b+1]]`` attend to keys
    ``k[cu_k[b] : cu_k[b] + seqused_k[b]]`` (or ``cu_k[b+1]``), GQA by head groups, causal aligned bottom-right,
    a query without keys returns 0."""
    assert dropout_p == 0.0 and not return_debug_mask and max_q == int((cu_q[1:] - cu_q[:-1]).max())
    out = torch.zeros_like(q)
    for b in range(len(cu_q) - 1):
        q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
        k0 = int(cu_k[b])
        k1 = k0 + int(seqused_k[b]) if seqused_k is not None else int(cu_k[b + 1])
        assert k1 - k0 <= max_k
        qb, kb, vb = q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1)
        Lq, Lk = q1 - q0, k1 - k0
        allowed = torch.arange(Lk)[None] <= torch.arange(Lq)[:, None] + (Lk - Lq) if is_causal else None
        rows = allowed.any(-1) if allowed is not None else torch.ones(Lq, dtype=torch.bool)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, scale=scale, enable_gqa=True)
        out[q0:q1] = torch.where(rows[:, None, None], o.transpose(0, 1), 0)
    return out, None, None, None, None


def _rollout(model, max_new_tokens=8):
    return generate(model, PROMPTS, GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.8), eos_id=2,
                    pad_id=0, num_experts=8, generator=torch.Generator().manual_seed(0))


def test_flash_kvcache_decode_gives_the_masked_paths_rollout(model, monkeypatch):
    """The rollout decoded by the KV-cache flash call (stood in for by its varlen contract) samples the same
    tokens with the same log-probs as the masked SDPA path, reading the cache in place: all B*T cache rows,
    the KV heads not expanded, no mask, each row's keys from its first prompt token."""
    want = _rollout(model)
    calls = []

    def flash(q, k, v, cu_q, cu_k, max_q, max_k, *a, **kw):
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), cu_q=cu_q.tolist(), cu_k=cu_k.tolist(), max_q=max_q,
                          max_k=max_k, used=kw["seqused_k"].tolist(), causal=a[1]))
        return flash_varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, *a, **kw)

    monkeypatch.setattr(attention, "flash_problem", lambda *a, **k: None)  # as on a GPU in bf16
    monkeypatch.setattr(ak, "flash_forward", flash)
    got = _rollout(model)
    assert torch.equal(got.tokens_BT, want.tokens_BT) and torch.equal(got.lengths_B, want.lengths_B)
    assert torch.equal(got.routes.experts_BTXK, want.routes.experts_BTXK)
    torch.testing.assert_close(got.logprobs_BT, want.logprobs_BT, rtol=0, atol=1e-5)
    B, P, T = 3, 6, 6 + 8
    n_layers = 4
    prefill, step = calls[0], calls[n_layers]
    assert prefill == dict(q=(B * P, 4, 16), k=(B * T, 2, 16), cu_q=[0, 6, 12, 18], cu_k=[2, T + 3, 2 * T, 3 * T],
                           max_q=6, max_k=6, used=[4, 3, 6], causal=True)
    assert step == dict(q=(B, 4, 16), k=(B * T, 2, 16), cu_q=[0, 1, 2, 3], cu_k=[2, T + 3, 2 * T, 3 * T], max_q=1,
                        max_k=7, used=[5, 4, 7], causal=True)


def test_flash_kvcache_decode_without_the_row_offsets_differs(model, monkeypatch):
    """The test above can fail: keys read from each row's buffer start (left padding included) change the
    rollout's log-probs."""
    want = _rollout(model, max_new_tokens=3)

    def flash(q, k, v, cu_q, cu_k, *a, **kw):
        B = len(cu_q) - 1
        T = k.shape[0] // B
        starts = torch.arange(B + 1, dtype=torch.int32) * T
        return flash_varlen_reference(q, k, v, cu_q, starts, *a, **{**kw, "seqused_k": kw["seqused_k"] + cu_k[:-1] - starts[:-1]})

    monkeypatch.setattr(attention, "flash_problem", lambda *a, **k: None)
    monkeypatch.setattr(ak, "flash_forward", flash)
    got = _rollout(model, max_new_tokens=3)
    assert not torch.allclose(got.logprobs_BT, want.logprobs_BT, atol=1e-3)


def test_describe_on_cpu_names_the_fallbacks():
    d = ak.describe_attention_kernels(torch.device("cpu"))
    assert (d["packed"], d["decode"], d["padded"], d["capability"], d["problem"]) == (
        "sdpa_block_mask", "sdpa_masked", "math", None, None)
