"""Smoke test of ``scripts/bench_placement_scale.py`` at tiny sizes (the figures themselves go in the README)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

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
