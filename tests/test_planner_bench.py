"""End-to-end runs of scripts/bench_planner.py on tiny inputs."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_planner.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_planner", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BALANCERS = "static,eplb_history,eplb_oracle,foremoe,foremoe_balanced,ideal"


def _check_out(out: Path, M: int, R: int, L: int, E: int, B: int):
    summary = json.loads((out / "summary.json").read_text())
    for b in BALANCERS.split(","):
        s = summary[b]
        for key in ("mean_max_over_mean", "p95_max_over_mean", "transfers_per_rank_per_microstep",
                    "intra_node_transfer_fraction", "plan_ms_median"):
            assert np.isfinite(s[key])
        assert s["mean_max_over_mean"] >= 1.0
        z = np.load(out / f"{b}.npz")
        assert z["responses"].dtype == np.int64 and z["responses"].shape == (M, B)
        assert z["assign"].dtype == np.int32 and z["assign"].shape == (M, L, E, R)
        assert z["plan_ms"].dtype == np.float64 and z["plan_ms"].shape == (M,)
    assert summary["static"]["transfers_per_rank_per_microstep"] == 0
    assert summary["foremoe"]["mean_max_over_mean"] <= summary["static"]["mean_max_over_mean"]
    assert summary["ideal"]["mean_max_over_mean"] <= summary["foremoe"]["mean_max_over_mean"]
    return summary


def test_bench_synthetic(bench, tmp_path):
    rc = bench.main(["--synthetic", "tiny", "--ranks", "4", "--ranks-per-node", "2", "--spare-slots", "1",
                     "--responses-per-microstep", "4", "--global-batch", "8", "--steps", "2",
                     "--balancers", BALANCERS, "--timing-repeats", "2", "--out", str(tmp_path)])
    assert rc == 0
    _check_out(tmp_path, M=4, R=4, L=2, E=8, B=4)


def test_bench_trace(bench, tmp_path):
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 30, size=21)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    experts = rng.integers(0, 8, size=(offsets[-1], 3, 2)).astype(np.uint8)
    trace = tmp_path / "trace.npz"
    np.savez(trace, experts=experts, offsets=offsets, dataset=np.array(["x"] * 21), category=np.array(["y"] * 21))
    out = tmp_path / "out"
    rc = bench.main(["--trace", str(trace), "--ranks", "4", "--ranks-per-node", "2", "--spare-slots", "1",
                     "--responses-per-microstep", "4", "--global-batch", "8", "--seed", "0",
                     "--balancers", BALANCERS, "--out", str(out)])
    assert rc == 0
    _check_out(out, M=4, R=4, L=3, E=8, B=4)  # 21 responses -> 2 steps of 8, 5 dropped
    resp = np.load(out / "foremoe.npz")["responses"]
    assert len(set(resp.ravel().tolist())) == 16
    # the assignments are the trace's own loads for those responses
    a = np.load(out / "static.npz")["assign"]
    toks = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in resp[0]])
    assert np.array_equal(a[0, 0].sum(axis=1), np.bincount(experts[toks, 0].ravel(), minlength=8))


def test_bench_bad_trace_exits_2(bench, tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    np.savez(bad, experts=np.zeros((4, 1, 1), dtype=np.uint8))
    assert bench.main(["--trace", str(bad), "--ranks", "2", "--ranks-per-node", "2", "--out", str(tmp_path)]) == 2
    assert "offsets" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["--ranks", "6", "--ranks-per-node", "4"],
    ["--ranks", "4", "--ranks-per-node", "2", "--balancers", "magic"],
    ["--ranks", "4", "--ranks-per-node", "2", "--spare-slots", "-1"],
    ["--ranks", "4", "--ranks-per-node", "2", "--responses-per-microstep", "6"],
])
def test_bench_bad_args_exit_2(bench, tmp_path, args):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--synthetic", "tiny", "--out", str(tmp_path), *args])
    assert exc.value.code == 2


def test_bench_cli_exit_code(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--trace", str(tmp_path / "missing.npz"), "--ranks", "2",
                        "--ranks-per-node", "2", "--out", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "not found" in r.stderr
