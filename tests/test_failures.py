"""Issue 23: bad input fails early with one line naming what is wrong (pre-flight level, no workers)."""

from __future__ import annotations

from pathlib import Path

import os

import pytest

from titan_foremoe.config import ConfigError, load_config
from titan_foremoe.config.validate import validate
from test_rollouts_import import samples  # noqa: F401  (the debug model's rollout fixture)

ROOT = Path(__file__).resolve().parents[1]
RL = ROOT / "train_configs" / "debug_tiny_rl.toml"


def _error(overrides, world_size: int = 4, path=RL) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(path, list(overrides)), world_size)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_placement_needs_router_replay_and_bounded_spare_slots():
    for balancer in ("foremoe", "static", "reactive", "exact"):
        assert "[rl] router_replay: false needs [balance] balancer = 'off'" in _error(
            ["--rl.router_replay=false", f"--balance.balancer={balancer}"])
    validate(load_config(RL, ["--rl.router_replay=false", "--balance.balancer=off"]), 4)
    cfg = load_config(RL)
    r = validate(cfg, 4)
    most = r.num_experts - r.num_experts // r.ep
    validate(load_config(RL, [f"--balance.spare_slots={most}"]), 4)
    msg = _error([f"--balance.spare_slots={most + 1}"])
    assert f"[balance] spare_slots: {most + 1} exceeds what the model can use" in msg and f"at most {most}" in msg
    assert "[balance] spare_slots" in _error(["--balance.spare_slots=1000000"])


