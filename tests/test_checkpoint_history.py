"""Checkpoints as an atomic, linear history, and their integrity (issue 40).

Unit level: the pre-flight on real DCP folders (``dcp.save``, one process) with the checksums a save records.
End to end (``run_train.sh``, 2 gloo ranks, the recovery tests' tiny RL job): a resume from an older step of a
finished job, killed inside its first save, is resumed by a plain rerun from the new branch; a corrupted shard
of the step a load reads is named in one line with the step to resume from instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_foremoe.config import ConfigError, load_config
from titan_foremoe.config import checksums
from titan_foremoe.config.preflight import JobFinished, check_resume, expected_shapes, latest_complete_step
from titan_foremoe.train.checkpoints import abandon_newer

ROOT = Path(__file__).resolve().parents[1]
RL_CONFIG = ROOT / "train_configs" / "debug_tiny_rl.toml"
TINY = [
    "--parallelism.expert_parallel_degree=2", "--model.n_layers=2", "--training.local_batch_size=4",
    "--training.global_batch_size=8", "--rl.samples_per_prompt=4", "--rl.sft_warmup_steps=1",
    "--checkpoint.enable=true", "--checkpoint.interval=1", "--checkpoint.keep_latest_k=0",
    "--metrics.enable_tensorboard=false",
]


def _cfg(dump, *overrides):
    return load_config(RL_CONFIG, [f"--job.dump_folder={dump}", "--checkpoint.enable=true",
                                   "--rl.sft_warmup_steps=1", "--training.steps=3", *overrides])


def _save(folder: Path, step: int) -> Path:
    """A full DCP checkpoint with our keys, and the checksums a save records (every file: one rank here)."""
    shapes = expected_shapes(load_config(RL_CONFIG))
    state = {k: torch.full(s, float(step)) for k, s in shapes.items() if not k.startswith("job_state.")}
    state |= {"train_state": {"step": torch.tensor(step)}, "optimizer": {"x": torch.zeros(2)}}
    path = folder / f"step-{step}"
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    checksums.write_checksums(str(path), checksums.records(str(path), checksums.owned_files(str(path), 0)))
    return path


def _zero(file: Path) -> None:
    file.write_bytes(b"\0" * file.stat().st_size)  # same size, zeroed: what a bad disk block or copy leaves


def test_load_step_below_a_finished_job_is_honoured(tmp_path):
    for step in (2, 4):
        _save(tmp_path / "checkpoint", step)
    with pytest.raises(JobFinished):
        check_resume(_cfg(tmp_path))
    assert check_resume(_cfg(tmp_path, "--checkpoint.load_step=2")) == 2  # was "job already finished"
    with pytest.raises(JobFinished):
        check_resume(_cfg(tmp_path, "--checkpoint.load_step=4"))


def test_abandoned_and_staging_folders_are_never_the_latest(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    (tmp_path / "step-5.saving").mkdir()  # a crashed save
    (tmp_path / "step-5.saving" / ".metadata").write_text("")
    aside = abandon_newer(str(tmp_path), 1)
    assert [re.sub(r"-\d{8}-\d{6}$", "", os.path.basename(p)) for p in aside] == ["step-2.abandoned",
                                                                                 "step-3.abandoned"]
    assert latest_complete_step(str(tmp_path)) == 1
    from torchtitan.components.checkpoint import CheckpointManager

    # torchtitan's own rule (re.search) would take the abandoned branch: ours does not
    assert CheckpointManager._find_load_step(None, str(tmp_path)) == 5
    from titan_foremoe.train.checkpoints import AtomicCheckpointManager

    assert AtomicCheckpointManager._find_load_step(None, str(tmp_path)) == 1


def test_corrupt_shard_is_named_with_the_step_that_verifies(tmp_path):
    ckpt = tmp_path / "checkpoint"
    _save(ckpt, 1)
    path = _save(ckpt, 2)
    assert check_resume(_cfg(tmp_path)) == 2
    (shard,) = path.glob("__*.distcp")
    _zero(shard)
    with pytest.raises(ConfigError) as e:
        check_resume(_cfg(tmp_path))
    line = str(e.value)
    assert "\n" not in line and str(shard) in line and "does not match its saved checksum" in line, line
    assert "--checkpoint.load_step=1" in line, line
    assert check_resume(_cfg(tmp_path, "--checkpoint.load_step=1")) == 1
    assert check_resume(_cfg(tmp_path, "--checkpoint.verify=off")) == 2  # the user's choice


def test_sampled_check_and_its_limit(tmp_path):
    file = tmp_path / "big.bin"
    original = os.urandom(4 << 20)
    file.write_bytes(original)
    checksums.write_checksums(str(tmp_path), checksums.records(str(tmp_path), ["big.bin"]))
    assert checksums.first_mismatch(str(tmp_path)) is None
    offsets = checksums.sample_offsets(len(original))
    data = bytearray(original)
    data[offsets[1]:offsets[1] + 10] = bytes(10)  # inside a sampled block
    file.write_bytes(bytes(data))
    assert "does not match" in checksums.first_mismatch(str(tmp_path))
    data = bytearray(original)
    data[offsets[0] + checksums.SAMPLE_BYTES + 5] ^= 0xFF  # between samples: only "full" sees it
    file.write_bytes(bytes(data))
    assert checksums.first_mismatch(str(tmp_path)) is None
    assert "does not match" in checksums.first_mismatch(str(tmp_path), full=True)


def run_train(dump: Path, *args: str, env: dict | None = None):
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": "2", "CONFIG_FILE": str(RL_CONFIG), **(env or {})}
    return subprocess.run([str(ROOT / "run_train.sh"), *TINY, *args, f"--job.dump_folder={dump}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_branch_from_older_step_survives_a_crash_in_its_first_save(tmp_path):
    ckpt = tmp_path / "checkpoint"
    _ok(run_train(tmp_path, "--training.steps=2"))  # steps 1..3 (1 supervised + 2 RL): a finished job
    assert latest_complete_step(str(ckpt)) == 3
    # branch from step 1; rank 0 is killed writing step 2's .metadata, after both ranks wrote their shards
    proc = run_train(tmp_path, "--training.steps=2", "--checkpoint.load_step=1", "--rl.reward_fn=tests.faults:score",
                     env={"FAULT_SAVE_STEP": "2"})
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert f"Loading the checkpoint from {ckpt}/step-1" in log, log[-3000:]
    assert re.search(r"the newer steps of the abandoned history are set aside as step-2\.abandoned-\S+, "
                     r"step-3\.abandoned-", log), log[-3000:]
    names = sorted(os.listdir(ckpt))
    assert [n for n in names if re.fullmatch(r"step-\d+", n)] == ["step-1"], names
    assert "step-2.saving" in names and not (ckpt / "step-2.saving" / ".metadata").exists(), names
    assert latest_complete_step(str(ckpt)) == 1
    # a plain rerun resumes the new branch (before: the abandoned step-3, "job already finished")
    proc = run_train(tmp_path, "--training.steps=2")
    _ok(proc)
    log = proc.stdout + proc.stderr
    assert "resuming from checkpoint step-1" in log and f"Loading the checkpoint from {ckpt}/step-1" in log
    assert latest_complete_step(str(ckpt)) == 3 and not (ckpt / "step-2.saving").exists()
    # a shard of the step the next load reads is zeroed; with the pre-flight's check off, the load names it
    shard = ckpt / "step-3" / "__1_0.distcp"
    _zero(shard)
    proc = run_train(tmp_path, "--training.steps=3", "--checkpoint.verify=off")
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    last = proc.stderr.strip().splitlines()[-1]  # the launcher's last line is the workers' (issue 40)
    assert last.startswith(f"config error: [checkpoint] folder: cannot load {ckpt}/step-3: {shard} does not match "
                           "its saved checksum"), proc.stderr[-3000:]
    assert last.endswith("--checkpoint.load_step=2") and "UnpicklingError" not in last
