"""``[rl] rollout_source = "vllm"`` and ``[rollout_engine]``: bad values are refused naming the key (no engine)."""

from __future__ import annotations

import sys

import pytest

from titan_foremoe.config import ConfigError, load_config
from titan_foremoe.config.validate import validate


def _check(tmp_path, hf, *extra):
    return validate(load_config("train_configs/qwen3_moe_hf_vllm.toml", [
        f"--job.dump_folder={tmp_path}", f"--model.hf_assets_path={hf}", *extra]), 2)


def test_engine_settings_are_checked(tmp_path):
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    hf = make_tiny_checkpoint(str(tmp_path / "tiny"), read_texts("examples/arithmetic_word_problems.jsonl"),
                              n_layers=2, head_dim=32)
    ok = f"--rollout_engine.python={sys.executable}"  # any existing interpreter passes the config check
    assert _check(tmp_path, hf, ok).rollout_sequences == 32
    with pytest.raises(ConfigError, match=r"\[rollout_engine\] python.*setup_vllm_cpu\.sh"):
        _check(tmp_path, hf, "--rollout_engine.python=/nonexistent/python")
    with pytest.raises(ConfigError, match=r"\[rollout_engine\] max_model_len"):
        _check(tmp_path, hf, ok, "--rollout_engine.max_model_len=8")
    with pytest.raises(ConfigError, match=r"\[rollout_engine\] concurrency"):
        _check(tmp_path, hf, ok, "--rollout_engine.concurrency=0")
    with pytest.raises(ConfigError, match=r"\[rollout_engine\] url"):
        _check(tmp_path, hf, "--rollout_engine.url=localhost:8000")
    with pytest.raises(ConfigError, match=r"\[rl\] rollout_source.*needs \[rl\] enable"):
        _check(tmp_path, hf, ok, "--rl.enable=false")
    # the engine fleet's keys (docs/rollouts_vllm.md, The engine fleet): one line each
    assert _check(tmp_path, hf, ok, "--rollout_engine.engines=2")
    assert _check(tmp_path, hf, "--rollout_engine.urls=http://a:1,http://b:2")
    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] engine_workers is now gpus_per_engine"):
        _check(tmp_path, hf, ok, "--rollout_engine.engine_workers=2")
    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] urls: set url .* or urls .*, not both"):
        _check(tmp_path, hf, "--rollout_engine.url=http://a:1", "--rollout_engine.urls=http://b:2")
    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] urls: 'b:2' is not an http URL"):
        _check(tmp_path, hf, "--rollout_engine.urls=http://a:1,b:2")
    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] engines: must be >= 0"):
        _check(tmp_path, hf, ok, "--rollout_engine.engines=-1")
    with pytest.raises(ConfigError, match=r"^\[sglang_engine\] engines: one SGLang server per job"):
        _check(tmp_path, hf, "--rl.rollout_source=sglang", "--sglang_engine.urls=http://a:1,http://b:2")


def test_preflight_names_an_engine_python_without_vllm(tmp_path):
    from titan_foremoe.config.preflight import check_engine_python

    with pytest.raises(ConfigError, match=r"\[rollout_engine\] python: .* lacks vllm titan_foremoe_vllm_cpu"):
        check_engine_python(sys.executable)  # the trainer's own venv has no vLLM
    with pytest.raises(ConfigError, match=r"\[rollout_engine\] python: /nonexistent/python does not run"):
        check_engine_python("/nonexistent/python")


class _Server:
    """A launched engine's server stand-in: dead or alive; ``start`` records the folder and answers on a new port."""

    def __init__(self, alive, launched):
        self.up, self.launched, self.starts = alive, launched, 1

    def alive(self):
        return self.up

    def start(self, folder):
        self.launched.append(folder)
        self.up, self.starts = True, self.starts + 1
        return f"http://127.0.0.1:{self.starts}"


class _Client:
    """Answers ``"<rank> <prompt> from <url>"`` per sample; the one on port 1 is gone for the ranks ``dead_for``."""

    def __init__(self, url, rank, calls, dead_for):
        self.url, self.rank, self.calls, self.dead_for = url, rank, calls, dead_for

    def _before_threads(self):
        self.calls.append(self.url)

    def _sample(self, prompt_ids, **kw):
        from titan_foremoe.rollouts.engines.vllm_server import EngineError

        if self.url.endswith(":1") and self.rank in self.dead_for:
            raise EngineError(f"vLLM at {self.url}/inference/v1/generate unreachable after 3 attempts")
        return type("C", (), {"token_ids": [0], "text": f"rank {self.rank} {prompt_ids[0]} from {self.url}"})()


