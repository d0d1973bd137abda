"""Multi-turn records: routes stitched across turns from a prompt-start offset, assistant-only loss masks.

A conversation of T = 16 tokens: prompt [0, 4), assistant [4, 8), a tool result [8, 11) inserted by the
second turn, assistant [11, 16). Both engines' decoders must give back exactly the routes and tokens we
encoded, train exactly the assistant's tokens, and refuse an offset whose earlier positions no turn covers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titan_foremoe.rollouts import ModelSpec, RolloutStore, import_rollouts
from titan_foremoe.rollouts.formats import read_sglang, read_vllm, write_records, write_sglang
from titan_foremoe.rollouts.formats.vllm import write_vllm_turns
from titan_foremoe.rollouts.sample import RolloutError, RolloutSample, validate_sample

X, K, E, T, P = 3, 2, 8, 16, 4
CUT, TOOL = 8, 3  # turn 2's input adds tokens [8, 11): a tool result
ASSISTANT = np.zeros(T, bool)
ASSISTANT[4:8] = ASSISTANT[11:] = True


@pytest.fixture
def sample():
    rng = np.random.default_rng(0)
    routes = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(X)]) for _ in range(T - 1)])
    lp = np.where(np.arange(T) >= P, -rng.random(T), np.nan).astype(np.float32)
    return RolloutSample(rng.integers(1, 50, T), P, routes, lp, reward=1.0)


def _decode(fmt, s, start):
    if fmt == "sglang":
        rec = write_sglang(s, turns=[CUT], starts=[0, start], inserted=[TOOL])
        return rec, read_sglang(rec, "r", (X, K))
    rec = write_vllm_turns(s, [P, CUT, T], [0, start], [0, TOOL])
    return rec, read_vllm(rec, "r", (X, K))


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
@pytest.mark.parametrize("start", [0, 5, CUT - 1])  # turn 2's routes from 0, or from a cached prefix
def test_turns_stitch_and_train_only_the_assistant(fmt, start, sample):
    _, (got,) = _decode(fmt, sample, start)
    assert np.array_equal(got.tokens_T, sample.tokens_T) and got.prompt_len == P
    assert np.array_equal(got.routes_RXK, sample.routes_RXK)  # every position, tool tokens included, routed
    assert np.array_equal(got.loss_mask_T, ASSISTANT)
    assert np.isnan(got.logprobs_T[8:11]).all() and np.allclose(got.logprobs_T[ASSISTANT], sample.logprobs_T[ASSISTANT])
    validate_sample(got, ModelSpec(X, K, E, 50), "r")  # tool tokens need no behaviour log-prob


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_an_offset_past_the_earlier_turns_is_refused(fmt, sample):
    # turn 1 routes positions [0, 7); turn 2 starting at 8 leaves position 7 (turn 1's last token) unrouted
    with pytest.raises(RolloutError, match=r"positions 7\.\.7 have no earlier turn's routes") as e:
        _decode(fmt, sample, CUT)
    assert e.value.field.endswith("start_len" if fmt == "sglang" else "prompt_start")


def test_vllm_single_record_with_an_offset_is_refused(sample):
    rec = write_vllm_turns(sample, [P, T], [3], [0])["turns"][0]
    with pytest.raises(RolloutError, match="need the earlier turns' routes") as e:
        read_vllm(rec, "r", (X, K))
    assert e.value.field == "routed_experts_prompt_start"


def test_imported_mask_reaches_the_trainer(tmp_path, sample):
    """Through the store into a micro-batch: tool tokens are fed and routed, never in the loss."""
    from titan_foremoe.rollouts.generate import Rollout
    from titan_foremoe.routing_log import RoutingLog
    from titan_foremoe.train.rl_batches import build_micro_batch

    rec = write_vllm_turns(sample, [P, CUT, T], [0, 6], [0, TOOL])
    write_records(tmp_path / "in.jsonl", [rec])
    import_rollouts("vllm", [tmp_path / "in.jsonl"], tmp_path / "d", ModelSpec(X, K, E, 50))
    row = RolloutStore(tmp_path / "d").read(0)
    assert np.array_equal(row.loss_mask_T, ASSISTANT)
    tokens = torch.from_numpy(row.tokens_T)[None]
    rollout = Rollout(tokens, torch.tensor([P]), torch.tensor([T]), torch.from_numpy(row.logprobs_T)[None],
                      torch.tensor([True]), RoutingLog.from_sequences([torch.from_numpy(row.routes_RXK)], [T], E),
                      loss_mask_BT=torch.from_numpy(row.loss_mask_T)[None])
    mb = build_micro_batch(rollout, [0], torch.ones(1))
    assert mb.token_mask_BL.all()  # every input position, tool tokens included, goes through the experts
    assert torch.equal(mb.routes_BLXK[0], torch.from_numpy(sample.routes_RXK))
    assert torch.equal(mb.loss_mask_BL[0], torch.from_numpy(ASSISTANT[1:]))  # position p predicts token p + 1


def test_template_mask_matches_transformers_generation_markers():
    """Our mask needs no markers; transformers' ``return_assistant_tokens_mask`` over the same template with
    ``{% generation %}`` around the assistant's output is the oracle."""
    from titan_foremoe.data.tiny_hf import CHAT_TEMPLATE, build_tokenizer
    from titan_foremoe.rollouts.template_mask import chat_loss_mask

    messages = [{"role": "system", "content": "sort the digits"}, {"role": "user", "content": "3 1 2"},
                {"role": "assistant", "content": "call sort"}, {"role": "tool", "content": "1 2 3"},
                {"role": "assistant", "content": "\\boxed{ 1 2 3 }"}, {"role": "user", "content": "again 2 1"},
                {"role": "assistant", "content": "1 2"}]
    tok = build_tokenizer([m["content"] for m in messages] + ["call", "sort", "again", "tool"])
    ids, mask = chat_loss_mask(tok, messages, [tok.eos_token_id])
    marked = CHAT_TEMPLATE.replace(
        "{{ message['content'] }}<|im_end|>\n",
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}"
        "{% else %}{{ message['content'] }}<|im_end|>{% endif %}{{ '\\n' }}")  # the newline trim_blocks eats
    ref = tok.apply_chat_template(messages, chat_template=marked, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    assert ids.tolist() == list(ref["input_ids"])
    assert mask.tolist() == [bool(v) for v in ref["assistant_masks"]]
    assert 0 < mask.sum() < len(mask) and ids[mask].tolist().count(tok.eos_token_id) == 3  # each turn's end token


def test_template_mask_of_one_generated_turn_is_the_embedded_default():
    """An embedded rollout is one assistant turn after the templated prompt, ending at its EOS: the template's
    mask is then every completion token, which is what the trainer does with no mask (the old path)."""
    from titan_foremoe.data.tiny_hf import build_tokenizer
    from titan_foremoe.rollouts.template_mask import chat_loss_mask

    messages = [{"role": "user", "content": "3 1 2"}, {"role": "assistant", "content": "1 2 3"}]
    tok = build_tokenizer(["3 1 2", "1 2 3"])
    prompt = tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    ids, mask = chat_loss_mask(tok, messages, [tok.eos_token_id])
    end = ids.tolist().index(tok.eos_token_id, len(prompt)) + 1  # the rollout stops at its EOS
    assert ids[: len(prompt)].tolist() == prompt
    assert mask[:end].tolist() == [i >= len(prompt) for i in range(end)]
