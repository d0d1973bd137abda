"""End-to-end runs of benchmarks/bench_planner.py on tiny inputs."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_planner.py"


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


def test_bench_owner_moves_side_by_side(bench, tmp_path):
    """foremoe vs foremoe_balanced: owner moves per step counted from the plans' owners by brute force."""
    args = ["--synthetic", "tiny", "--ranks", "4", "--ranks-per-node", "2", "--spare-slots", "1",
            "--responses-per-microstep", "4", "--global-batch", "8", "--steps", "3", "--efsdp", "2",
            "--balancers", "foremoe,foremoe_balanced", "--timing-repeats", "1"]
    assert bench.main(args + ["--out", str(tmp_path)]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    loads, _ = bench.build_loads(bench.parse_args(args + ["--out", str(tmp_path)]))
    plan = bench.plan_stage("foremoe_balanced", loads, bench.Topology.from_ranks(4, 2), bench.PlannerConfig(),
                            micro_steps_per_step=2)
    params = bench.CostModel().expert_bytes / 2
    prev = np.arange(8)[None, :].repeat(2, axis=0) // 2  # contiguous: the layout in effect
    moves, top = [], []
    for z in range(3):
        own = plan.owner_MLE[2 * z]
        per_rank = np.zeros(4)
        for l, e in zip(*np.nonzero(own != prev)):
            per_rank[own[l, e]] += params * 12 / 2
        moves.append(int((own != prev).sum()))
        top.append(per_rank.max())
        prev = own
    b, f = s["foremoe_balanced"], s["foremoe"]
    assert b["owner_moves_per_step"] == moves and sum(moves) > 0
    assert b["owner_move_bytes_per_rank_per_step"] == pytest.approx(top)
    assert f["owner_moves_per_step"] == [0, 0, 0] and f["owner_move_bytes_per_rank_mean"] == 0
    # owner moves are among the plan's transfers; the replica column leaves them out
    M, L, R = 6, 2, 4
    assert (b["transfers_per_rank_per_microstep"] - b["replica_transfers_per_rank_per_microstep"]) * M * L * R \
        == pytest.approx(sum(moves))
    assert f["transfers_per_rank_per_microstep"] == f["replica_transfers_per_rank_per_microstep"]
