"""Measured calibrations (calibrations/h{1,2}00_measured.json): provenance, rows, held-back errors.

Reads the committed JSON only (CI never needs aiconfigurator-core); the parquet itself is checked by
``scripts/calibrate_from_aiconfigurator.py --check``.
"""

import numpy as np
import pytest

from titan_foremoe.simulator.calibration import load_calibration
from titan_foremoe.simulator.moe_validation import moe_forward_errors

DEVICES = ["h100", "h200"]


@pytest.mark.parametrize("device", DEVICES)
def test_provenance_recorded(device):
    cal = load_calibration(f"calibrations/{device}_measured.json")
    prov = cal.raw["provenance"]
    assert cal.kind == "measured_tables"
    assert prov["package"] == "aiconfigurator-core==0.12.0" and prov["dtype"] == "bfloat16"
    assert set(prov["tables"]) == {"gemm", "moe", "nccl"} and all(device in p for p in prov["tables"].values())
    assert len(prov["gemm_rows_used"]) > 100 and len(cal.raw["moe_rows"]["rows"]) > 100


@pytest.mark.parametrize("device", DEVICES)
def test_forward_curve_is_the_claimed_gemm_rows(device):
    """One expert's SwiGLU forward = gemm(n, 2F, D) + gemm(n, D, F), recomputed from the rows the JSON lists."""
    cal = load_calibration(f"calibrations/{device}_measured.json")
    g = cal.raw["grouped_mm"]["2048x768"]
    rows = np.array(cal.raw["provenance"]["gemm_rows_used"], dtype=np.float64)

    def gemm(m, n, k):
        r = rows[(rows[:, 1] == n) & (rows[:, 2] == k)]
        r = r[np.argsort(r[:, 0])]
        return np.interp(m, r[:, 0], r[:, 3])

    want = [gemm(n, 1536, 2048) + gemm(n, 2048, 768) for n in g["tokens_per_expert"]]
    np.testing.assert_allclose(g["fwd_ms"][0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(g["fwd_ms"])[:, 5], np.array(g["experts_per_rank"]) * want[5], rtol=1e-5, atol=1e-6)


def test_held_back_moe_errors_by_hand():
    """The error of one held-back row, computed by hand from the curve, equals the module's."""
    cal = load_calibration("calibrations/h100_measured.json")
    e = moe_forward_errors(cal)
    rows = [r for r in cal.raw["moe_rows"]["rows"] if r["distribution"] == "balanced"]
    assert e["rows"] == len(rows) == len(e["err_R"])
    i = next(j for j, r in enumerate(rows) if r["num_tokens"] == 8192 and r["moe_ep_size"] == 8)
    g = cal.raw["grouped_mm"]["2048x768"]
    n, k = 8192 * 8 / 128, 16  # 512 tokens on each of 16 local experts: grid points
    sim = g["fwd_ms"][g["experts_per_rank"].index(k)][g["tokens_per_expert"].index(n)]
    assert e["err_R"][i] == pytest.approx((sim - rows[i]["latency"]) / rows[i]["latency"], rel=1e-9)
    assert e["median_abs_err"] == pytest.approx(float(np.median(np.abs(e["err_R"]))))
