"""Embedded rollout: KV-cached decode, recorded routes, padding kept out of the experts."""

from __future__ import annotations

import pytest
import torch

from titan_foremoe.config import load_config
from titan_foremoe.config.validate import model_args
from titan_foremoe.distributed.parallelize import build_model
from titan_foremoe.loads import sequence_loads
from titan_foremoe.models.seams import moe_layers, routing, take_mismatch
from titan_foremoe.rl.grpo import token_logprobs
from titan_foremoe.rl.rewards import resolve_reward
from titan_foremoe.rollouts.generate import GenerationConfig, generate
from titan_foremoe.rollouts.sampling import sample

PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 3, 4, 5, 6, 7]]


@pytest.fixture(scope="module")
def model():
    cfg = load_config(None, ["--model.expert_dtype=float32"])
    torch.manual_seed(0)
    return build_model(cfg, model_args(cfg, vocab_size=64), None, torch.device("cpu"))


def _generate(model, seed=0, **kw):
    cfg = GenerationConfig(max_new_tokens=kw.pop("max_new_tokens", 6), **kw)
    return generate(model, PROMPTS, cfg, eos_id=2, pad_id=0, num_experts=8,
                    generator=torch.Generator().manual_seed(seed))


def test_rollout_is_seeded_and_reproducible(model):
    a, b, c = _generate(model, 0), _generate(model, 0), _generate(model, 1)
    assert torch.equal(a.tokens_BT, b.tokens_BT) and torch.equal(a.routes.experts_BTXK, b.routes.experts_BTXK)
    assert not torch.equal(a.tokens_BT, c.tokens_BT)
    assert a.prompt_lens_B.tolist() == [4, 3, 6]
    for row, p in enumerate(PROMPTS):
        assert a.tokens_BT[row, : len(p)].tolist() == p


def test_routes_cover_every_fed_token_and_nothing_else(model):
    r = _generate(model)
    r.routes.validate(token_lengths=r.lengths_B, num_layers=4, top_k=2, num_experts=8)
    assert r.routes.experts_BTXK.dtype == torch.uint8
    # every fed token (all but each sequence's last) counts once per layer and top-k; left padding never does
    assert sequence_loads(r.routes).sum(1).tolist() == [int((r.lengths_B - 1).sum()) * 2] * 4


def test_cached_decode_matches_full_forward_with_replay(model):
    """The rollout's behaviour log-probs are taken at the sampling temperature (as verl), and the
    recompute at that temperature reproduces them; at temperature 1 it would not (ratio != 1)."""
    r = _generate(model, temperature=0.7, top_p=0.9)
    L = int(r.lengths_B.max()) - 1
    mask = torch.arange(L)[None] < (r.lengths_B[:, None] - 1)
    take_mismatch(model)
    with torch.no_grad(), routing(model, token_mask_BL=mask, logged_BLXK=r.routes.routes_for_inputs(L)):
        logits = model(r.tokens_BT[:, :L])
    assert take_mismatch(model) == (0, int(mask.sum()) * 4)
    generated = mask & (torch.arange(L)[None] >= r.prompt_lens_B[:, None] - 1)
    rollout_lp = r.logprobs_BT[:, 1 : L + 1][generated]
    lp = token_logprobs(logits, r.tokens_BT[:, 1 : L + 1], temperature=0.7)
    torch.testing.assert_close(lp[generated], rollout_lp, rtol=0, atol=1e-5)
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, r.tokens_BT[:, 1 : L + 1, None])[..., 0]
    torch.testing.assert_close(rollout_lp, expected[generated], rtol=0, atol=1e-5)  # torch's own op
    at_t1 = token_logprobs(logits, r.tokens_BT[:, 1 : L + 1])
    assert (at_t1[generated] - rollout_lp).abs().max() > 1e-2


def test_stops_at_eos_or_max_new_tokens(model):
    r = _generate(model, max_new_tokens=3)
    assert ((r.lengths_B - r.prompt_lens_B) <= 3).all()
    for b in range(3):
        if r.finished_B[b]:
            assert r.tokens_BT[b, r.lengths_B[b] - 1] == 2


def test_masked_tokens_are_not_dispatched(model):
    tokens = torch.randint(3, 40, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False  # right padding
    model.train()
    for moe in moe_layers(model):
        moe.tokens_per_expert_E.zero_()
    with torch.no_grad():
        full = model(tokens)
        with routing(model, token_mask_BL=mask):
            counts_before = moe_layers(model)[0].tokens_per_expert_E.clone()
            masked = model(tokens)
    counted = moe_layers(model)[0].tokens_per_expert_E - counts_before
    assert counted.sum().item() == mask.sum().item() * 2  # only real tokens, top-2
    torch.testing.assert_close(masked[mask], full[mask], rtol=1e-5, atol=1e-5)  # causal: pads never leak back


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, temperature=1.0, top_p=0.5, generator=g)) for _ in range(50)}
    assert draws == {0}
    draws = {int(sample(logits, temperature=1.0, top_p=0.85, generator=g)) for _ in range(200)}
    assert draws == {0, 1}
    assert int(sample(logits, temperature=0.0, top_p=1.0, generator=g)) == 0


def plus_one(task, example, completion):
    return 1.0 + len(completion)


def test_pluggable_reward():
    from titan_foremoe.data.tasks import Example, SortDigits

    ex = Example("sort:31=", "13")
    assert resolve_reward("task")(SortDigits(), ex, "13") == 1.0
    assert resolve_reward("exact_match")(SortDigits(), ex, "31") == 0.0
    assert resolve_reward("test_rollout:plus_one")(SortDigits(), ex, "ab") == 3.0
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward("no_such_module:fn")
    with pytest.raises(ValueError, match="expected one of"):
        resolve_reward("nonsense")
