"""The quick-start job through ``run_train.sh``: 4 gloo ranks, EP=4, real TensorBoard files.

The default config warms the model up supervised, then runs GRPO steps of
rollout -> recompute -> update with router replay, the recompute and update
stages placed by the foresight planner (``[balance] balancer = "foremoe"``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
SFT, RL, UPDATES, MICRO = 10, 3, 2, 2  # steps, optimizer steps per rollout, micro-steps per optimizer step


def test_default_job_trains_and_logs_balance(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": "4"}
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), f"--rl.sft_warmup_steps={SFT}", f"--training.steps={RL}",
         f"--job.dump_folder={tmp_path}", "--metrics.log_freq=5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["world_size"], summary["ep"], summary["micro_steps"], summary["steps"]) == (4, 4, MICRO, SFT + RL)
    sft_loss = summary["loss"][:SFT]
    assert sum(sft_loss[-3:]) < 0.8 * sum(sft_loss[:3]), sft_loss
    assert len(summary["rl/reward_mean"]) == RL
    assert all(0.0 <= r <= 1.0 for r in summary["rl/reward_mean"])
    assert summary["rl/recompute_route_mismatch"] == [0.0] * RL  # replayed routes, unchanged weights
    assert max(summary["rollout/logprob_gap"]) < 1e-4

    events = list(Path(summary["tb_dir"]).glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0]), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    measured = {e.step: e.value for e in acc.Scalars("balance/max_over_mean")}
    n_micro = SFT * MICRO + RL * UPDATES * MICRO
    assert sorted(measured) == list(range(n_micro))  # one point per micro-step
    assert all(v >= 1.0 for v in measured.values())
    foresight = {e.step: e.value for e in acc.Scalars("foresight/static_max_over_mean")}
    planned = {e.step: e.value for e in acc.Scalars("placement/planned_max_over_mean")}
    assert sorted(foresight) == sorted(planned) == list(range(SFT * MICRO, n_micro))
    for step in planned:  # the runtime's measured per-rank rows follow the plan exactly
        assert measured[step] == pytest.approx(planned[step], rel=1e-9)
    assert sum(measured[s] for s in planned) < sum(foresight.values())  # better than static placement
    assert all(e.value == 0 for e in acc.Scalars("placement/rows_off_plan"))
    assert "foresight/expert_load_heatmap" in acc.Tags()["images"]
    assert {f"balance/layer_{layer}/max_over_mean" for layer in range(4)} <= tags
    assert {f"tokens_per_expert/layer_3/expert_{e}" for e in range(8)} <= tags
    per_expert = [acc.Scalars(f"tokens_per_expert/layer_0/expert_{e}")[0].value for e in range(8)]
    assert sum(per_expert) == 4 * 8 * 24 * 2  # ranks x sequences x positions x top-k (supervised step)
    assert {"train/loss", "train/grad_norm", "train/tokens_per_s", "train/peak_memory_gib", "rl/reward_mean",
            "rl/route_mismatch", "rl/clip_frac", "time/rollout_s", "time/recompute_s", "time/update_s",
            "placement/replicas", "placement/max_vio_experts", "placement/plan_ms", "transfer/exposed_s",
            "transfer/bytes_intra_node", "transfer/bytes_host", "transfer/grad_return_bytes", "transfer/seconds_direct",
            "transfer/seconds_host"} <= tags
    assert len(acc.Scalars("rl/route_mismatch")) == RL
    # the default sequence schedule: every micro-step's tokens level over the ranks, packed rows, no padding
    assert all(e.value <= 1.05 for e in acc.Scalars("schedule/tokens_max_over_mean"))
    assert [e.value for e in acc.Scalars("schedule/padding_fraction")] == [0.0] * RL
    assert [e.value for e in acc.Scalars("schedule/micro_steps")] == [UPDATES * MICRO] * RL
    assert len(acc.Scalars("schedule/pairs_max_over_mean")) == RL
    assert all(0.0 < e.value <= 1.0 for e in acc.Scalars("rl/nonzero_advantage_frac"))  # rewards differ in groups


@pytest.mark.parametrize("cuda, user, expected", [
    (True, None, "expandable_segments:True"),  # CUDA, nothing set: growable segments
    (True, "backend:cudaMallocAsync", "backend:cudaMallocAsync"),  # the user's choice is kept
    (True, "", ""),  # even an empty one
    (False, None, None),  # no CUDA: nothing set
])
def test_launcher_sets_expandable_segments_on_cuda(monkeypatch, cuda, user, expected):
    """The workers' allocator setting, as torchrun's ``run`` sees the environment it starts them with
    (``torch.cuda.is_available`` and ``run`` stand-ins; no process is started)."""
    import torch
    import torch.distributed.run as torchrun

    from titan_foremoe.distributed import launch

    for name in (launch.ALLOC_ENV, launch.LAUNCHER_PID_ENV):  # _run sets both in os.environ: restored after the
        monkeypatch.setenv(name, "")  # test (a delenv of an absent name records nothing to restore)
        monkeypatch.delenv(name)
    if user is not None:
        monkeypatch.setenv(launch.ALLOC_ENV, user)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(launch, "_record_store", lambda *a: None)
    seen = []
    monkeypatch.setattr(torchrun, "run", lambda args: seen.append(os.environ.get(launch.ALLOC_ENV)))
    args = torchrun.parse_args(["--nproc_per_node=2", "-m", "titan_foremoe.train"])
    assert launch._run(args, None, 1, 0, None, "here", "a while") == 0
    assert seen == [expected]
