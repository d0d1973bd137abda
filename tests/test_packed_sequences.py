"""Packed micro-batches (``[training] pack_sequences``) against today's padded ones, and against transformers.

1. the packed layout holds exactly the padded layout's real positions (ids, targets, masks, routes,
   behaviour log-probs), with positions restarting per sequence; an empty micro-step is one masked position;
2. the block-diagonal causal mask equals torchtitan's own document mask AND causal mask, pair by pair;
3. every loss mode x rollout correction x KL x entropy: packed rows give the padded loss, metrics and
   gradients (segment sums instead of row sums);
4. a float64 tiny Qwen3-MoE (loaded from a random transformers checkpoint): packed log-probs, entropy,
   losses and parameter gradients equal the padded path's within 1e-6, and packed log-probs equal
   transformers' log-probs of each sequence run alone.
The 2-rank (EP 2) recompute + update check, with an empty micro-step, is ``test_packed_ranks.py``.
"""

from __future__ import annotations

import glob
import types

import pytest
import torch

from titan_foremoe.models.attention import packed_attention_masks
from titan_foremoe.rl.losses import LossNorm, PolicyLossConfig, Segments, policy_loss, AGG_MODES
from titan_foremoe.rollouts.generate import Rollout
from titan_foremoe.routing_log import RoutingLog
from titan_foremoe.train.rl_batches import build_micro_batch

from test_rl_losses import CONFIGS, _batch

LENGTHS = [7, 12, 3, 9, 5]
PROMPTS = [3, 4, 2, 5, 1]


def _rollout(lengths=LENGTHS, prompts=PROMPTS, V=60, X=2, K=2, E=8, seed=0, routes=None, loss_mask=False):
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    tokens = torch.randint(3, V, (B, T), generator=g)
    valid = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    tokens[~valid] = 0
    if routes is None:
        routes = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range((n - 1) * X)]).view(n - 1, X, K)
                  for n in lengths]
    return Rollout(
        tokens_BT=tokens, prompt_lens_B=torch.tensor(prompts), lengths_B=torch.tensor(lengths),
        logprobs_BT=-torch.rand(B, T, generator=g, dtype=torch.float64) * valid,
        finished_B=torch.ones(B, dtype=torch.bool), routes=RoutingLog.from_sequences(routes, lengths, E),
        loss_mask_BT=(torch.rand(B, T, generator=g) > 0.2) if loss_mask else None,
    )


def test_packed_layout_is_the_padded_layout_without_padding():
    rollout = _rollout(loss_mask=True)
    seqs, adv = [3, 0, 2], torch.randn(len(LENGTHS), dtype=torch.float64)
    trained = torch.tensor([True, True, False, True, True])
    pad = build_micro_batch(rollout, seqs, adv, trained)
    pk = build_micro_batch(rollout, seqs, adv, trained, pack=True)
    real = pad.token_mask_BL
    N = sum(LENGTHS[s] - 1 for s in seqs)
    assert pk.inputs_BL.shape == (1, N) and pk.computed_positions() == N == pk.real_tokens() == pad.real_tokens()
    assert pad.computed_positions() == len(seqs) * (max(LENGTHS[s] for s in seqs) - 1)
    for name in ("inputs_BL", "targets_BL", "loss_mask_BL", "routes_BLXK", "rollout_logp_BL"):
        assert torch.equal(getattr(pk, name)[0], getattr(pad, name)[real]), name
    assert torch.equal(pk.positions_BL[0], torch.arange(real.shape[1]).expand_as(real)[real])
    assert torch.equal(pk.seq_BL[0], torch.arange(len(seqs))[:, None].expand_as(real)[real])
    assert pk.cu_seqlens_S1.tolist() == [0, 8, 14, 16] and pk.max_len == 8
    assert torch.equal(pk.advantages_B, pad.advantages_B)
    assert torch.equal(pk.rows(pk.routes_BLXK)[real], pad.routes_BLXK[real])  # back to the log's layout
    assert not pk.loss_mask_BL[0, pk.seq_BL[0] == 2].any()  # row 2 is not trained

    empty = build_micro_batch(rollout, [], adv, pack=True)
    assert empty.inputs_BL.shape == (1, 1) and empty.real_tokens() == 0 and not empty.loss_mask_BL.any()
    assert empty.seq_BL.tolist() == [[-1]] and empty.advantages_B.shape == (0,)
    assert empty.routes_BLXK.shape == (1, 1, 2, 2) and empty.rows(empty.routes_BLXK).shape[0] == 0


