"""Pre-flight checks (value ranges, folders, what a checkpoint can resume), one process, no workers.

Checkpoints here are real DCP folders written by ``torch.distributed.checkpoint.save``
with the keys our trainer writes; the interrupted-save case patches DCP's writer to
fail in ``finish`` (where it writes ``.metadata``) and asks torchtitan's own
``_find_load_step`` which step it would load.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import CheckpointManager

from titan_foremoe.config import ConfigError, load_config
from titan_foremoe.config.preflight import JobFinished, check_resume, latest_complete_step, preflight
from titan_foremoe.config.validate import validate

ROOT = Path(__file__).resolve().parents[1]
RL_CONFIG = ROOT / "train_configs" / "debug_tiny_rl.toml"


def _error(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(RL_CONFIG, list(overrides)), 4)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("--optimizer.beta1=2", "[optimizer] beta1: must be in [0, 1), got 2.0"),
        ("--optimizer.beta2=1", "[optimizer] beta2: must be in [0, 1)"),
        ("--optimizer.eps=0", "[optimizer] eps: must be finite and > 0"),
        ("--optimizer.weight_decay=-0.1", "[optimizer] weight_decay: must be finite and >= 0"),
        ("--optimizer.lr=inf", "[optimizer] lr: must be finite and >= 0"),
        ("--optimizer.lr=nan", "[optimizer] lr: must be finite and >= 0"),
        ("--lr_scheduler.min_lr_factor=-3", "[lr_scheduler] min_lr_factor: must be in [0, 1], got -3.0"),
        ("--rl.clip_eps=inf", "[rl] clip_eps: must be finite and > 0, got inf"),
        ("--rl.kl_coef=nan", "[rl] kl_coef: must be finite and >= 0"),
        ("--rl.temperature=inf", "[rl] temperature: must be finite and >= 0"),
        ("--training.max_norm=inf", "[training] max_norm: must be finite and > 0"),
        ("--checkpoint.keep_latest_k=1", "[checkpoint] keep_latest_k: must be 0 (keep all) or >= 2, got 1"),
        ("--training.nonfinite=ignore", "[training] nonfinite: must be one of 'stop', 'skip'"),
    ],
)
def test_value_ranges(override, expected):
    assert expected in _error([override])


def test_lr_zero_and_keep_all_are_legal():
    validate(load_config(RL_CONFIG, ["--optimizer.lr=0", "--checkpoint.keep_latest_k=0"]), 4)


def test_unwritable_dump_folder_exits_2_before_workers(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "titan_foremoe.config.check", str(RL_CONFIG), "--world-size", "4", "--preflight",
         f"--job.dump_folder={blocker}/out"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: [job] dump_folder:"), proc.stderr
    assert "not a writable folder" in lines[0]


def _cfg(dump, *overrides):
    return load_config(RL_CONFIG, [f"--job.dump_folder={dump}", "--checkpoint.enable=true",
                                   "--rl.sft_warmup_steps=1", "--training.steps=3", *overrides])


def _save(folder: Path, step: int, full: bool = True, kl: bool = False) -> None:
    """A DCP checkpoint with the keys our trainer writes (``full``) or a model-only export."""
    from titan_foremoe.config.preflight import expected_shapes

    shapes = expected_shapes(load_config(RL_CONFIG))  # the pre-flight checks the model's shapes
    state = {k: torch.ones(s) for k, s in shapes.items() if not k.startswith("job_state.")}
    if full:
        state |= {"train_state": {"step": torch.tensor(step)}, "optimizer": {"x": torch.zeros(2)}}
    if kl:
        state |= {"job_state": {"kl_reference": {"taken": torch.tensor(1)}}}
    dcp.save(state, checkpoint_id=str(folder / f"step-{step}"), no_dist=True)


def test_resume_checks(tmp_path):
    ckpt = tmp_path / "checkpoint"
    assert check_resume(_cfg(tmp_path)) == -1  # nothing saved: fresh start
    _save(ckpt, 2)
    assert preflight(_cfg(tmp_path)) == 2
    with pytest.raises(ConfigError, match=r"\[rl\] kl_coef: 0.5 needs the KL reference policy"):
        check_resume(_cfg(tmp_path, "--rl.kl_coef=0.5"))
    _save(ckpt, 3, full=False)  # a last_save_model_only export at step 3 of a 4-step job
    with pytest.raises(ConfigError, match=r"holds model weights only .* remove it to resume from the full "
                                          r"checkpoint step-2"):
        check_resume(_cfg(tmp_path))
    _save(ckpt, 4, full=False)  # the job's last step: finished, whatever the checkpoint holds
    with pytest.raises(JobFinished, match="job already finished: .*step-4 is step 4 of 4"):
        check_resume(_cfg(tmp_path))


def test_checkpoint_interrupted_mid_save_is_never_loaded(tmp_path, monkeypatch):
    _save(tmp_path, 1)

    def crash(self, *args, **kwargs):
        raise OSError("killed mid-save")

    monkeypatch.setattr(dcp.FileSystemWriter, "finish", crash)
    with pytest.raises(BaseException):  # DCP wraps it in a CheckpointException (a BaseException)
        _save(tmp_path, 2)
    partial = tmp_path / "step-2"
    assert any(partial.glob("*.distcp")) and not (partial / ".metadata").exists()  # data written, metadata last
    assert latest_complete_step(str(tmp_path)) == 1
    assert CheckpointManager._find_load_step(None, str(tmp_path)) == 1  # torchtitan's rule agrees
