"""The policy loss's modes against a per-token brute force, micro-steps and ranks against one big batch,
chunked log-probs against torch's full log_softmax, advantage options, and the config checks."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from titan_foremoe.config import ConfigError, load_config
from titan_foremoe.config.validate import validate
from titan_foremoe.rl.dapo import overlong_penalty_N, uniform_groups_N
from titan_foremoe.rl.grpo import group_advantages
from titan_foremoe.rl.logprobs import lm_head_logprobs, token_logprobs_entropy
from titan_foremoe.rl.losses import AGG_MODES, LossNorm, PolicyLossConfig, policy_loss

from distributed_helpers import run_ranks

ROOT = Path(__file__).resolve().parents[1]

# Every option appears at least once; each aggregation mode meets every rollout-correction setting.
CONFIGS = [
    PolicyLossConfig(loss_agg_mode=mode, loss_norm_tokens=5.0, rollout_is=is_, rollout_is_mode=is_mode,
                     rollout_is_threshold=1.3, **extra)
    for mode in AGG_MODES
    for is_, is_mode, extra in [
        ("off", "truncate", {}),
        ("token", "truncate", dict(clip_eps_low=0.2, clip_eps_high=0.28, clip_ratio_c=3.0)),
        ("token", "mask", dict(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)),
        ("sequence", "truncate", dict(kl_coef=0.1, kl_estimator="k2", clip_ratio_c=1.5)),
        ("sequence", "mask", dict(kl_coef=0.1, kl_estimator="low_var_kl", entropy_coef=0.02)),
        ("off", "truncate", dict(kl_coef=0.2, kl_estimator="k3", clip_eps_high=0.5)),
    ]
]


def _batch(B=6, L=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])[:B]
    mask = torch.arange(L)[None, :] < lengths[:, None]
    mask[3] = False  # a sequence without loss tokens (counts in no normalizer)
    mask[1, 0] = False  # a tool token inside a turn
    return dict(
        logp=-torch.rand(B, L, generator=g) * 2,
        old=-torch.rand(B, L, generator=g) * 2,
        adv=torch.randn(B, generator=g),
        mask=mask,
        rollout=-torch.rand(B, L, generator=g) * 2,
        ref=-torch.rand(B, L, generator=g) * 2,
        ent=torch.rand(B, L, generator=g) * 3,
    )


def _brute_force(d, cfg: PolicyLossConfig) -> torch.Tensor:
    """The step loss written token by token and sequence by sequence, with scalar ops."""
    logp, old, adv, mask, rollout, ref, ent = (d[k] for k in ("logp", "old", "adv", "mask", "rollout", "ref", "ent"))
    seqs = []
    for b in range(logp.shape[0]):
        toks = [t for t in range(logp.shape[1]) if mask[b, t]]
        if not toks:
            continue
        seq_log_w = sum(float(old[b, t] - rollout[b, t]) for t in toks)
        terms = []
        for t in toks:
            a = float(adv[b])
            r = torch.exp(logp[b, t] - old[b, t])
            term = torch.maximum(-a * r, -a * r.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high))
            if cfg.clip_ratio_c > 0 and a < 0:
                term = torch.minimum(term, torch.tensor(-a * cfg.clip_ratio_c))
            if cfg.rollout_is != "off":
                w = math.exp(seq_log_w if cfg.rollout_is == "sequence" else float(old[b, t] - rollout[b, t]))
                if w > cfg.rollout_is_threshold:
                    w = cfg.rollout_is_threshold if cfg.rollout_is_mode == "truncate" else 0.0
                term = term * w
            if cfg.kl_coef > 0:
                x = ref[b, t] - logp[b, t]
                kl = {"k1": -x, "k2": x * x / 2, "k3": torch.exp(x) - x - 1,
                      "low_var_kl": torch.exp(x) - x - 1}[cfg.kl_estimator]
                term = term + cfg.kl_coef * kl
            term = term - cfg.entropy_coef * ent[b, t]
            terms.append(term)
        seqs.append(terms)
    n_tokens = sum(len(s) for s in seqs)
    if cfg.loss_agg_mode == "token-mean":
        return sum(sum(s) for s in seqs) / n_tokens
    if cfg.loss_agg_mode == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in seqs) / len(seqs)
    if cfg.loss_agg_mode == "seq-mean-token-sum":
        return sum(sum(s) for s in seqs) / len(seqs)
    return sum(sum(s) / cfg.loss_norm_tokens for s in seqs) / len(seqs)


def _leaves(d):
    d = {k: v.clone() for k, v in d.items()}
    d["logp"].requires_grad_()
    d["ent"].requires_grad_()
    return d


def _ours(d, cfg, norm=None, rows=slice(None)):
    return policy_loss(d["logp"][rows], d["old"][rows], d["adv"][rows], d["mask"][rows], cfg,
                       rollout_logp_BL=d["rollout"][rows], ref_logp_BL=d["ref"][rows], entropy_BL=d["ent"][rows],
                       norm=norm)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.loss_agg_mode}-{c.rollout_is}-{c.rollout_is_mode}")
def test_loss_and_gradients_match_brute_force(cfg):
    d = _batch()
    a, b = _leaves(d), _leaves(d)
    loss, metrics = _ours(a, cfg)
    ref = _brute_force(b, cfg)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-7)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(a["logp"].grad, b["logp"].grad, rtol=1e-5, atol=1e-7)
    if cfg.entropy_coef > 0:
        torch.testing.assert_close(a["ent"].grad, b["ent"].grad, rtol=1e-5, atol=1e-7)
    else:  # a metric only: no gradient flows through the entropy
        assert a["ent"].grad is None
    assert metrics["loss"] == loss.detach()
    if cfg.rollout_is != "off":  # the threshold (1.3) bites on this batch: the truncated/masked branch runs
        assert 0 < metrics["rollout_is/rejected_frac"] < 1


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.loss_agg_mode}-{c.rollout_is}-{c.rollout_is_mode}")
def test_micro_steps_sum_to_the_big_batch(cfg):
    """Uneven micro-batches with the step's normalizers counted first: losses, gradients, metrics add up."""
    d = _batch()
    big, small = _leaves(d), _leaves(d)
    loss, metrics = _ours(big, cfg)
    loss.backward()
    parts = [slice(0, 1), slice(1, 4), slice(4, 6)]
    norm = LossNorm.of(sum(LossNorm.local_counts(d["mask"][p]) for p in parts))
    total, sums = 0.0, {}
    for p in parts:
        lo, m = _ours(small, cfg, norm, p)
        lo.backward()
        total = total + lo.detach()
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v
    torch.testing.assert_close(total, loss.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(small["logp"].grad, big["logp"].grad, rtol=1e-6, atol=1e-8)
    for k, v in metrics.items():
        torch.testing.assert_close(sums[k], v, rtol=1e-6, atol=1e-7)


def _ranks_match_one_batch(rank: int, world: int) -> None:
    """2 DP ranks x 2 micro-steps of a tiny policy (embedding -> logits, chunked log-probs) against one rank
    running the whole batch, for every mode: normalizers all-reduced first, gradients summed (as FSDP)."""
    import torch.distributed as dist

    from titan_foremoe.distributed import collectives

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    V, B, L = 11, 8, 5
    tokens = torch.randint(0, V, (B, L + 1))
    lengths = torch.tensor([5, 2, 4, 1, 3, 5, 2, 4])
    mask = torch.arange(L)[None, :] < lengths[:, None]
    mask[2, :2] = False  # a multi-turn gap
    adv = torch.randn(B)
    rollout = -torch.rand(B, L) * 2
    ref = -torch.rand(B, L) * 2
    init = torch.nn.Embedding(V, V).weight.detach().clone()

    def policy():
        emb = torch.nn.Embedding(V, V)
        emb.weight.data.copy_(init)
        return emb

    with torch.no_grad():
        old = token_logprobs_entropy(policy()(tokens[:, :-1]) * 0.9, tokens[:, 1:], chunk=3)[0]
    for cfg in CONFIGS:
        def step_loss(model, rows, norm):
            logp, ent = token_logprobs_entropy(model(tokens[rows, :-1]), tokens[rows, 1:], 0.8, chunk=3)
            return policy_loss(logp, old[rows], adv[rows], mask[rows], cfg, rollout_logp_BL=rollout[rows],
                               ref_logp_BL=ref[rows], entropy_BL=ent, norm=norm)[0]

        one = policy()
        ref_loss = step_loss(one, slice(None), None)
        ref_loss.backward()
        mine = [list(range(rank * 4, rank * 4 + 1)), list(range(rank * 4 + 1, rank * 4 + 4))]  # uneven micro-steps
        counts = sum(LossNorm.local_counts(mask[r]) for r in mine)
        collectives.all_reduce(counts)
        norm = LossNorm.of(counts)
        model = policy()
        total = torch.zeros(())
        for rows in mine:
            lo = step_loss(model, rows, norm)
            lo.backward()
            total += lo.detach()
        dist.all_reduce(model.weight.grad)
        dist.all_reduce(total)
        torch.testing.assert_close(total, ref_loss.detach(), rtol=1e-5, atol=1e-7, msg=str(cfg))
        torch.testing.assert_close(model.weight.grad, one.weight.grad, rtol=1e-5, atol=1e-7, msg=str(cfg))


def test_two_ranks_and_micro_steps_match_one_batch_every_mode():
    run_ranks(_ranks_match_one_batch, 2, apply_patches=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_and_entropy_equal_full_log_softmax(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 7, 50, generator=g) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (3, 7), generator=g)
    targets[0, -2:] = -1  # padding reads token 0
    w1, w2 = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    for T, chunk in [(1.0, 4), (0.7, 5), (0.0, 100)]:
        logp, ent = token_logprobs_entropy(logits, targets, T, chunk=chunk)
        ls = torch.log_softmax(logits.float() / (T or 1.0), dim=-1)
        ref_logp = ls.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
        ref_ent = -(ls.exp() * ls).sum(-1)
        assert torch.equal(logp, ref_logp) and torch.equal(ent, ref_ent)  # rows are independent: bitwise
        (ours,) = torch.autograd.grad((logp * w1).sum(), logits, retain_graph=True)
        (theirs,) = torch.autograd.grad((ref_logp * w1).sum(), logits, retain_graph=True)
        assert torch.equal(ours, theirs)  # log_softmax's own backward kernel, chunk by chunk
        for objective, reference in [((logp * w1).sum(), (ref_logp * w1).sum()),
                                     ((logp * w1).sum() + (ent * w2).sum(), (ref_logp * w1).sum() + (ref_ent * w2).sum())]:
            (ours,) = torch.autograd.grad(objective, logits, retain_graph=True)
            (theirs,) = torch.autograd.grad(reference, logits, retain_graph=True)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


class _Head(torch.nn.Module):
    """A decoder's tail as torchtitan's calls it: final norm, then ``self.lm_head(h)``."""

    def __init__(self, V=50, D=16, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.emb = torch.nn.Parameter(torch.randn(V, D, generator=g).to(dtype))
        self.norm = torch.nn.RMSNorm(D, dtype=dtype)
        self.lm_head = torch.nn.Linear(D, V, bias=False, dtype=dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.randn(V, D, generator=g) * 2)

    def forward(self, tokens):
        return self.lm_head(self.norm(torch.tanh(self.emb[tokens])))


def _fused_vs_logits(model, tokens, targets, T, chunk, w1, w2):
    """(values, grads) of the fused head and of the model's full logits + torch's log_softmax."""
    out = []
    for fused in (True, False):
        model.zero_grad()
        if fused:
            with lm_head_logprobs(model, targets, T, chunk=chunk):
                logp, ent = model(tokens)
        else:
            ls = torch.log_softmax(model(tokens).float() / (T or 1.0), dim=-1)
            logp = ls.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
            ent = -(ls.exp() * ls).sum(-1)
        ((logp * w1).sum() + (ent * w2).sum()).backward()
        out.append((logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_logprobs_equal_the_full_logits(dtype):
    """The fused head (logits a chunk at a time, recomputed in backward) against the model's full logits and
    torch's log_softmax: the same log-probs, entropy and gradients of every parameter, lm_head's included."""
    model = _Head(dtype=dtype)
    g = torch.Generator().manual_seed(3)
    tokens, targets = torch.randint(0, 50, (3, 7), generator=g), torch.randint(0, 50, (3, 7), generator=g)
    targets[0, -2:] = -1
    w1, w2 = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for T, chunk in [(1.0, 4), (0.7, 5), (0.0, 100)]:
        (lp, en, gr), (ref_lp, ref_en, ref_gr) = _fused_vs_logits(model, tokens, targets, T, chunk, w1, w2)
        torch.testing.assert_close(lp, ref_lp, **tol)  # a GEMM over fewer rows may round differently
        torch.testing.assert_close(en, ref_en, **tol)
        for n in ref_gr:
            torch.testing.assert_close(gr[n], ref_gr[n], **tol, msg=f"{n} T={T} chunk={chunk}")
    assert "forward" not in vars(model.lm_head)  # the plain linear is back after the context
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        with lm_head_logprobs(model, targets, chunk=0):
            pass


def _fused_head_under_fsdp(rank: int, world_size: int) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    model = _Head()
    fully_shard([model.norm, model.lm_head], reshard_after_forward=True)  # torchtitan groups norm + lm_head
    fully_shard(model)
    g = torch.Generator().manual_seed(4 + rank)  # each rank its own tokens: the reduce-scatter matters
    tokens, targets = torch.randint(0, 50, (2, 9), generator=g), torch.randint(0, 50, (2, 9), generator=g)
    w1, w2 = torch.randn(2, 9, generator=g), torch.randn(2, 9, generator=g)
    (lp, en, gr), (ref_lp, ref_en, ref_gr) = _fused_vs_logits(model, tokens, targets, 0.8, 4, w1, w2)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(en, ref_en)
    for n in ref_gr:  # sharded gradients, reduced over both ranks by FSDP
        torch.testing.assert_close(gr[n].full_tensor(), ref_gr[n].full_tensor(), rtol=1e-5, atol=1e-5, msg=n)
    assert gr["lm_head.weight"].full_tensor().abs().sum() > 0


def test_lm_head_logprobs_under_fsdp2():
    """FSDP2 (norm + lm_head one unit resharded after forward, 2 gloo ranks): the fused head still goes through
    the unit's hooks, so its weight is unsharded in forward and backward and its gradient reduce-scattered,
    equal to the full-logits path's."""
    run_ranks(_fused_head_under_fsdp, 2, apply_patches=False)


def test_advantage_options():
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 5.0, 5.0, 5.0, 5.0])
    loo = group_advantages(r, 4, std_norm=False, baseline="leave_one_out")
    brute = [r[i] - torch.cat([r[(i // 4) * 4 : i], r[i + 1 : (i // 4 + 1) * 4]]).mean() for i in range(8)]
    torch.testing.assert_close(loo, torch.stack(brute))
    plain = group_advantages(r, 4, std_norm=False)
    torch.testing.assert_close(plain, torch.tensor([0.25, -0.75, -0.75, 1.25, 0, 0, 0, 0]))
    normed = group_advantages(r, 4, eps=0.0)
    torch.testing.assert_close(normed[:4], plain[:4] / r[:4].std(unbiased=False))
    with pytest.raises(ValueError, match="unknown advantage baseline"):
        group_advantages(r, 4, baseline="median")


def test_default_config_is_todays_loss():
    """Defaults: token-mean, symmetric clip_eps, k3, no correction (the loss the trainer had)."""
    cfg = PolicyLossConfig.from_rl(load_config(ROOT / "train_configs" / "debug_tiny_rl.toml").rl)
    assert cfg == replace(PolicyLossConfig(), loss_norm_tokens=cfg.loss_norm_tokens)


def _error(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(ROOT / "train_configs" / "debug_tiny_rl.toml", overrides), 4)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_config_refuses_bad_loss_options():
    assert "[rl] rollout_is_threshold: must be finite and > 0" in _error(["--rl.rollout_is_threshold=0"])
    assert "[rl] rollout_is_threshold" in _error(["--rl.rollout_is_threshold=-1"])
    assert "[rl] loss_agg_mode" in _error(["--rl.loss_agg_mode=seq-mean"])
    assert "[rl] rollout_is" in _error(["--rl.rollout_is=tokens"])
    assert "[rl] kl_estimator" in _error(["--rl.kl_estimator=k4"])
    assert "[rl] clip_eps_high: 0.1 is below clip_eps_low 0.2" in _error(["--rl.clip_eps_high=0.1"])
    assert "[rl] clip_eps_high" in _error(["--rl.clip_eps_low=0.3", "--rl.clip_eps_high=0.28"])
    assert "[rl] clip_ratio_c: must be 0 (off) or finite and > 1" in _error(["--rl.clip_ratio_c=0.9"])
    assert "[rl] entropy_coef" in _error(["--rl.entropy_coef=-0.1"])
    assert "[rl] logprob_chunk_tokens" in _error(["--rl.logprob_chunk_tokens=0"])
    assert "[rl] overlong_buffer: must be in [0, max_new_tokens = 8]" in _error(["--rl.overlong_buffer=9"])
    validate(load_config(ROOT / "train_configs" / "debug_tiny_rl.toml",
                         ["--rl.clip_eps_high=0.28", "--rl.clip_ratio_c=3", "--rl.rollout_is=sequence",
                          "--rl.loss_agg_mode=seq-mean-token-sum-norm"]), 4)


def test_dapo_group_filter_and_overlong_penalty():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    assert uniform_groups_N(r, 4).tolist() == [False] * 4 + [True] * 4
    assert uniform_groups_N(r, 2).tolist() == [True, True, False, False, True, True, True, True]
    # max_new_tokens 10, buffer 4, factor 0.5: 0 up to 6 tokens, then -0.5 * (len - 6) / 4
    lens = torch.tensor([1, 6, 7, 8, 10])
    brute = [min(0.0, -0.5 * (n - 6) / 4) for n in lens.tolist()]
    torch.testing.assert_close(overlong_penalty_N(lens, 10, 4, 0.5), torch.tensor(brute))


def test_filtered_rows_leave_loss_and_normalizers():
    """A dropped row's loss mask is empty: the loss equals the loss of the batch without that row."""
    from titan_foremoe.rollouts.generate import Rollout
    from titan_foremoe.train.rl_batches import build_micro_batch

    class _Routes:
        def select(self, rows):
            return self

        def routes_for_inputs(self, L):
            return torch.zeros(3, L, 1, 1, dtype=torch.long)

    g = torch.Generator().manual_seed(3)
    rollout = Rollout.__new__(Rollout)
    rollout.tokens_BT = torch.randint(0, 9, (3, 6), generator=g)
    rollout.lengths_B = torch.tensor([6, 4, 5])
    rollout.prompt_lens_B = torch.tensor([2, 2, 3])
    rollout.logprobs_BT = torch.zeros(3, 6)
    rollout.routes = _Routes()
    adv = torch.tensor([0.5, -1.0, 2.0])
    mb = build_micro_batch(rollout, [0, 1, 2], adv, trained_N=torch.tensor([True, False, True]))
    assert mb.loss_mask_BL[1].sum() == 0 and mb.loss_mask_BL[0].sum() == 4 and mb.token_mask_BL[1].sum() == 3
    logp = -torch.rand(3, 5, generator=g)
    old = -torch.rand(3, 5, generator=g)
    for mode in AGG_MODES:
        cfg = PolicyLossConfig(loss_agg_mode=mode)
        both = policy_loss(logp, old, adv, mb.loss_mask_BL, cfg)[0]
        kept = policy_loss(logp[[0, 2]], old[[0, 2]], adv[[0, 2]], mb.loss_mask_BL[[0, 2]], cfg)[0]
        torch.testing.assert_close(both, kept)

