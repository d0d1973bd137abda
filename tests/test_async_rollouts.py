"""Asynchronous RL's rules without an engine (the live run is in test_vllm_engine.py).

- which rollouts may be trained on (``staleness_problem``) and the config errors of ``[rl] max_staleness``;
- a checkpoint's in-flight rows resumed with a smaller ``max_staleness``: refused naming why, or generated again
  from the current weights for the *same* prompts (``[rl] stale_rollouts``);
- the engine dies while it generates the next step's rows in the background: the collection restarts it on the
  folder being served (the weights those rows are meant to come from) and asks again.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from titan_foremoe.config import ConfigError, load_config
from titan_foremoe.config.job_config import JobConfig
from titan_foremoe.config.validate import validate
from titan_foremoe.rollouts.engines.vllm_api import Completion
from titan_foremoe.rollouts.sources.vllm import StaleRollout, VLLMSource, staleness_problem, weights_label_problem

ROOT = Path(__file__).resolve().parents[1]


def test_staleness_rule():
    assert staleness_problem(5, 5, 0) is None and staleness_problem(5, 4, 1) is None
    assert "weights of step 3, 2 steps old; [rl] max_staleness is 1" in staleness_problem(5, 3, 1)
    assert "1 steps old; [rl] max_staleness is 0" in staleness_problem(5, 4, 0)
    assert "later step (6)" in staleness_problem(5, 6, 1)


def test_engine_weight_labels_must_name_the_rollouts_version():
    def c(spans):
        return Completion([1], [2, 3], [-1.0, -1.0], None, "stop", spans)

    assert weights_label_problem(c(None), 4) is None  # vLLM before 0.32 labels nothing
    assert weights_label_problem(c([("4", 0, 2)]), 4) is None
    assert "labelled ['3', '4'], expected those of step 4" in weights_label_problem(c([("3", 0, 1), ("4", 1, 2)]), 4)


def test_max_staleness_config_errors():
    def error(*overrides):
        with pytest.raises(ConfigError) as e:
            validate(load_config(ROOT / "train_configs/debug_tiny_rl.toml", list(overrides)), 4)
        return str(e.value)

    assert "[rl] max_staleness: overlaps generation" in error("--rl.max_staleness=1")  # the embedded source
    assert "must be >= 0" in error("--rl.max_staleness=-1")
    assert "at most 4 steps of rollouts in flight" in error("--rl.max_staleness=5", "--rl.rollout_source=vllm",
                                                             "--rl.rollout_is=token")
    assert "rollout_is = 'token' or 'sequence'" in error("--rl.max_staleness=1", "--rl.rollout_source=vllm")
    assert "staleness" not in error("--rl.max_staleness=1", "--rl.rollout_source=vllm", "--rl.rollout_is=token")
    need = "[rl] take_first_finished: takes finished groups from the steps in flight on live engines"
    assert need in error("--rl.take_first_finished=true")  # synchronous
    assert need in error("--rl.take_first_finished=true", "--rl.rollout_source=vllm")
    assert "take_first_finished" not in error("--rl.take_first_finished=true", "--rl.max_staleness=2",
                                              "--rl.rollout_source=vllm", "--rl.rollout_is=token")
    assert "[rl] plan_from_stream: prepares the next step" in error("--rl.plan_from_stream=true")
    assert "[rl] plan_from_stream: balanced owners" in error("--rl.plan_from_stream=true", "--rl.max_staleness=1",
                                                             "--rl.rollout_source=vllm", "--rl.rollout_is=token",
                                                             "--balance.owner_policy=balanced")
    assert "plan_from_stream" not in error("--rl.plan_from_stream=true", "--rl.max_staleness=1",
                                           "--rl.rollout_source=vllm", "--rl.rollout_is=token")


def _source(tmp_path, **rl) -> VLLMSource:
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.training.steps = 10
    for k, v in rl.items():
        setattr(cfg.rl, k, v)
    src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None, export=None,
                     policy_logprobs=None, rank=0, dp_rank=0)
    src._build = lambda f: setattr(f, "batch", ("batch", f.step, f.version, f.prompts, f.groups)) or f.batch
    return src


def _saved(folder: Path, step: int, version: int) -> Path:
    folder.mkdir(parents=True)
    with open(folder / "rank0000.pkl", "wb") as f:
        pickle.dump({"step": step, "version": version, "examples": ["ex"], "prompts": [[1, 2, 3]],
                     "groups": [["saved completion"]], "generate_s": 0.1}, f)
    return folder


@pytest.mark.parametrize("policy", ["error", "regenerate"])
def test_a_checkpoints_rows_resumed_with_a_smaller_max_staleness(tmp_path, policy):
    src = _source(tmp_path, max_staleness=0, stale_rollouts=policy)
    asked = []
    src.sync_weights, src.probe = (lambda only=None: None), (lambda ids: asked.append(("probe", ids)) or 0.0)
    src._generate = lambda requests: asked.append([r["prompt_ids"] for r in requests]) or [["fresh"]]
    src.prompts = type("P", (), {"prompts": lambda self, step: pytest.fail("the saved prompts are the step's")})()
    assert src.load_in_flight(str(_saved(tmp_path / "ck", step=3, version=2)), 3)
    if policy == "error":
        with pytest.raises(StaleRollout, match=r"step 3's rollout was generated by the weights of step 2, 1 steps "
                                               r"old; \[rl\] max_staleness is 0 .*'regenerate'"):
            src.next_batch(3)
        return
    batch = src.next_batch(3)
    assert batch == ("batch", 3, 3, [[1, 2, 3]], [["fresh"]])  # this step's weights, the saved prompts
    assert asked == [("probe", [1, 2, 3]), [[1, 2, 3]]]


def test_a_checkpoints_rows_within_max_staleness_are_trained_on(tmp_path):
    src = _source(tmp_path, max_staleness=1)
    src.sync_weights, src.probe = (lambda only=None: None), (lambda ids: 0.0)
    src._generate = lambda requests: pytest.fail("nothing to generate")
    src.start_ahead = lambda step: None  # the next steps' generation: not here
    assert src.load_in_flight(str(_saved(tmp_path / "ck", step=3, version=2)), 3)
    assert src.next_batch(3) == ("batch", 3, 2, [[1, 2, 3]], [["saved completion"]])
    assert not src.load_in_flight(str(tmp_path / "none"), 4)  # a synchronous run's checkpoint: nothing saved
    with pytest.raises(StaleRollout, match="holds step 3's rollout, resuming at step 4"):
        src.load_in_flight(str(tmp_path / "ck"), 4)


def test_engine_death_during_an_overlapped_rollout_is_recovered_on_the_weights_it_was_meant_for(tmp_path):
    from test_vllm_config import _Client, _Server

    src = _source(tmp_path, max_staleness=1)
    src.eng.max_restarts = 1
    launched, calls = [], []
    engine = src.engines[0]
    engine.connect = lambda url: setattr(engine, "client", _Client(url, 0, calls, (0,)))
    engine.connect("http://127.0.0.1:1")
    engine.server = _Server(False, launched)
    src.folder, src.version = "/weights/policy_0", 2
    src.prompts = type("P", (), {"prompts": lambda self, step: (["ex"], [[step, 7]])})()
    engine.version = 2
    src._start(3)  # in the background, from the weights of step 2
    assert src.poll(4) is None  # no rows started for step 4
    batch = src.poll(3, wait=True)
    step, version, prompts, groups = batch[1:]
    assert (step, version, prompts) == (3, 2, [[3, 7]]), batch
    assert [c.text for c in groups[0]] == ["rank 0 3 from http://127.0.0.1:2"] * src.cfg.rl.samples_per_prompt
    assert launched == ["/weights/policy_0"] and calls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert src.restarts == 1 and src.poll(3) is batch  # collected once
