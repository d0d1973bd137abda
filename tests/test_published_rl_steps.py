"""The simulator against published RL step breakdowns: docs/simulator.md's table comes from
benchmarks/published_rl_steps.py, and the rollout's decode-efficiency knob does what the fit assumes."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from titan_foremoe.simulator.calibration import load_calibration
from titan_foremoe.simulator.models import get_model
from titan_foremoe.simulator.rollout import rollout_ms
from titan_foremoe.simulator.simulate import device_costs

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("published_rl_steps", ROOT / "benchmarks/published_rl_steps.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_decode_efficiency_divides_decode_not_prefill():
    cal = load_calibration(None)
    link, lens = device_costs(cal), np.array([300, 500, 511] * 40)
    args = (get_model("qwen3_30b_a3b"), cal, link, lens, 8, 8, 128, 256, cal.hbm_GBps * 1e9)
    full, half = rollout_ms(*args), rollout_ms(*args, 0.5)
    assert half["decode_ms"] == pytest.approx(2 * full["decode_ms"])
    assert half["prefill_ms"] == pytest.approx(full["prefill_ms"])
    with pytest.raises(ValueError, match="decode efficiency 0"):
        rollout_ms(*args, 0.0)


def test_docs_table_is_the_scripts_output():
    """Every simulated phase of docs/simulator.md's published-breakdowns table, as the script prints it, and the
    fitted efficiency reproduces the figure it was fitted on."""
    bench = _bench()
    doc = (ROOT / "docs/simulator.md").read_text()
    eff = bench.fitted_efficiency()
    assert f"**{eff:.2f}**" in doc
    for eff_run in (1.0, round(eff, 2)):
        for row in bench.simulate_figures(eff_run, phases_only=True):
            for design in row["simulated_s"]:
                assert bench.cell(row, design, eff_run) in doc, bench.cell(row, design, eff_run)
    fit = next(r for r in bench.simulate_figures(eff, phases_only=True) if r["role"] == "fit")
    assert fit["error"]["rollout"] == pytest.approx(0, abs=1e-6)