def test_block_mask_is_torchtitans_document_and_causal_mask():
    from torchtitan.models.common.attention import get_causal_mask_mod, get_document_mask_mod

    positions = torch.cat([torch.arange(n) for n in (4, 1, 6, 3)])[None]
    mask = packed_attention_masks(positions, torch.tensor([0, 4, 5, 11, 14], dtype=torch.int32), 6, torch.float32)
    N = positions.shape[1]
    q, k = torch.meshgrid(torch.arange(N), torch.arange(N), indexing="ij")
    b = torch.zeros_like(q)
    want = get_document_mask_mod(positions)(b, b, q, k) & get_causal_mask_mod()(b, b, q, k)
    assert mask.shape == (1, 1, N, N) and torch.equal(mask[0, 0], want)


def _pack(x_BL, mask_BL):
    """A padded batch's rows, each up to its last real position, concatenated; and each position's row."""
    lengths = [int(m.nonzero().max()) + 1 if m.any() else 1 for m in mask_BL]
    vals = torch.cat([x[:n] for x, n in zip(x_BL, lengths)])[None]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    return vals, seq


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.loss_agg_mode}-{c.rollout_is}-{c.rollout_is_mode}")
def test_loss_on_packed_rows_equals_padded_rows(cfg):
    d = {k: (v.double() if v.is_floating_point() else v) for k, v in _batch().items()}
    d["mask"][1, 2] = False  # a gap inside a sequence
    pad_one = lambda x: torch.cat([x, x.new_zeros(1, 1)], 1)  # a padded position (no sequence) at the end
    packed = {k: pad_one(_pack(v, d["mask"])[0]) for k, v in d.items() if k != "adv"}
    seq = torch.cat([_pack(d["mask"], d["mask"])[1], torch.full((1, 1), -1)], 1)
    segments = Segments(seq, d["adv"].shape[0])

    def run(b, segs):
        logp = b["logp"].clone().requires_grad_()
        ent = b["ent"].clone().requires_grad_()
        norm = LossNorm.of(LossNorm.local_counts(b["mask"], segs))
        loss, metrics = policy_loss(logp, b["old"], d["adv"], b["mask"], cfg, rollout_logp_BL=b["rollout"],
                                    ref_logp_BL=b["ref"], entropy_BL=ent, norm=norm, segments=segs)
        loss.backward()
        return norm, metrics, logp.grad, ent.grad

    norm_pad, m_pad, g_pad, e_pad = run(d, None)
    norm_pk, m_pk, g_pk, e_pk = run(packed, segments)
    assert norm_pad == norm_pk
    assert m_pad.keys() == m_pk.keys()
    for k in m_pad:
        torch.testing.assert_close(m_pk[k], m_pad[k], rtol=0, atol=1e-12, msg=k)
    torch.testing.assert_close(g_pk, pad_one(_pack(g_pad, d["mask"])[0]), rtol=0, atol=1e-12)
    assert (e_pk is None) == (e_pad is None) == (cfg.entropy_coef == 0)
    if e_pad is not None:
        torch.testing.assert_close(e_pk, pad_one(_pack(e_pad, d["mask"])[0]), rtol=0, atol=1e-12)


# -- a float64 model ----------------------------------------------------------------------------------------
def _grouped_mm_any_dtype(x_RD, w, offsets_E, dtype):
    """``torch._grouped_mm`` has no float64 kernel on CPU: the same product, one expert at a time (test only)."""
    out, start = [], 0
    for e, end in enumerate(offsets_E.tolist()):
        out.append(x_RD[start:end] @ w[e].to(dtype).transpose(-2, -1))
        start = end
    return torch.cat(out) if out else x_RD.new_zeros(0, w.shape[1])


