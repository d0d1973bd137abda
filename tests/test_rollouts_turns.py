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