def _dying_source(tmp_path, rank, alive, calls, launched, dead_for=(0, 1)):
    from titan_foremoe.config.job_config import JobConfig
    from titan_foremoe.rollouts.sources.vllm import VLLMSource

    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.rollout_engine.max_restarts = 1
    src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None, export=None,
                     policy_logprobs=None, rank=rank, dp_rank=rank)
    engine = src.engines[0]
    engine.connect = lambda url: setattr(engine, "client", _Client(url, rank, calls, dead_for))
    engine.connect("http://127.0.0.1:1")
    src.folder = "/weights/policy_1"
    if rank == 0:
        engine.server = _Server(alive, launched)
    return src


def _ask(src, rank):
    from titan_foremoe.rollouts.engines.vllm_server import EngineError

    reqs = [dict(prompt_ids=[p], n=1, max_tokens=1, temperature=1.0, top_p=1.0, seed=0) for p in "ab"]
    try:
        return [c.text for g in src._generate(reqs) for c in g]
    except EngineError as e:
        return f"raised {e}"


def test_a_dead_launched_engine_is_restarted_within_budget_then_a_clear_error(tmp_path):
    """Mid-step death of the only engine (no engine needed: stand-ins): the fleet has no survivor, so the engine
    is restarted at once on the folder being served and asked again, ``max_restarts`` times over the job; then
    the error names the URL."""
    calls, launched = [], []
    src = _dying_source(tmp_path, 0, False, calls, launched)
    assert _ask(src, 0) == ["rank 0 a from http://127.0.0.1:2", "rank 0 b from http://127.0.0.1:2"]
    assert launched == ["/weights/policy_1"] and calls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert src.restarts == 1 and src.timings["rollout/engine_0/failures"] == 1
    src.engines[0].connect("http://127.0.0.1:1")  # dies again: the budget (1 restart) is spent
    src.server.up = False
    out = _ask(src, 0)
    assert out.startswith("raised") and "127.0.0.1:1/inference/v1/generate unreachable" in out and "\n" not in out
    assert launched == ["/weights/policy_1"]


def _generation_death(rank: int, world_size: int, alive: bool, out: str) -> None:
    """One rank of the test below: rank 1's requests fail on the old URL (the engine died under them), rank 0's
    finished before the death."""
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo")
    calls, launched = [], []
    src = _dying_source(out, rank, alive, calls, launched, dead_for=(1,))
    result = _ask(src, rank)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"result": result, "calls": calls, "launched": launched, "restarts": src.restarts}, f)


@pytest.mark.parametrize("alive", [False, True])
def test_an_engine_death_under_another_ranks_generation_is_recovered_together(tmp_path, alive):
    """2 gloo ranks, one engine. The engine dies after rank 0's requests finished but under rank 1's: every rank
    agrees it is dead, rank 0 (its owner) restarts it, rank 1 (only) asks the new engine again, both go on. If
    the engine process is alive it is not restarted: every rank raises rank 1's error in one line (no rank waits
    in a collective)."""
    import json

    from distributed_helpers import run_ranks

    run_ranks(_generation_death, 2, alive, str(tmp_path), apply_patches=False)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    if not alive:
        assert r0["launched"] == ["/weights/policy_1"] and r0["restarts"] == 1
        assert r0["calls"] == ["http://127.0.0.1:1"]  # its own rows were answered: not asked again
        assert r0["result"] == ["rank 0 a from http://127.0.0.1:1", "rank 0 b from http://127.0.0.1:1"]
        assert r1["calls"] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        assert r1["result"] == ["rank 1 a from http://127.0.0.1:2", "rank 1 b from http://127.0.0.1:2"]
    else:
        for r in (r0, r1):
            assert r["result"].startswith("raised vLLM engine 0: rank 1: vLLM at "
                                          "http://127.0.0.1:1/inference/v1/generate unreachable"), r
        assert r0["launched"] == [] and r1["calls"] == ["http://127.0.0.1:1"]
