"""Measured calibrations (calibrations/h{1,2}00_measured.json): provenance, the fused-MoE fit, held-back errors,
the collector's token sampling, the per-layer mode.

Reads the committed JSON only (CI never needs aiconfigurator-core); the parquet itself is checked by
``scripts/calibrate_from_aiconfigurator.py --check``.
"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from titan_foremoe.simulator.calibration import DEFAULT_CALIBRATION, load_calibration
from titan_foremoe.simulator.collector_sampling import _water_fill, balanced_counts_E, power_law_counts_E
from titan_foremoe.simulator.fused_moe import features_XF, fit_nnls
from titan_foremoe.simulator.moe_validation import QWEN3, moe_forward_errors, power_law_ratio_errors
from titan_foremoe.simulator.simulate import device_costs

ROOT = Path(__file__).resolve().parents[1]
DEVICES = ["h100", "h200"]


def _sim_script():
    spec = importlib.util.spec_from_file_location("simulate_cluster", ROOT / "scripts" / "simulate_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_measured_h100_is_the_default():
    assert DEFAULT_CALIBRATION.name == "h100_measured.json"
    assert load_calibration().kind == "measured_tables"


@pytest.mark.parametrize("device", DEVICES)
def test_provenance_recorded(device):
    cal = load_calibration(device)
    prov = cal.raw["provenance"]
    assert cal.kind == "measured_tables"
    assert prov["package"] == "aiconfigurator-core==0.12.0" and prov["dtype"] == "bfloat16"
    assert set(prov["tables"]) == {"gemm", "moe", "nccl"} and all(device in p for p in prov["tables"].values())
    fm = cal.raw["fused_moe"]
    assert QWEN3 in fm["held_back_shapes"] and not set(fm["train_shapes"]) & set(fm["held_back_shapes"])
    assert len(fm["rows"]["balanced"]) > 1000 and len(cal.raw["gemm_table"]) > 1000
    assert {"ib_GBps", "h2d_pinned_GBps", "nvlink_a2a"} <= set(cal.raw["stand_in"])


@pytest.mark.parametrize("device", DEVICES)
def test_forward_curve_is_the_claimed_gemm_rows(device):
    """One expert's SwiGLU forward = gemm(n, 2F, D) + gemm(n, D, F), recomputed from the rows the JSON lists."""
    cal = load_calibration(device)
    g = cal.raw["grouped_mm"]["2048x768"]
    rows = np.array(cal.raw["provenance"]["gemm_rows_used"], dtype=np.float64)

    def gemm(m, n, k):
        r = rows[(rows[:, 1] == n) & (rows[:, 2] == k)]
        r = r[np.argsort(r[:, 0])]
        return np.interp(m, r[:, 0], r[:, 3])

    want = [gemm(n, 1536, 2048) + gemm(n, 2048, 768) for n in g["tokens_per_expert"]]
    np.testing.assert_allclose(g["fwd_ms"][0], want, rtol=1e-5, atol=1e-6)
    # the fused model's GEMM table gives the same forward at power-of-two tokens
    t = cal.fused(2048, 768).gemm.swiglu_ms(np.array([64.0, 512.0, 4096.0]), 2048, 768, backward=False)
    np.testing.assert_allclose(t, [want[g["tokens_per_expert"].index(n)] for n in (64, 512, 4096)], rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_fit_reproduces_from_train_rows_only(device):
    """Re-fit from the stored balanced rows of the train shapes: the JSON's coefficients, and no held-back row used."""
    cal = load_calibration(device)
    fm = cal.raw["fused_moe"]
    rows = np.array([r for r in fm["rows"]["balanced"] if f"{r[0]}x{r[1]}x{r[2]}x{r[3]}" in fm["train_shapes"]],
                    dtype=np.float64)
    X = np.stack([features_XF(balanced_counts_E(int(T), int(E), int(k))[: int(E) // int(ep)], T * k, int(D), int(F))
                  for D, F, E, k, ep, T, _ in rows])
    np.testing.assert_allclose(fit_nnls(X, rows[:, 6]), fm["coeffs_ms"], rtol=1e-6)
    assert all(c > 0 for c in fm["coeffs_ms"])


def test_held_back_error_by_hand_and_bounds():
    """Qwen3's EP 8, 8192-token row by hand from the four features; held-back Qwen3 median error under 10%."""
    cal = load_calibration("h100")
    c = cal.raw["fused_moe"]["coeffs_ms"]
    D, F = 2048, 768
    row = next(r for r in cal.raw["fused_moe"]["rows"]["balanced"] if r[:6] == [D, F, 128, 8, 8, 8192])
    # 16 local experts of 512 tokens each; 8192 x 8 pairs scanned
    sim = c[0] + c[1] * 16 * 3 * D * F * 2 + c[2] * 6 * D * F * 16 * 512 + c[3] * 8192 * 8 * (D + F) * 2
    e = moe_forward_errors(cal, shapes=[QWEN3])
    i = next(j for j, r in enumerate(e["rows_R"]) if list(r[:6]) == row[:6])
    assert e["err_R"][i] == pytest.approx((sim - row[6]) / row[6], rel=1e-9)
    assert e["rows"] == 216 and e["median_abs_err"] < 0.10


def test_power_law_ratio_reproduced():
    p = power_law_ratio_errors(load_calibration("h100"), shapes=[QWEN3])
    assert p["rows"] == 216 and p["median_abs_err"] < 0.10
    big = (p["rows_R"][:, 4] == 8) & (p["rows_R"][:, 5] >= 4096)  # EP 8, 4096+ tokens: the skew shows
    assert big.sum() == 5 and (p["measured_ratio_R"][big] > 1.2).all() and (p["simulated_ratio_R"][big] > 1.1).all()


def test_collector_sampling_matches_its_definition():
    # the one-token-at-a-time loop of collector/helper.py::_round_robin_adjust_per_rank, brute force
    rng = np.random.default_rng(0)
    for _ in range(200):
        c, rem, step = rng.integers(0, 30, int(rng.integers(1, 12))), int(rng.integers(0, 150)), int(rng.choice([1, -1]))
        want = c.copy()
        for _ in range(rem):
            v = np.nonzero(want < 30 if step > 0 else want > 0)[0]
            if len(v) == 0:
                break
            want[v[np.argmin(want[v])] if step > 0 else v[np.argmax(want[v])]] += step
        np.testing.assert_array_equal(_water_fill(c, rem, step, 30), want)
    assert (balanced_counts_E(8192, 128, 8) == 512).all() and (balanced_counts_E(8, 128, 8) > 0).sum() == 64
    for T, ep in ((512, 8), (16384, 1), (16, 128)):
        n = power_law_counts_E(T, 128, 8, ep, 1.2, rng)
        assert n.sum() == T * 8 and n.max() <= T and n.reshape(ep, -1).sum(1).argmax() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_nvlink_all_to_all_is_the_nccl_curve(device):
    cal = load_calibration(device)
    link = device_costs(cal, 8)
    curve = cal.raw["links"]["nvlink_a2a"]["8"]
    i = len(curve["bytes"]) - 3
    b = np.zeros((1, 1, 2, 1))
    b[0, 0, 0, 0] = curve["bytes"][i] * 7 / 8  # what one rank sends to its 7 peers in that alltoall
    assert link.a2a_s_MLPR(b)[0, 0, 0, 0] == pytest.approx(curve["ms"][i] * 1e-3 - link.a2a_latency_us * 1e-6)
    assert device_costs(cal, 8, nvlink_GBps=100.0).nvlink_a2a is None  # an override replaces the curve


def test_layer_mode(capsys):
    sim = _sim_script()
    base = ["--layer", "--device", "h100", "--hidden", "2048", "--moe-ffn", "768", "--experts", "128", "--top-k", "8",
            "--tokens-per-rank", "1024"]
    out = {}
    for name, extra in {"b": ["--ep", "8"], "p": ["--ep", "8", "--distribution", "power_law_1.2"],
                        "one": ["--ep", "1"], "x": ["--ep", "16", "--shared-ffn", "1024"]}.items():
        assert sim.main(base + extra) == 0
        out[name] = json.loads(capsys.readouterr().out)
    b = out["b"]
    c = load_calibration("h100").raw["fused_moe"]["coeffs_ms"]
    # balanced: 16 local experts, each 1024 x 8 tokens x 8 ranks / 128 = 512 tokens, all dispatched here
    want = c[0] + c[1] * 16 * 6 * 2048 * 768 + c[2] * 6 * 2048 * 768 * 8192 + c[3] * 8192 * 2 * (2048 + 768)
    assert b["experts_forward_ms"] == pytest.approx(want, rel=1e-9)
    for k in ("forward_ms", "backward_ms"):
        d = b[k]
        assert d["total"] == pytest.approx(d["dispatch"] + d["experts"] + d["combine"]) and d["dispatch"] > 0
    assert b["backward_ms"]["experts"] > 1.5 * b["experts_forward_ms"]
    assert out["p"]["experts_forward_ms"] > 1.2 * b["experts_forward_ms"]
    assert out["one"]["forward_ms"]["dispatch"] == 0.0
    assert out["x"]["shared_expert_forward_ms"] > 0 and out["x"]["forward_ms"]["dispatch"] > b["forward_ms"]["dispatch"]
    assert sim.main(base + ["--ep", "3"]) == 2 and "--experts 128" in capsys.readouterr().err
