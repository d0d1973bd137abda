"""CI's torch 2.11 job: the trainer under the torch of the lent GPU machines (``torchtitan_patches/torch_compat.py``).

Runs only where ``TITAN_FOREMOE_TORCH211_PYTHON`` names a python with torch 2.11 (``.ci/run`` builds it with
``scripts/ensure_env_torch211.sh``: the device's packages plus the carried wheels, titan_foremoe from this
checkout by ``PYTHONPATH``); skipped elsewhere. Each case is a subprocess of that python, so this file runs under
the main (2.13) pytest and its closing line stays the one CI reads.

- the debug RL job, 2 RL steps on 4 gloo ranks at EP 2 (efsdp 2: the experts are their own FSDP unit on 2.11,
  whose post-backward must run from the block's) after 2 supervised steps, against the same job's figures under
  this process's torch;
- the self-test's rung 1;
- ``scripts/gpu_check.sh --cpu``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
from distributed_helpers import rerun_if_killed  # noqa: E402
from test_gpu_check import check_trainer_stages  # noqa: E402  (the same figures, this torch)

PY211 = os.environ.get("TITAN_FOREMOE_TORCH211_PYTHON")
pytestmark = pytest.mark.skipif(not PY211, reason="TITAN_FOREMOE_TORCH211_PYTHON is not set (.ci/run sets it)")

JOB = ["--training.steps=2", "--rl.sft_warmup_steps=2", "--parallelism.expert_parallel_degree=2",
       "--metrics.enable_tensorboard=false", "--metrics.log_freq=1", "--rl.max_new_tokens=8"]
STEP = re.compile(r"step +(\d+) .*?loss ([+-]?\d+\.\d+)")


def _env(python: str) -> dict:
    env = dict(os.environ, PYTHON=python, NGPU="4", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("TITAN_FOREMOE_LAUNCHER_PID", None)
    return env


def _job(python: str, out: Path) -> tuple[subprocess.CompletedProcess, list[tuple[int, str]]]:
    """The job; once more when torchrun reports a rank killed by a signal (the known gloo heap crash of 4-rank
    CPU jobs, docs/testing.md: a CI run of 2026-11-29 lost rank 2 to SIGABRT at the 2.11 job's exit), saying so
    on stderr. A non-zero exit without a signal, or different figures, fail at once."""
    p = rerun_if_killed(lambda: subprocess.run(["./run_train.sh", f"--job.dump_folder={out}", *JOB], cwd=ROOT,
                                               env=_env(python), capture_output=True, text=True, timeout=600),
                        out, "test_torch211")
    return p, STEP.findall(p.stdout + p.stderr)


def test_torch_is_211():
    p = subprocess.run([PY211, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    assert p.stdout.startswith("2.11."), p.stdout + p.stderr


def test_debug_rl_job_matches_main_torch(tmp_path):
    p, losses = _job(PY211, tmp_path / "t211")
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "runs with" in p.stdout and "compatibility patches" in p.stdout  # the check names what it filled
    assert [int(s) for s, _ in losses] == [1, 2, 3, 4], losses
    ref, ref_losses = _job(sys.executable, tmp_path / "main")
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-4000:]
    assert losses == ref_losses  # same figures to the printed digit (gloo on CPU: the same kernels)


def test_selftest_rung1(tmp_path):
    p = subprocess.run([PY211, "-m", "titan_foremoe.selftest", "--gpus", "1", "--out", str(tmp_path)], cwd=ROOT,
                       env=_env(PY211), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "rung 1" in p.stdout.lower() and "PASS" in p.stdout, (p.stdout + p.stderr)[-4000:]


def test_gpu_check_cpu_all_stages(tmp_path):
    """Every stage of the GPU check in --cpu mode under torch 2.11, through gpu_check.sh with PYTHON set."""
    env = dict(_env(PY211), OMP_NUM_THREADS="1")
    env.pop("NGPU")
    p = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    verdicts = [x.split()[:2] for x in p.stdout.splitlines() if x.startswith(("PASS ", "FAIL ", "SKIP "))]
    # 7 stages (fleet_sleep: SKIP, vLLM's sleep mode needs CUDA) and the closing line
    assert [v[0] for v in verdicts] == ["PASS"] * 6 + ["SKIP", "PASS"], p.stdout
    check_trainer_stages(json.loads((tmp_path / "report.json").read_text()))  # its figures (test_gpu_check's)
