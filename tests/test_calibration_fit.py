"""A calibration that is safe to use: ms tables made monotone on load, never below zero outside the measured
range, and a table still predicting a non-positive time refused in one line."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from titan_foremoe.simulator.calibration import isotonic, load_calibration, monotone_table

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "gpu_check_cpu_calibration.json"


def _brute_isotonic(y, grid):
    """The least-squares non-decreasing fit by brute force over a value grid (an oracle for short vectors)."""
    best = min((c for c in itertools.product(grid, repeat=len(y)) if all(a <= b for a, b in zip(c, c[1:]))),
               key=lambda c: sum((a - b) ** 2 for a, b in zip(c, y)))
    return np.array(best)


@pytest.mark.parametrize("y", [[3.0, 1.0, 2.0], [1.0, 4.0, 2.0, 3.0], [5.0, 4.0, 3.0], [1.0, 2.0, 3.0]])
def test_isotonic_is_the_least_squares_monotone_fit(y):
    grid = np.round(np.arange(0, 5.01, 1 / 6), 6)  # holds every block mean of these vectors (thirds, halves)
    np.testing.assert_allclose(isotonic(y), _brute_isotonic(y, grid), atol=1e-6)


def test_a_non_monotone_table_is_made_monotone_in_both_axes():
    """gpu_check.sh --cpu on a loaded CPU: 2 experts x 1 token slower than 2 x 8 (and than 1 x 8)."""
    ms = np.array([[0.79, 1.22, 3.0], [6.26, 2.10, 7.5], [5.0, 9.0, 8.0]])
    m = monotone_table(ms)
    assert (np.diff(m, axis=1) >= 0).all() and (np.diff(m, axis=0) >= 0).all()
    assert not np.allclose(m, ms)
    mono = np.array([[1.0, 2.0], [3.0, 5.0]])
    np.testing.assert_array_equal(monotone_table(mono), mono)


def test_the_fitted_curve_never_falls_nor_goes_below_zero_outside_the_grid():
    cal = load_calibration(FIXTURE)
    raw = np.asarray(cal.raw["slot_swiglu"]["2048x768"]["inplace"]["bwd_ms"])
    assert raw[0, 0] > raw[0, 1]  # the fixture's row falls as tokens grow
    for path in ("inplace", "gather", "none"):
        curve = cal.curve(2048, 768, slot_path=path)
        n = np.array([1, 2, 4, 8, 16, 100, 1000, 10_000], dtype=np.float64)
        for k in (1, 1.5, 2, 8):
            for backward in (False, True):
                t = curve.per_expert_ms(n, np.full_like(n, k), backward) * k
                assert (t > 0).all() and (np.diff(t) >= -1e-12).all(), (path, k, backward, t)


def test_a_calibration_predicting_a_non_positive_time_is_refused_in_one_line(tmp_path):
    raw = json.loads(FIXTURE.read_text())
    raw["grouped_mm"]["2048x768"]["bwd_ms"] = [[0.0, 0.0], [0.0, 3.0]]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError) as e:
        load_calibration(path).curve(2048, 768, slot_path="none")
    msg = str(e.value)
    assert "\n" not in msg and "grouped_mm 2048x768 bwd_ms[k=1][n=1] is 0 ms after the monotone fit" in msg
    load_calibration(path).curve(2048, 768, slot_path="inplace")  # a shape it is not asked about is not refused


def test_simulate_cluster_runs_on_a_gpu_check_cpu_calibration(tmp_path):
    """The reported command: before the fit it stopped with ``negative branch time ... train_ms=-430379.9``
    on this fixture."""
    r = subprocess.run([sys.executable, "scripts/simulate_cluster.py", "--synthetic", "--model", "qwen3_30b_a3b",
                        "--gpus", "16", "--ep", "8", "--no-rollout", "--calibration", str(FIXTURE),
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "negative" not in r.stdout + r.stderr and "step ms synchronous" in r.stdout