def test_worker_failures_name_the_root_cause(tmp_path):
    """DCP's CheckpointException (a BaseException) and OSErrors become one line naming the file or folder."""
    import errno

    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.api import CheckpointException

    from titan_foremoe.train.failures import describe, is_exit

    import torch

    missing = tmp_path / "step-3"
    missing.mkdir()
    torch.distributed.checkpoint.save({"w": torch.ones(4)}, checkpoint_id=str(missing))
    shard = next(p for p in missing.iterdir() if p.suffix == ".distcp")
    shard.unlink()
    with pytest.raises(BaseException) as e:
        load({"w": torch.zeros(4)}, storage_reader=FileSystemReader(str(missing)))
    assert isinstance(e.value, CheckpointException) and not isinstance(e.value, Exception)
    line = describe(e.value)
    assert "\n" not in line and "checkpoint read/write failed on ranks [0]" in line and shard.name in line
    full = describe(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ckpt" / "x.distcp")))
    assert "disk full" in full and str(tmp_path / "ckpt") in full
    ro = describe(PermissionError(errno.EACCES, "Permission denied", "/ro/events.out"))
    assert "permission denied" in ro and "folder /ro" in ro
    assert is_exit(SystemExit(0)) and is_exit(KeyboardInterrupt()) and not is_exit(e.value)


def test_entry_point_records_checkpoint_exception(tmp_path, monkeypatch):
    """torchelastic's error file (what torchrun prints as the root cause) names a BaseException's cause."""
    import json

    from torch.distributed.checkpoint.api import CheckpointException

    import titan_foremoe.train.rl_trainer  # noqa: F401  (imported before Trainer is replaced)
    import titan_foremoe.train.trainer as trainer_mod
    from titan_foremoe.train.__main__ import main

    def failing(cfg):
        raise CheckpointException("load failed", {1: (FileNotFoundError(2, "No such file", "/ck/step-2/__1_0.distcp"), None)})

    monkeypatch.setattr(trainer_mod, "Trainer", failing)
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(RuntimeError):
        main(["--job.config_file", str(ROOT / "train_configs" / "debug_tiny_cpu.toml")])
    message = json.loads(error_file.read_text())["message"]["message"]
    assert "failed at start-up: checkpoint read/write failed on ranks [1]" in message
    assert "/ck/step-2/__1_0.distcp" in message


def _save_checkpoint(cfg, step: int, **override_shapes) -> Path:
    """A DCP checkpoint holding this config's model tensors (zeros) and a step, as a trainer saves them."""
    import torch
    import torch.distributed.checkpoint as dcp

    from titan_foremoe.config.preflight import checkpoint_folder, expected_shapes

    state = {k: torch.zeros(override_shapes.get(k, s)) for k, s in expected_shapes(cfg).items()
             if not k.startswith("job_state.")}
    state["train_state.step"] = torch.tensor(step)
    path = Path(checkpoint_folder(cfg)) / f"step-{step}"
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _ckpt_cfg(tmp_path, *extra):
    return load_config(ROOT / "train_configs" / "debug_tiny_cpu.toml",
                       ["--checkpoint.enable=true", f"--job.dump_folder={tmp_path}", "--training.steps=10", *extra])


def test_preflight_checks_checkpoint_against_the_model(tmp_path):
    from titan_foremoe.config.preflight import check_resume

    cfg = _ckpt_cfg(tmp_path)
    _save_checkpoint(cfg, 1)
    latest = _save_checkpoint(cfg, 2)
    assert check_resume(cfg) == 2

    def refused(*extra) -> str:
        with pytest.raises(ConfigError) as e:
            check_resume(_ckpt_cfg(tmp_path, *extra))
        assert "\n" not in str(e.value)
        return str(e.value)

    r = validate(cfg, 4)
    msg = refused(f"--model.num_experts={2 * r.num_experts}")
    assert f"{latest} cannot serve this job: layers.0.moe.routed_experts.inner_experts.w1_EFD was saved with shape" in msg
    assert "no older complete checkpoint passes" in msg
    assert "which this config's model has not" in refused(f"--model.n_layers={r.n_layers - 1}")
    assert f"it lacks layers.{r.n_layers}." in refused(f"--model.n_layers={r.n_layers + 1}")

    shard = sorted(latest.glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    msg = refused()
    assert f"shard file {shard} is truncated" in msg and "step-1 passes these checks" in msg
    assert "--checkpoint.load_step=1" in msg
    assert check_resume(_ckpt_cfg(tmp_path, "--checkpoint.load_step=1")) == 1
    shard.unlink()
    assert f"shard file {shard} is missing" in refused()
    (latest / ".metadata").write_bytes(b"not a pickle")
    msg = refused()
    assert "cannot read" in msg and ".metadata" in msg and "--checkpoint.load_step=1" in msg
    assert "[checkpoint] load_step: " in refused("--checkpoint.load_step=5")


def test_preflight_compares_model_facts_dcp_does_not_hold(tmp_path):
    """top_k (and the other facts in model_facts.json) changed since the checkpoint: refused, naming the key;
    a checkpoint saved before the file existed still passes (its tensor shapes are checked as before)."""
    from titan_foremoe.config.preflight import (
        MODEL_FACTS_FILE, check_resume, checked_model_args, model_facts, write_model_facts)

    cfg = _ckpt_cfg(tmp_path)
    old = _save_checkpoint(cfg, 1)  # no model_facts.json: saved by an older version
    top_k = checked_model_args(cfg).top_k
    assert check_resume(_ckpt_cfg(tmp_path, f"--model.top_k={top_k + 2}")) == 1
    latest = _save_checkpoint(cfg, 2)
    write_model_facts(str(latest), model_facts(checked_model_args(cfg)))
    assert check_resume(cfg) == 2
    with pytest.raises(ConfigError) as e:
        check_resume(_ckpt_cfg(tmp_path, f"--model.top_k={top_k + 2}"))
    assert str(e.value) == (
        f"[checkpoint] folder: {latest} cannot serve this job: it was saved by a model with top_k = {top_k}, this "
        f"config builds top_k = {top_k + 2} ([model] top_k); the older complete checkpoint step-1 passes these "
        "checks: resume from it with --checkpoint.load_step=1")
    (latest / MODEL_FACTS_FILE).write_text("{")
    with pytest.raises(ConfigError, match=f"cannot read {latest / MODEL_FACTS_FILE}"):
        check_resume(cfg)
    assert old.is_dir()


def test_rollout_import_paths_and_stale_folders(tmp_path, samples, capsys):
    """Path errors are one line with exit 2; a killed import's hidden folder goes at the next import."""
    import subprocess
    import sys

    from test_rollouts_import import SPEC  # noqa: F401  (the same spec as the samples fixture)

    from titan_foremoe.rollouts import RolloutStore, import_rollouts
    from titan_foremoe.rollouts.__main__ import main as cli
    from titan_foremoe.rollouts.export import write_engine_file

    good = tmp_path / "in.jsonl"
    write_engine_file("vllm", samples, good, samples_per_prompt=2)
    spec = ["--num-layers", "4", "--top-k", "2", "--num-experts", "8", "--vocab-size", "64"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    for args, words in [([str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o1")], "nope.jsonl: input not found"),
                        ([str(tmp_path), "--out", str(tmp_path / "o2")], "input is a folder"),
                        ([str(good), "--out", str(afile / "sub" / "out")], f"{afile}: --out is under a file")]:
        assert cli(["import", "--format", "vllm", *args, *spec]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err, err
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs, as a killed import's
    stale = tmp_path / f".rollouts.importing-{dead.pid}"
    stale.mkdir()
    (stale / "tokens.npy").write_bytes(b"partial")
    live = tmp_path / f".rollouts.importing-{os.getppid()}"  # a running process's import is left alone
    live.mkdir()
    import_rollouts("vllm", [good], tmp_path / "rollouts", SPEC)
    assert not stale.exists() and live.exists()

    # damage names the file (and the row)
    out = tmp_path / "rollouts"
    shard = next(out.glob("*/tokens.npy"))
    shard.write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(ValueError, match=f"{shard}: damaged .npy"):
        RolloutStore(out).read(0)
    (out / "index.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"index.json: damaged"):
        RolloutStore(out)


def test_rollout_row_damage_names_the_row(tmp_path, samples):
    import numpy as np

    from test_rollouts_import import SPEC

    from titan_foremoe.rollouts import RolloutStore, import_rollouts
    from titan_foremoe.rollouts.export import write_engine_file

    write_engine_file("vllm", samples, tmp_path / "in.jsonl", samples_per_prompt=2)
    import_rollouts("vllm", [tmp_path / "in.jsonl"], tmp_path / "r", SPEC)
    offsets = next((tmp_path / "r").glob("*/offsets.npy"))
    o = np.load(offsets)
    o[2] = 10**9  # row 1 ends past its tokens, row 2 starts there
    np.save(offsets, o)
    store = RolloutStore(tmp_path / "r")
    store.read(0)
    with pytest.raises(ValueError, match=r"row 2 is damaged"):
        store.read(2)


def test_failed_tensorboard_write_is_reported_once_and_training_goes_on(tmp_path, caplog):
    import errno

    import torch
    from torchtitan.components.metrics import TensorBoardLogger

    from titan_foremoe.metrics.guarded import GuardedLogger
    from titan_foremoe.metrics.heatmap import log_heatmap

    inner = TensorBoardLogger(str(tmp_path / "tb"))
    guarded = GuardedLogger(inner, str(tmp_path / "tb"))
    guarded.log({"loss": 1.0}, 1)
    log_heatmap(guarded, "load", torch.ones(2, 4), 1)
    calls = []

    def fail(*args, **kwargs):  # what a read-only or full events file raises from SummaryWriter
        calls.append(args)
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "tb" / "events.out"))

    inner.writer.add_scalar = fail
    inner.writer.add_image = fail
    with caplog.at_level("ERROR", logger="titan_foremoe"):
        for step in range(2, 5):
            guarded.log({"loss": 1.0}, step)
            log_heatmap(guarded, "load", torch.ones(2, 4), step)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("metrics: writing")]
    assert len(lines) == 1 and str(tmp_path / "tb") in lines[0] and "training goes on" in lines[0]
    assert len(calls) == 1  # later writes are dropped, not retried
    guarded.close()


def test_preflight_loads_the_tokenizer_and_requires_a_chat_template(tmp_path, capsys):
    import json
    import shutil

    from titan_foremoe.config.check import main as check
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    data = str(ROOT / "examples/arithmetic_word_problems.jsonl")
    hf = Path(make_tiny_checkpoint(str(tmp_path / "tiny"), read_texts(data), n_layers=2))
    config = str(ROOT / "train_configs" / "qwen3_moe_hf_grpo.toml")

    def run(folder, *extra) -> tuple[int, str]:
        code = check([config, "--world-size", "4", f"--model.hf_assets_path={folder}", *extra])
        err = capsys.readouterr().err.strip()
        assert "\n" not in err
        return code, err

    assert run(hf)[0] == 0
    plain = tmp_path / "plain"
    shutil.copytree(hf, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((plain / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tc))
    code, err = run(plain)
    assert code == 2 and "the tokenizer has no chat template" in err and "chat_template = 'none'" in err
    assert run(plain, "--data.chat_template=none")[0] == 0
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    assert run(plain, f"--data.chat_template={template}")[0] == 0
    code, err = run(plain, f"--data.chat_template={tmp_path / 'missing.jinja'}")
    assert code == 2 and err.startswith("config error: [data] chat_template: cannot read")

    (plain / "tokenizer.json").unlink()
    code, err = run(plain, "--data.chat_template=none")
    assert code == 2 and f"[model] hf_assets_path: {plain} has no tokenizer file" in err
    (plain / "tokenizer.json").write_text("{ damaged")
    code, err = run(plain, "--data.chat_template=none")
    assert code == 2 and "cannot load the tokenizer" in err


def test_hf_weight_check_reads_every_expected_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    hf = Path(make_tiny_checkpoint(str(tmp_path / "tiny"), read_texts(str(ROOT / "examples/arithmetic_word_problems.jsonl")),
                                   n_layers=2))
    over = [f"--model.hf_assets_path={hf}", "--checkpoint.enable=true", "--checkpoint.initial_load_in_hf=true"]
    config = ROOT / "train_configs" / "qwen3_moe_hf_grpo.toml"
    validate(load_config(config, over), 4)
    weights = load_file(hf / "model.safetensors")
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"  # neither layer 0, the last expert, nor a gate/down
    del weights[gone]
    save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    msg = _error(over, path=config)
    assert msg.startswith("[model] hf_assets_path:") and f"tensor {gone} is missing" in msg
