"""Smoke test of ``benchmarks/bench_placement_scale.py`` at tiny sizes (the figures themselves go in the README)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_placement_scale  # noqa: E402


def test_summary_plot_and_skipped_sizes(tmp_path):
    out = tmp_path / "scale"
    rc = bench_placement_scale.main(["--model", "tiny", "--ranks", "2,4,3", "--ranks-per-node", "2",
                                     "--spare-slots", "1", "--micro-steps", "2", "--micro-steps-per-step", "1",
                                     "--repeats", "1", "--out", str(out)])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert "do not divide" in s["by_ranks"]["3"]["skipped"]  # 8 experts over 3 ranks
    for R in ("2", "4"):
        r = s["by_ranks"][R]
        for key in ("plan_ms_per_microstep", "tables_ms_per_microstep", "tables_bytes_per_microstep",
                    "bank_bytes_per_rank", "max_over_mean"):
            assert r[key] > 0, (R, key)
        # one spare slot: two bf16 banks of one row of 3 x 64 x 128 weights, 2 layers
        assert r["bank_bytes_per_rank"] == 2 * 1 * 3 * 64 * 128 * 2 * 2
        assert r["max_over_mean"] <= r["static_max_over_mean"]
    assert (out / "scale.png").stat().st_size > 1000


def test_bad_arguments_exit_2(tmp_path):
    with pytest.raises(SystemExit) as e:
        bench_placement_scale.main(["--ranks", "a,b", "--out", str(tmp_path)])
    assert e.value.code == 2


def test_balanced_owners_report_relayout(tmp_path):
    import numpy as np

    from titan_foremoe.planner import PlannerConfig, Topology, plan_stage
    from titan_foremoe.planner.synthetic import MODEL_SHAPES, synthetic_loads

    out = tmp_path / "bal"
    args = ["--model", "tiny", "--ranks", "4", "--ranks-per-node", "2", "--spare-slots", "1", "--micro-steps", "4",
            "--micro-steps-per-step", "2", "--repeats", "1", "--owner-policy", "balanced", "--owner-hysteresis", "0",
            "--efsdp", "2", "--out", str(out)]
    assert bench_placement_scale.main(args) == 0
    r = json.loads((out / "summary.json").read_text())["by_ranks"]["4"]
    # brute force: the same plan's owners, each moved expert counted on the rank that receives it
    plan = plan_stage("foremoe", synthetic_loads("tiny", 4, 4, 4, 0), Topology.from_ranks(4, 2),
                      PlannerConfig(spare_slots=1, owner_policy="balanced", owner_hysteresis=0.0), micro_steps_per_step=2)
    shape = MODEL_SHAPES["tiny"]
    per_move = 3 * shape.dim * shape.moe_hidden_dim * 12 / 2
    prev = np.arange(8)[None].repeat(plan.owner_MLE.shape[1], 0) // 2
    for z, m in enumerate((0, 2)):
        now = plan.owner_MLE[m]
        got = np.zeros(4)
        for layer, e in zip(*np.nonzero(now != prev)):
            got[now[layer, e]] += per_move
        assert r["owner_moves_per_step"][z] == int((now != prev).sum())
        assert r["relayout_bytes_per_rank_per_step"][z] == got.max()
        prev = now
    assert sum(r["owner_moves_per_step"]) > 0 and len(r["relayout_meta_cpu_ms_per_step"]) == 2
