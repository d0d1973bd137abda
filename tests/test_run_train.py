"""The quick-start job through ``run_train.sh``: 4 gloo ranks, EP=4, real TensorBoard files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]


def test_default_job_trains_and_logs_balance(tmp_path):
    steps = 16
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": "4"}
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), f"--training.steps={steps}", f"--job.dump_folder={tmp_path}",
         "--metrics.log_freq=4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["world_size"], summary["ep"], summary["micro_steps"], summary["steps"]) == (4, 4, 2, steps)
    losses = summary["loss"]
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses

    events = list(Path(summary["tb_dir"]).glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0]), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    ratio = acc.Scalars("balance/max_over_mean")
    assert [e.step for e in ratio] == list(range(steps * 2))  # one point per micro-step
    assert all(v.value >= 1.0 for v in ratio)
    assert {f"balance/layer_{layer}/max_over_mean" for layer in range(4)} <= tags
    assert {f"tokens_per_expert/layer_3/expert_{e}" for e in range(8)} <= tags
    per_expert = [acc.Scalars(f"tokens_per_expert/layer_0/expert_{e}")[0].value for e in range(8)]
    assert sum(per_expert) == 4 * 8 * 24 * 2  # ranks x sequences x positions x top-k
    assert {"train/loss", "train/grad_norm", "train/tokens_per_s", "train/peak_memory_gib"} <= tags
    assert len(acc.Scalars("train/loss")) == steps