@pytest.fixture(scope="module")
def float64_model(tmp_path_factory):
    """Our model and transformers' from one random tiny Qwen3-MoE checkpoint, both in float64."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts
    from titan_foremoe.models import grouped_swiglu, moe
    from titan_foremoe.models.build import build_model_config
    from titan_foremoe.models.hf import HFAdapter, model_args_from_hf

    hf = make_tiny_checkpoint(str(tmp_path_factory.mktemp("hf") / "tiny"),
                              read_texts("examples/arithmetic_word_problems.jsonl"), n_layers=2, num_experts=8, top_k=2)
    mc = build_model_config(model_args_from_hf(hf), expert_dtype="float32")
    with torch.device("cpu"):
        model = mc.build()
    model.init_states(buffer_device=torch.device("cpu"))
    weights = {}
    for f in glob.glob(f"{hf}/*.safetensors"):
        weights.update(load_file(f))
    missing, unexpected = model.load_state_dict(HFAdapter(mc, hf).from_hf(weights), strict=False)
    assert not unexpected and not any(k in dict(model.named_parameters()) for k in missing)
    model.double()
    for m in model.modules():
        if isinstance(m, moe.DtypeGroupedExperts):
            m.compute_dtype = torch.float64
    saved = grouped_swiglu._grouped_mm  # where the experts' SwiGLU looks it up
    grouped_swiglu._grouped_mm = _grouped_mm_any_dtype
    try:
        yield model, Qwen3MoeForCausalLM.from_pretrained(hf, dtype=torch.float64, experts_implementation="eager").eval()
    finally:
        grouped_swiglu._grouped_mm = saved


def _trainer_stub(pack: bool):
    """``RLTrainer._logprobs`` / ``_upload`` as the trainer runs them, on a default config, single process."""
    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer

    cfg = load_config(None, [f"--training.pack_sequences={str(pack).lower()}", "--rl.logprob_chunk_tokens=7", "--rl.temperature=1.0"])
    stub = types.SimpleNamespace(cfg=cfg, device=torch.device("cpu"))
    stub._upload = lambda mb, loss=False: RLTrainer._upload(stub, mb, loss)
    stub.logprobs = lambda model, mb, **kw: RLTrainer._logprobs(stub, model, mb, **kw)
    return stub


def test_float64_packed_equals_padded_and_transformers(float64_model):
    from titan_foremoe.models.seams import recorded_routes, routing
    from titan_foremoe.rl.losses import LossNorm

    model, ref = float64_model
    lengths, prompts = [9, 14, 4, 11, 6], [3, 5, 2, 4, 3]
    rollout = _rollout(lengths, prompts, V=ref.config.vocab_size, E=8, seed=1)
    # the routes the model picks itself (live), recorded from a padded forward, are the rollout's log
    with torch.no_grad(), routing(model, token_mask_BL=rollout.routes.route_mask_BT()[:, :-1], record=True):
        model(rollout.tokens_BT[:, :-1])
        live = recorded_routes(model)
    rollout.routes = RoutingLog.from_sequences([live[b, : n - 1] for b, n in enumerate(lengths)], lengths, 8)
    seqs = [4, 1, 2, 0, 3]
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    old_shift_BT = 0.3 * torch.randn(rollout.tokens_BT.shape, generator=g, dtype=torch.float64)
    ref_shift_BT = 0.2 * torch.randn(rollout.tokens_BT.shape, generator=g, dtype=torch.float64)

    def at(mb, x_BT):  # a per-(sequence, position) table in the micro-batch's layout
        if mb.packed:
            return x_BT[torch.tensor(seqs)[mb.seq_BL], mb.positions_BL]
        return x_BT[seqs, : mb.inputs_BL.shape[1]]

    out = {}
    for pack in (False, True):
        trainer = _trainer_stub(pack)
        mb = build_micro_batch(rollout, seqs, adv, pack=pack)
        with torch.no_grad():
            old = trainer.logprobs(model, mb)
        model.zero_grad()
        logp, ent = trainer.logprobs(model, mb, entropy=True)
        d = trainer._upload(mb, loss=True)
        segments = Segments(d["seq"], len(seqs)) if pack else None
        norm = LossNorm.of(LossNorm.local_counts(mb.loss_mask_BL, segments))
        losses, total = {}, 0
        for mode in AGG_MODES:
            for is_ in ("token", "sequence"):
                cfg = PolicyLossConfig(loss_agg_mode=mode, rollout_is=is_, rollout_is_threshold=1.5, kl_coef=0.1,
                                       entropy_coef=0.01, loss_norm_tokens=5.0)
                loss, metrics = policy_loss(logp, old + at(mb, old_shift_BT), d["advantages"], d["loss_mask"], cfg,
                                            rollout_logp_BL=d["rollout_logp"], ref_logp_BL=old + at(mb, ref_shift_BT),
                                            entropy_BL=ent, norm=norm, segments=segments)
                losses[(mode, is_)] = {k: float(v) for k, v in metrics.items()}
                total = total + loss
        total.backward()
        real = mb.token_mask_BL
        out[pack] = dict(old=old[real], logp=logp.detach()[real], ent=ent.detach()[real], losses=losses,
                         grads={n: p.grad.clone() for n, p in model.named_parameters()})

    pad, pk = out[False], out[True]
    torch.testing.assert_close(pk["old"], pad["old"], rtol=0, atol=1e-6)
    torch.testing.assert_close(pk["logp"], pad["logp"], rtol=0, atol=1e-6)
    torch.testing.assert_close(pk["ent"], pad["ent"], rtol=0, atol=1e-6)
    for key, metrics in pad["losses"].items():
        for k, v in metrics.items():
            assert abs(pk["losses"][key][k] - v) <= 1e-6, (key, k, v, pk["losses"][key][k])
    assert any(abs(v) > 1e-3 for m in pad["losses"].values() for v in m.values())
    for n, g_pad in pad["grads"].items():
        assert g_pad.abs().sum() > 0, n  # every parameter took part
        torch.testing.assert_close(pk["grads"][n], g_pad, rtol=0, atol=1e-6, msg=n)

    # transformers, each sequence alone, no padding: log p(token t | < t)
    want = []
    with torch.no_grad():
        for s in seqs:
            n = lengths[s]
            tokens = rollout.tokens_BT[s, :n][None]
            logits = ref(tokens).logits[0, :-1].double()
            want.append(logits.log_softmax(-1).gather(-1, tokens[0, 1:, None])[:, 0])
    torch.testing.assert_close(pk["old"], torch.cat(want).float(), rtol=0, atol=1e-6)


def test_varlen_path_calls_torchs_varlen_attention(monkeypatch):
    """Where ``varlen_attn`` runs (CUDA, bf16), CachedSDPA hands the packed row to torch's ``varlen_attn`` with
    the host-known bounds. No CUDA here: ``varlen_attn`` is replaced by causal SDPA per sequence, so this
    checks the wiring (bounds, causal window, scale, GQA) against the CPU path's block mask."""
    import torch.nn.attention.varlen as tv
    import torch.nn.functional as F
    import torchtitan.models.common.attention as tt

    from titan_foremoe.models import attention
    from titan_foremoe.models.attention import CachedSDPA

    calls = []

    def varlen_by_sdpa(q_TNH, k_TNH, v_TNH, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                       enable_gqa=False, **kw):
        calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k, window_size, enable_gqa, q_TNH.dtype))
        out = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q_TNH, k_TNH, v_TNH)), scale=scale,
                                              is_causal=True, enable_gqa=enable_gqa).transpose(0, 1)
               for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())]
        return torch.cat(out)

    monkeypatch.setattr(tv, "varlen_attn", varlen_by_sdpa)
    lengths = [5, 1, 7, 3]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, n, 8, generator=g).bfloat16().float() for n in (4, 2, 2))
    inner = CachedSDPA(CachedSDPA.Config())
    want = inner(q, k, v, attention_masks=packed_attention_masks(positions, cu, 7, torch.float32), scale=0.3,
                 enable_gqa=True)
    monkeypatch.setattr(attention, "varlen_runs", lambda device, dtype: True)
    meta = packed_attention_masks(positions, cu, 7, torch.bfloat16)
    assert isinstance(meta, tt.VarlenMetadata)
    got = inner(q, k, v, attention_masks=meta, scale=0.3, enable_gqa=True)
    assert calls == [([0, 5, 6, 13, 16], [0, 5, 6, 13, 16], 7, 7, (-1, 0), True, torch.bfloat16)]
    assert got.shape == want.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)  # varlen runs in bf16
