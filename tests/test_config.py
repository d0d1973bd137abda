"""Bad configuration is refused with one line naming the key, before workers start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_foremoe.config import ConfigError, load_config
from titan_foremoe.config.job_config import JobConfig
from titan_foremoe.config.validate import validate

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "train_configs" / "debug_tiny_cpu.toml"


def _error(tmp_path, toml: str | None = None, overrides=(), world_size: int = 4) -> str:
    path = None
    if toml is not None:
        path = tmp_path / "bad.toml"
        path.write_text(toml)
    with pytest.raises(ConfigError) as e:
        validate(load_config(path, list(overrides)), world_size)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_every_shipped_config_is_valid(tmp_path, monkeypatch):
    configs = sorted((ROOT / "train_configs").glob("*.toml"))
    assert configs
    world = {"qwen3_30b_a3b_grpo.toml": 64}  # the 64-GPU jobs; the debug ones run on 4 ranks
    tiny_hf = standin = None
    for path in configs:
        overrides = []
        if path.name.startswith("qwen3_30b_a3b_hf"):  # the real model's folder: its stand-in (real config.json)
            if standin is None:
                from hf_standin import make_qwen3_30b_a3b_standin

                standin = make_qwen3_30b_a3b_standin(tmp_path / "qwen3_30b_a3b")
            overrides = [f"--model.hf_assets_path={standin}"]
            world[path.name] = 64
        elif load_config(path).model.hf_assets_path:  # a folder the README says to make first: make it here
            if tiny_hf is None:
                from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

                data = str(ROOT / "examples/arithmetic_word_problems.jsonl")
                tiny_hf = make_tiny_checkpoint(str(tmp_path / "tiny"), read_texts(data), n_layers=2)
            overrides = [f"--model.hf_assets_path={tiny_hf}"]
        cfg = load_config(path, overrides)
        if cfg.rl.rollout_source == "vllm" and cfg.rollout_engine.weight_sync == "ipc":  # GPU-only (colocated):
            from titan_foremoe.config import validate as v  # checked as on its GPUs, with an engine python here

            cfg = load_config(path, [*overrides, f"--rollout_engine.python={sys.executable}"])
            with monkeypatch.context() as m:
                m.setattr(v, "_job_device_type", lambda: "cuda")
                validate(cfg, world.get(path.name, 4))
            continue
        validate(cfg, world.get(path.name, 4))


def test_defaults_resolve_micro_steps():
    r = validate(load_config(DEFAULT), 4)
    assert (r.dp_shard, r.ep, r.micro_steps, r.global_batch_size) == (4, 4, 2, 64)


def test_unknown_section(tmp_path):
    assert "unknown section [modle]" in _error(tmp_path, "[modle]\nflavor = 'debug_tiny'\n")


def test_unknown_key(tmp_path):
    msg = _error(tmp_path, "[training]\nstep = 3\n")
    assert "[training] unknown key 'step'" in msg


def test_wrong_type(tmp_path):
    assert "[training] steps: expected int, got '10'" in _error(tmp_path, "[training]\nsteps = '10'\n")
    assert "[metrics] enable_tensorboard: expected bool" in _error(
        tmp_path, overrides=["--metrics.enable_tensorboard=maybe"]
    )
    assert "[model] expert_dtype: must be one of 'bfloat16', 'float32'" in _error(
        tmp_path, overrides=["--model.expert_dtype=fp8"]
    )


def test_experts_not_divisible_by_ep(tmp_path):
    msg = _error(tmp_path, overrides=["--model.num_experts=6", "--parallelism.expert_parallel_degree=4"])
    assert "[parallelism] expert_parallel_degree" in msg and "experts 6 is not divisible by EP degree 4" in msg


def test_ep_not_dividing_world_size(tmp_path):
    msg = _error(tmp_path, overrides=["--parallelism.expert_parallel_degree=4"], world_size=6)
    assert "EP degree 4 does not divide the world size 6" in msg


def test_top_k_exceeds_experts(tmp_path):
    msg = _error(tmp_path, overrides=["--model.top_k=9"])
    assert "[model] top_k" in msg and "top_k (9) exceeds the number of experts (8)" in msg


def test_batch_and_sequence_checks(tmp_path):
    assert "[training] global_batch_size" in _error(tmp_path, overrides=["--training.global_batch_size=10"])
    assert "[training] seq_len" in _error(tmp_path, overrides=["--training.seq_len=8"])
    assert "[training] steps: must be >= 1" in _error(tmp_path, overrides=["--training.steps=0"])
    assert "[optimizer] lr: must be finite and >= 0" in _error(tmp_path, overrides=["--optimizer.lr=-1"])
    # a token budget a sequence of seq_len could not fit in, or one padded rows would exceed: refused in one line
    msg = _error(tmp_path, overrides=["--training.max_tokens_per_micro_step=10"])
    assert msg.startswith("[training] max_tokens_per_micro_step: 10 is below seq_len"), msg
    msg = _error(tmp_path, overrides=["--training.max_tokens_per_micro_step=4096", "--training.pack_sequences=false"])
    assert msg.startswith("[training] max_tokens_per_micro_step:") and "pack_sequences" in msg, msg


def test_compile_needs_bf16_experts(tmp_path):
    msg = _error(tmp_path, overrides=["--compile.enable=true", "--model.expert_dtype=float32"])
    assert msg.startswith("[compile] enable:") and "bfloat16" in msg
    validate(load_config(DEFAULT, ["--compile.enable=true", "--model.expert_dtype=bfloat16"]), 4)


def test_rl_checks(tmp_path):
    rl = ["--rl.enable=true"]
    assert "[rl] samples_per_prompt: group-relative" in _error(tmp_path, overrides=rl + ["--rl.samples_per_prompt=1"])
    assert "do not split into groups of 3" in _error(tmp_path, overrides=rl + ["--rl.samples_per_prompt=3"])
    assert "[rl] top_p: must be in (0, 1]" in _error(tmp_path, overrides=rl + ["--rl.top_p=0"])
    assert "[rl] clip_eps" in _error(tmp_path, overrides=rl + ["--rl.clip_eps=0"])
    assert "[training] seq_len" in _error(tmp_path, overrides=rl + ["--rl.max_new_tokens=60"])
    assert "[rl] reward_fn" in _error(tmp_path, overrides=rl + ["--rl.reward_fn=nope"])
    r = validate(load_config(ROOT / "train_configs" / "debug_tiny_rl.toml"), 4)
    assert r.rollout_sequences == 128


def test_balance_checks(tmp_path):
    on = ["--rl.enable=true", "--balance.balancer=foremoe", "--parallelism.expert_parallel_degree=4"]
    assert "[balance] balancer: run-time placement needs [rl] enable" in _error(
        tmp_path, overrides=["--balance.balancer=foremoe", "--parallelism.expert_parallel_degree=4"])
    assert "needs expert_parallel_degree > 1" in _error(tmp_path, overrides=on[:2] + ["--parallelism.expert_parallel_degree=1"])
    # EP borrows from dp_shard (torchtitan's efsdp = dp_shard / EP), with or without dp_replicate
    for extra in ([], ["--parallelism.data_parallel_replicate_degree=2"]):
        r = validate(load_config(DEFAULT, on[:2] + ["--parallelism.expert_parallel_degree=2", *extra]), 4)
        assert (r.ep, r.dp_shard * r.dp_replicate) == (2, 4)
    assert "EP degree 4 must divide the data-parallel shard degree 2" in _error(
        tmp_path, overrides=on + ["--parallelism.data_parallel_replicate_degree=2"])
    assert "[balance] ranks_per_node: 3 does not divide" in _error(tmp_path, overrides=on + ["--balance.ranks_per_node=3"])
    assert "[compile] enable: torch.compile needs [model] expert_dtype = 'bfloat16'" in _error(
        tmp_path, overrides=on + ["--compile.enable=true", "--model.expert_dtype=float32"])
    validate(load_config(ROOT / "train_configs" / "debug_tiny_rl.toml",
                         ["--compile.enable=true", "--model.expert_dtype=bfloat16"]), 4)
    assert "[balance] transfer_path: must be one of" in _error(tmp_path, overrides=on + ["--balance.transfer_path=nvme"])
    validate(load_config(ROOT / "train_configs" / "debug_tiny_rl.toml", ["--balance.balancer=reactive"]), 4)
    validate(load_config(ROOT / "train_configs" / "debug_tiny_rl.toml", ["--balance.balancer=exact"]), 4)
    assert "[balance] balancer: 'exact' duplicates experts inside one NVLink domain" in _error(
        tmp_path, overrides=on + ["--balance.balancer=exact", "--balance.ranks_per_node=2"])
    msg = _error(tmp_path, overrides=on + ["--balance.balancer=llep"])
    assert "[balance] balancer: must be one of" in msg and "reactive" in msg
    assert "[balance] owner_policy: 'balanced' owners are planned by balancer = 'foremoe', not 'eplb_oracle'" in _error(
        tmp_path, overrides=on + ["--balance.balancer=eplb_oracle", "--balance.owner_policy=balanced"])
    assert "[balance] owner_hysteresis: must be >= 0" in _error(
        tmp_path, overrides=on + ["--balance.owner_policy=balanced", "--balance.owner_hysteresis=-1"])
    validate(load_config(ROOT / "train_configs" / "debug_tiny_rl.toml", ["--balance.owner_policy=balanced"]), 4)
    validate(load_config(ROOT / "train_configs" / "debug_tiny_rl.toml", ["--balance.slot_overhead_tokens=900"]), 4)
    validate(load_config(ROOT / "train_configs" / "debug_tiny_rl.toml", ["--balance.pass_polish=true"]), 4)
    assert "pass_polish" in _error(tmp_path, overrides=on + ["--balance.pass_polish=maybe"])
    lev = load_config(ROOT / "train_configs" / "debug_tiny_rl.toml",
                      ["--balance.slot_cost_starts=0.5,1,2", "--balance.polish_chain_depth=3"])
    validate(lev, 4)
    assert lev.balance.slot_cost_starts == [0.5, 1.0, 2.0] and lev.balance.polish_chain_depth == 3
    assert "[balance] slot_cost_starts: must be a non-empty list of positive multiples" in _error(
        tmp_path, overrides=on + ["--balance.slot_cost_starts=1,0"])
    assert "[balance] polish_chain_depth: must be an int >= 1" in _error(
        tmp_path, overrides=on + ["--balance.polish_chain_depth=0"])
    assert "[balance] prefetch_window_layers: must be >= 0" in _error(
        tmp_path, overrides=on + ["--balance.prefetch_window_layers=-1"])


def test_bad_override_syntax_and_missing_file(tmp_path):
    assert "expected --section.key=value" in _error(tmp_path, overrides=["--steps=3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="invalid TOML"):
        (tmp_path / "broken.toml").write_text("[job\n")
        load_config(tmp_path / "broken.toml")


def test_overrides_are_typed():
    cfg = load_config(DEFAULT, ["--training.steps", "7", "--optimizer.lr=1e-3", "--model.top_k=4"])
    assert (cfg.training.steps, cfg.optimizer.lr, cfg.model.top_k) == (7, 1e-3, 4)


def test_run_train_rejects_bad_config_before_workers(tmp_path):
    """Exit code 2 and a single stderr line; no torchrun, no worker."""
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": "4"}
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), "--model.num_experts=6"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [
        "config error: [parallelism] expert_parallel_degree: number of experts 6 is not divisible by EP degree 4"
    ]
    assert "torch.distributed" not in proc.stdout + proc.stderr


def test_home_in_paths_is_expanded():
    """Issue 31: ``--job.dump_folder=~/x`` (the shell leaves ``~`` after ``=`` alone) made a folder named ``~``."""
    cfg = load_config(DEFAULT, ["--job.dump_folder=~/runs/x", "--data.path=~/d.jsonl"])
    assert (cfg.job.dump_folder, cfg.data.path) == (os.path.expanduser("~/runs/x"), os.path.expanduser("~/d.jsonl"))


def test_relative_config_file_is_read_from_where_the_user_stands(tmp_path):
    """Issue 31: ``CONFIG_FILE=my.toml`` was looked up in the repository; now in the current folder first (the
    shipped ``./train_configs/...`` still resolve from the repository), and a missing one names both places."""
    (tmp_path / "my.toml").write_text(DEFAULT.read_text().replace('flavor = "debug_tiny"',
                                                                  'flavor = "debug_tiny"\nnum_experts = 6'))
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": "4"}
    run = lambda config: subprocess.run([str(ROOT / "run_train.sh")], cwd=tmp_path, env={**env, "CONFIG_FILE": config},
                                        capture_output=True, text=True, timeout=120)
    proc = run("my.toml")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "config error: [parallelism] expert_parallel_degree: number of experts 6 is not divisible by EP degree 4")
    proc = run("nope.toml")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"config error: CONFIG_FILE nope.toml: no such file in {tmp_path} nor in the repository {ROOT}")


def test_activation_checkpoint_checks(tmp_path):
    rl = ["--rl.enable=true", "--compile.enable=true", "--model.expert_dtype=bfloat16"]
    for mode in ("none", "full"):
        validate(load_config(ROOT / "train_configs" / "debug_tiny_rl.toml",
                             [*rl, f"--activation_checkpoint.mode={mode}"]), 4)
    validate(load_config(DEFAULT, ["--compile.enable=true", "--model.expert_dtype=bfloat16",
                                   "--activation_checkpoint.mode=selective"]), 4)  # SFT: compiled inside the wrapper
    assert "[activation_checkpoint] mode: 'selective' under RL's torch.compile" in _error(
        tmp_path, overrides=[*rl, "--activation_checkpoint.mode=selective"])
    with pytest.raises(ConfigError, match="activation_checkpoint"):
        load_config(DEFAULT, ["--activation_checkpoint.mode=sometimes"])
    # the 64-GPU job checkpoints every block (docs/memory.md: 106 -> 17 GiB per rank at seq_len 4096)
    assert load_config(ROOT / "train_configs" / "qwen3_30b_a3b_grpo.toml").activation_checkpoint.mode == "full"


def test_slot_overhead_tokens_auto_or_int(tmp_path):
    """``[balance] slot_overhead_tokens``: "auto" (default) or an int >= 0, from TOML or the CLI; anything else is
    refused naming the key; ``slot_cost_device`` only a measured calibration."""
    tiny = ROOT / "train_configs" / "debug_tiny_rl.toml"
    assert (JobConfig().balance.slot_overhead_tokens, JobConfig().balance.slot_cost_device) == ("auto", "h100")
    for value, want in (("auto", "auto"), ("0", 0), ("900", 900)):
        cfg = load_config(tiny, [f"--balance.slot_overhead_tokens={value}", "--balance.slot_cost_device=h200"])
        validate(cfg, 4)
        assert (cfg.balance.slot_overhead_tokens, cfg.balance.slot_cost_device) == (want, "h200")
    on = ["--rl.enable=true", "--balance.balancer=foremoe", "--parallelism.expert_parallel_degree=4"]
    for toml, want in (('slot_overhead_tokens = "auto"', "auto"), ("slot_overhead_tokens = 120", 120)):
        path = tmp_path / "ok.toml"
        path.write_text(f"[balance]\n{toml}\n")
        assert load_config(path).balance.slot_overhead_tokens == want
    for bad in ("fast", "1.5", "true"):
        assert _error(tmp_path, overrides=on + [f"--balance.slot_overhead_tokens={bad}"]) == (
            f"[balance] slot_overhead_tokens: expected 'auto' | int, got {bad!r}")
    for toml in ('slot_overhead_tokens = "fast"', "slot_overhead_tokens = 1.5", "slot_overhead_tokens = true"):
        assert "[balance] slot_overhead_tokens: expected 'auto' | int, got" in _error(
            tmp_path, toml=f"[balance]\n{toml}\n", overrides=on)
    msg = _error(tmp_path, overrides=on + ["--balance.slot_overhead_tokens=-5"])
    assert msg.startswith('[balance] slot_overhead_tokens: must be "auto"') and "int >= 0" in msg and "-5" in msg
    assert "[balance] slot_cost_device: must be one of 'h100', 'h200'" in _error(
        tmp_path, overrides=on + ["--balance.slot_cost_device=a100"])
    for field, value in (("slot_overhead_tokens", "fast"), ("slot_cost_device", "a100")):  # set in code: validate
        cfg = load_config(None, on)
        setattr(cfg.balance, field, value)
        with pytest.raises(ConfigError, match=rf"^\[balance\] {field}: must be"):
            validate(cfg, 4)
