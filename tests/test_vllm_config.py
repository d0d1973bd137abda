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


def test_preflight_names_an_engine_python_without_vllm(tmp_path):
    from titan_foremoe.config.preflight import check_engine_python

    with pytest.raises(ConfigError, match=r"\[rollout_engine\] python: .* lacks vllm titan_foremoe_vllm_cpu"):
        check_engine_python(sys.executable)  # the trainer's own venv has no vLLM
    with pytest.raises(ConfigError, match=r"\[rollout_engine\] python: /nonexistent/python does not run"):
        check_engine_python("/nonexistent/python")


def test_a_dead_launched_engine_is_restarted_within_budget_then_a_clear_error(tmp_path):
    """Mid-step engine death (no engine needed: a stand-in server whose process is gone): the call is retried on
    a fresh engine on the folder being served, ``max_restarts`` times over the job, then the error names the URL."""
    from titan_foremoe.config.job_config import JobConfig
    from titan_foremoe.rollouts.engines.vllm_server import EngineError
    from titan_foremoe.rollouts.sources.vllm import VLLMSource

    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.rollout_engine.max_restarts = 1
    src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None, export=None,
                     policy_logprobs=None, rank=0, dp_rank=0)
    launched = []

    class DeadServer:
        spec = None

        def alive(self):
            return False

    class Client:
        def __init__(self, url):
            self.url = url

    src.server, src.client, src.folder = DeadServer(), Client("http://127.0.0.1:1"), "/weights/policy_1"
    src._launch = lambda folder: launched.append(folder) or "http://127.0.0.1:2"
    calls = []

    def generate(client):
        calls.append(client.url)
        if client.url.endswith(":1"):
            raise EngineError(f"vLLM at {client.url}/inference/v1/generate unreachable after 3 attempts")
        return "ok"

    assert src._engine_call(generate) == "ok"
    assert launched == ["/weights/policy_1"] and calls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    src.client = Client("http://127.0.0.1:1")  # dies again: the budget (1 restart) is spent
    with pytest.raises(EngineError, match=r"127\.0\.0\.1:1/inference/v1/generate unreachable"):
        src._engine_call(generate)
    assert launched == ["/weights/policy_1"]


def _generation_death(rank: int, world_size: int, alive: bool, out: str) -> None:
    """One rank of the test below: rank 1's requests fail on the old URL (the engine died under them), rank 0's
    finished before the death."""
    import json

    import torch.distributed as dist

    from titan_foremoe.config.job_config import JobConfig
    from titan_foremoe.rollouts.engines.vllm_server import EngineError
    from titan_foremoe.rollouts.sources.vllm import VLLMSource

    dist.init_process_group("gloo")
    cfg = JobConfig()
    cfg.rollout_engine.max_restarts = 1
    src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None, export=None,
                     policy_logprobs=None, rank=rank, dp_rank=rank)
    calls, launched = [], []

    class Server:
        def alive(self):
            return alive

    class Client:
        def __init__(self, url):
            self.url = url

        def generate_many(self, requests):
            calls.append(self.url)
            if rank == 1 and self.url.endswith(":1"):
                raise EngineError(f"vLLM at {self.url}/inference/v1/generate unreachable after 3 attempts")
            return [f"rank {rank} {r['p']} from {self.url}" for r in requests]

    src._connect = lambda url: setattr(src, "client", Client(url))
    src.client, src.folder = Client("http://127.0.0.1:1"), "/weights/policy_1"
    if rank == 0:
        src.server = Server()
        src._launch = lambda folder: launched.append(folder) or "http://127.0.0.1:2"
    try:
        result = src._generate([{"p": "a"}, {"p": "b"}])
    except EngineError as e:
        result = f"raised {e}"
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"result": result, "calls": calls, "launched": launched, "restarts": src.restarts}, f)


@pytest.mark.parametrize("alive", [False, True])
def test_an_engine_death_under_another_ranks_generation_is_recovered_together(tmp_path, alive):
    """2 gloo ranks. The engine dies after rank 0's requests finished but under rank 1's: rank 0 restarts it,
    rank 1 (only) asks the new engine again, both go on. If the engine is alive, rank 1's error is not a death:
    every rank raises it (no rank waits in a collective)."""
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
            assert r["result"].startswith(
                "raised EngineError: rank 1: vLLM at http://127.0.0.1:1/inference/v1/generate unreachable"), r
        assert r0["launched"] == [] and r1["calls"] == ["http://127.0.0.1:1"]
