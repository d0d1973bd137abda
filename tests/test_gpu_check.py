"""``scripts/gpu_check.sh --cpu`` (the one-command check for a lent GPU, in its CPU mode) runs with torchtitan
blocked from importing, as on a GPU image where torchtitan 0.3.0 does not import; its calibration file is taken
by ``scripts/simulate_cluster.py --calibration`` (the slot paths' tables for the runtime, the dense table for
torchtitan's own path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

BLOCK = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torchtitan" or name.startswith("torchtitan.") or name == "torchtitan_patches":
            raise ImportError(f"{name} blocked (as on a GPU image where torchtitan does not import)")
sys.meta_path.insert(0, _Block())
"""


def test_gpu_check_cpu_mode_without_torchtitan_feeds_the_simulator(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BLOCK)
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "check"
    p = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--only", "kernels", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[-1].startswith("PASS gpu_check (cpu)") and sum(x.startswith("  PASS ") for x in lines) == 6, p.stdout
    assert any(x.startswith("PASS kernels: 6 of 6 checks passed") for x in lines), p.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and set(report["checks"]) == {"slot_swiglu_small", "stream_program", "landing", "attention",
                                                   "combine", "timings"}
    # the return from the fused backward and the landing on its stream, before the gate (gpu_landing.py)
    assert report["checks"]["landing"]["values"] == {"early": True, "rel_err": 0.0, "early_landings": 1,
                                                     "early_returns": 1}
    assert report["checks"]["attention"]["kernels"]["packed"] == "sdpa_block_mask"  # without torchtitan
    env_r = report["environment"]
    assert env_r["torchtitan_imports"] is False and "blocked" in env_r["torchtitan_error"]
    assert all(env_r["features"].values()) and env_r["versions"]["torch"].startswith("2.13")
    prog = report["checks"]["stream_program"]
    assert prog["nccl_all_to_all_from_side_stream"] and prog["received_rows"] == 1 and prog["grad_return_bytes"] > 0
    # the engine's bank read in order: w1 and w3 as one GEMM, through ReplicaWeights and the gradient return
    assert prog["bank_w1_w3_one_gemm"] and report["checks"]["slot_swiglu_small"]["in_order_w13_one_gemm"]
    assert report["checks"]["slot_swiglu_small"]["group_rows"].count(0) >= 2  # empty groups were there

    cal_path = out / "grouped_mm_calibration.json"
    sim = subprocess.run([sys.executable, "scripts/simulate_cluster.py", "--synthetic", "--model", "qwen3_30b_a3b",
                          "--gpus", "8", "--gpus-per-node", "4", "--ep", "4", "--responses-per-microstep", "4",
                          "--global-batch", "16", "--updates-per-rollout", "2", "--spare-slots", "1",
                          "--balancers", "static,foremoe,off", "--calibration", str(cal_path),
                          "--out", str(tmp_path / "sim")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert sim.returncode == 0, sim.stdout + sim.stderr
    summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert summary["calibration"]["path"] == str(cal_path) and summary["foremoe"]["step_ms"] > 0

    from titan_foremoe.simulator.calibration import load_calibration, monotone_table

    cal = load_calibration(cal_path)
    raw = json.loads(cal_path.read_text())
    for path, table in (("inplace", raw["slot_swiglu"]["2048x768"]["inplace"]),
                        ("gather", raw["slot_swiglu"]["2048x768"]["gather"]), ("none", raw["grouped_mm"]["2048x768"])):
        curve = cal.curve(2048, 768, slot_path=path)
        # the tables as measured, made monotone on load (a loaded CPU's timings dip)
        np.testing.assert_array_equal(curve.fwd_KN, monotone_table(table["fwd_ms"]))
        np.testing.assert_array_equal(curve.bwd_KN, monotone_table(table["bwd_ms"]))


def check_trainer_stages(report: dict) -> None:
    """The trainer stages' figures in a ``--cpu`` report: world 1 eager and compiled, two ranks at EP 2 (foremoe
    and exact equal to off under the checked backend), the MoE layer, IPC."""
    st = report["stages"]
    assert report["passed"] and {"trainer", "two_ranks", "moe_layer", "ipc"} <= set(st)
    eager, compiled = st["trainer"]["eager"], st["trainer"]["compiled"]
    assert eager["peak_memory_gib"] > 0 and compiled["peak_memory_gib"] > 0 and len(eager["loss"]) == 1
    assert any(k.startswith("sdpa") or k == "varlen_attn" for k in eager["attention"]), eager  # which kernel ran
    assert max(st["two_ranks"]["rel_diff_to_off"].values()) <= 1e-4
    (m_off, r_off), (m_fm, r_fm) = st["two_ranks"]["off"]["micro_steps"], st["two_ranks"]["foremoe"]["micro_steps"]
    assert m_off == r_off == m_fm >= 2 and r_fm == (m_fm + 1) // 2  # foremoe's recompute merged, equal losses
    assert st["moe_layer"]["off"]["rows"] > st["moe_layer"]["foremoe"]["rows"] > 0
    assert all(st["ipc"][k]["passed"] for k in ("expandable_segments_True", "expandable_segments_False"))


def test_gpu_check_cpu_trainer_stages(tmp_path):
    """The trainer stages in --cpu mode under this torch (2.13; tests/test_torch211.py runs every stage under 2.11,
    issue 45 asks for both), each one PASS line with its figures."""
    out = tmp_path / "check"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    p = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--only", "trainer,two_ranks,moe_layer,ipc",
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads((out / "report.json").read_text())
    assert list(report["stages"]) == ["trainer", "two_ranks", "moe_layer", "ipc"]
    check_trainer_stages(report)


def test_a_stage_over_its_limit_fails_alone(tmp_path):
    """A stage killed at its time limit is one FAIL line; the check goes on (a fresh process per stage)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    a = gpu_check.argparse.Namespace(out=str(tmp_path), cpu=True, nan_fill_gib=0.0)
    r = gpu_check.spawn_stage("ipc", a, limit=1)
    assert r["passed"] is False and r["line"] == "ipc: over its limit of 1 s"
    r = gpu_check.spawn_stage("moe_layer", a, limit=120)
    assert r["passed"] is True and (tmp_path / "stages" / "moe_layer.json").exists()
