"""Write a simulator calibration from NVIDIA's measured kernel tables (aiconfigurator-core).

No GPU is available to this project; ``aiconfigurator-core`` (Apache-2.0) ships parquet tables measured
on H100/H200 SXM. This script turns the rows we need into the calibration schema of
``titan_foremoe/simulator/calibration.py`` and records every row it used, so CI and users read the
committed JSON and never need the package:

    /tmp/aic/bin/python scripts/calibrate_from_aiconfigurator.py --device h100 calibrations/h100_measured.json
    /tmp/aic/bin/python scripts/calibrate_from_aiconfigurator.py --device h200 calibrations/h200_measured.json
    /tmp/aic/bin/python scripts/calibrate_from_aiconfigurator.py --device h100 --check calibrations/h100_measured.json

Grouped SwiGLU per expert with n tokens, expert shape (D, F), from measured bf16 GEMM rows (m, n, k):
forward  = gemm(n, 2F, D) + gemm(n, D, F)                      (gate+up, down)
backward = dgrad gemm(n, D, 2F) + gemm(n, F, D) + wgrad gemm(2F, D, n) + gemm(D, F, n)
k experts cost k times one expert (``grouped_mm``: the datasheet-era per-expert model, kept for comparison).
The simulator's expert time is ``fused_moe`` (``titan_foremoe/simulator/fused_moe.py``): four coefficients
fitted on the balanced bf16 fused-MoE rows of half the measured shapes (every other shape in sorted order,
Qwen3-30B-A3B's always held back), the rest held back; backward = fused forward x measured GEMM
backward / forward (``gemm_table``). NVLink all-to-all by message size from the NCCL alltoall rows
(``links.nvlink_a2a``). ``grouped_mm_kernel``: the torch._grouped_mm model's constants
(``titan_foremoe/simulator/grouped_mm.py``, fitted on published figures with the H100 rows). Cases the tables do
not cover are marked "stand_in" with the reason.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titan_foremoe.simulator.calibration import EXPERTS_GRID, TOKENS_GRID, H100, shape_key  # noqa: E402
from titan_foremoe.simulator.collector_sampling import rank0_counts_DK  # noqa: E402
from titan_foremoe.simulator.fused_moe import FEATURES, features_XF, fit_nnls  # noqa: E402
from titan_foremoe.simulator.grouped_mm import kernel_block  # noqa: E402

DEVICES = {"h100": "h100_sxm", "h200": "h200_sxm"}
FRAMEWORK, VERSION, NCCL_VERSION = "vllm", "0.24.0", "2.29.2"
SHAPES = [(2048, 768), (2880, 2880), (7168, 2048)]  # Qwen3-30B-A3B, gpt-oss-20b, DeepSeek-V3 (dim, moe_ffn)
QWEN = dict(hidden_size=2048, inter_size=768, num_experts=128, topk=8)


def _data_root(device: str) -> Path:
    import aiconfigurator_core
    return Path(aiconfigurator_core.__file__).parent / "systems" / "data" / DEVICES[device]


class Gemm:
    """bf16 GEMM latency (ms) at (m, n, k): exact row, else linear in m between measured m (same n, k)."""

    def __init__(self, df):
        self.df = df[(df.gemm_dtype == "bfloat16")]
        self.used: dict[tuple, float] = {}
        self.off_grid: set[tuple] = set()

    def __call__(self, m: int, n: int, k: int) -> float:
        grid = np.sort(self.df.n.unique())
        if n not in grid or k not in grid:  # off-grid shape: next measured (n, k) up, scaled by the work ratio
            nn, kk = int(grid[np.searchsorted(grid, n)]), int(grid[np.searchsorted(grid, k)])
            self.off_grid.add((n, k, nn, kk))
            return self(m, nn, kk) * (n * k) / (nn * kk)
        rows = self.df[(self.df.n == n) & (self.df.k == k)].sort_values("m")
        if rows.empty:
            raise ValueError(f"no measured bf16 GEMM rows at n={n} k={k}")
        ms, lat = rows.m.to_numpy(np.float64), rows.latency.to_numpy(np.float64)
        t = float(np.interp(m, ms, lat, left=lat[0], right=np.nan))
        if np.isnan(t):  # past the largest measured m: scale by m (compute bound)
            t = float(lat[-1] * m / ms[-1])
        for mm in ms[max(0, np.searchsorted(ms, m) - 1): np.searchsorted(ms, m) + 1]:
            self.used[(int(mm), n, k)] = float(lat[ms == mm][0])
        return t

    def wgrad(self, m: int, n: int, tokens: int) -> float:
        """Weight gradient: reduction dim = tokens. The table's k starts at 32: smaller k stands at k=32."""
        ks = np.array([32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])
        if len(ks) == 0:
            raise ValueError(f"no measured bf16 GEMM rows at m={m} n={n}")
        lat = np.array([self(m, n, int(k)) for k in ks])
        return float(np.interp(tokens, ks, lat, left=lat[0], right=np.nan)) if tokens <= ks[-1] \
            else float(lat[-1] * tokens / ks[-1])


def _curve(g: Gemm, dim: int, ffn: int) -> dict:
    fwd, bwd = [], []
    for n in TOKENS_GRID:
        f = g(n, 2 * ffn, dim) + g(n, dim, ffn)
        b = g(n, dim, 2 * ffn) + g(n, ffn, dim) + g.wgrad(2 * ffn, dim, n) + g.wgrad(dim, ffn, n)
        fwd.append(f)
        bwd.append(b)
    fwd_KN = np.outer(EXPERTS_GRID, fwd)
    bwd_KN = np.outer(EXPERTS_GRID, bwd)
    return {"dim": dim, "hidden": ffn, "dtype": "bfloat16", "experts_per_rank": EXPERTS_GRID,
            "tokens_per_expert": TOKENS_GRID, "fwd_ms": fwd_KN.round(6).tolist(), "bwd_ms": bwd_KN.round(6).tolist(),
            "source": "measured bf16 GEMM rows (see provenance.gemm_rows_used); k experts = k x one expert"}


MOE_COLUMNS = ["hidden_size", "inter_size", "num_experts", "topk", "moe_ep_size", "num_tokens", "latency"]


def _shape_name(r) -> str:
    return f"{int(r[0])}x{int(r[1])}x{int(r[2])}x{int(r[3])}"


def fused_fit(mdf) -> dict:
    """Fit the fused-MoE coefficients on the balanced rows of every other measured shape (sorted order;
    Qwen3-30B-A3B's never in the fit); keep all balanced and power_law_1.2 rows for held-back checks."""
    b = mdf[(mdf.moe_dtype == "bfloat16") & (mdf.moe_tp_size == 1)]
    tables = {d: b[b.distribution == d][MOE_COLUMNS].sort_values(MOE_COLUMNS[:6]).to_numpy(np.float64)
              for d in ("balanced", "power_law_1.2")}
    rows = tables["balanced"]
    names = [_shape_name(r) for r in rows]
    qwen = _shape_name([QWEN["hidden_size"], QWEN["inter_size"], QWEN["num_experts"], QWEN["topk"]])
    shapes = sorted(set(names))
    train = [s for i, s in enumerate(shapes) if i % 2 == 0 and s != qwen]
    X = np.stack([features_XF(rank0_counts_DK("balanced", int(T), int(E), int(k), int(ep))[0],
                              T * k, int(D), int(F)) for D, F, E, k, ep, T, _ in rows])
    tr = np.array([n in train for n in names])
    c = fit_nnls(X[tr], rows[tr, 6])
    return {"features": list(FEATURES), "coeffs_ms": c.tolist(), "kernel": "vllm 0.24.0 Triton fused MoE, bf16",
            "fit": "non-negative least squares on relative error, balanced rows of train_shapes only",
            "train_shapes": train, "held_back_shapes": [s for s in shapes if s not in train],
            "columns": MOE_COLUMNS,
            "rows": {d: [[int(x) for x in r[:6]] + [round(float(r[6]), 7)] for r in t] for d, t in tables.items()}}


def gemm_table(gdf) -> list:
    """bf16 GEMM rows at power-of-two m (and every measured n, k): enough to rebuild any expert shape."""
    g = gdf[(gdf.gemm_dtype == "bfloat16") & np.isin(gdf.m, 2 ** np.arange(0, 20))]
    return [[int(r.m), int(r.n), int(r.k), round(float(r.latency), 7)] for r in g.sort_values(["n", "k", "m"]).itertuples()]


def a2a_curves(c) -> dict:
    """NCCL alltoall latency by bytes per rank (half rows: message_size counts 2-byte elements)."""
    out = {}
    for n in (2, 4, 8):
        a = c[(c.op_name == "alltoall") & (c.num_gpus == n) & (c.nccl_dtype == "half")].sort_values("message_size")
        out[str(n)] = {"bytes": [int(x) * 2 for x in a.message_size], "ms": [round(float(x), 6) for x in a.latency]}
    return out


def build(device: str) -> dict:
    import aiconfigurator_core
    import pandas as pd

    root = _data_root(device)
    gemm_path = root / "gemm" / FRAMEWORK / VERSION / "gemm_perf.parquet"
    moe_path = root / "moe" / FRAMEWORK / VERSION / "moe_perf.parquet"
    nccl_path = root / "comm" / "nccl" / NCCL_VERSION / "nccl_perf.parquet"
    gdf = pd.read_parquet(gemm_path)
    g = Gemm(gdf)
    grouped = {shape_key(d, f): _curve(g, d, f) for d, f in SHAPES}
    big = g(8192, 8192, 8192)
    dense_tflops = 2 * 8192 ** 3 / (big * 1e-3) / 1e12

    c = pd.read_parquet(nccl_path)
    a2a = c[(c.op_name == "alltoall") & (c.num_gpus == 8)].sort_values("message_size")
    # message_size is bytes: read as elements the largest row would exceed NVLink 4's 450 GB/s per direction.
    top = a2a.iloc[-1]
    a2a_GBps = float(top.message_size) * 7 / 8 / (float(top.latency) * 1e-3) / 1e9
    ag = c[(c.op_name == "all_gather") & (c.num_gpus == 8)].sort_values("message_size").iloc[-1]
    ag_GBps = float(ag.message_size) * 7 / 8 / (float(ag.latency) * 1e-3) / 1e9
    a2a_lat_us = float(a2a.iloc[0].latency) * 1e3

    m = pd.read_parquet(moe_path)
    q = m[(m.hidden_size == QWEN["hidden_size"]) & (m.inter_size == QWEN["inter_size"])
          & (m.num_experts == QWEN["num_experts"]) & (m.topk == QWEN["topk"]) & (m.moe_dtype == "bfloat16")
          & (m.moe_tp_size == 1)]
    moe_rows = q[["num_tokens", "moe_ep_size", "distribution", "latency"]].sort_values(
        ["distribution", "moe_ep_size", "num_tokens"]).to_dict("records")
    dev_name = str(gdf.device.iloc[0])
    return {
        "kind": "measured_tables",
        "note": (f"Built from NVIDIA aiconfigurator-core {aiconfigurator_core.__version__ if hasattr(aiconfigurator_core, '__version__') else '0.12.0'} "
                 f"tables measured on {dev_name}; links/copies not in the tables are stand-ins (see stand_in)."),
        "device": dev_name,
        "torch": None,
        "provenance": {
            "package": "aiconfigurator-core==0.12.0",
            "tables": {k: str(p.relative_to(root.parents[2])) for k, p in
                       {"gemm": gemm_path, "moe": moe_path, "nccl": nccl_path}.items()},
            "framework": f"{FRAMEWORK} {VERSION}", "gemm_kernel": "torch.nn.functional.linear", "dtype": "bfloat16",
            "moe_kernel": str(q.kernel_source.iloc[0]) if len(q) else None,
            "nccl": f"nccl {NCCL_VERSION}, 8 GPUs, one node",
            "gemm_rows_used": [[*k, v] for k, v in sorted(g.used.items())],
            "off_grid_shapes_scaled": [list(x) for x in sorted(g.off_grid)],
        },
        "dense_matmul": {"dtype": "bfloat16", "achieved_tflops": round(dense_tflops, 3),
                         "source": f"measured gemm(8192, 8192, 8192) = {big:.6f} ms"},
        "grouped_mm": grouped,
        "fused_moe": fused_fit(m),
        "gemm_table": gemm_table(gdf),
        "copies": {"h2d_pinned_GBps": H100["pcie_h2d_GBps"], "d2d_GBps": round(ag_GBps, 3),
                   "gemm_slowdown_with_h2d": H100["gemm_slowdown_with_h2d"],
                   "gemm_slowdown_with_d2d": H100["gemm_slowdown_with_p2p"]},
        "links": {"nvlink_GBps": round(a2a_GBps, 3), "ib_GBps": H100["ib_Gbps_per_gpu"] / 8 * H100["ib_achieved_fraction"],
                  "a2a_latency_us": round(a2a_lat_us, 3), "nvlink_a2a": a2a_curves(c),
                  "source": f"nvlink: NCCL alltoall 8 GPUs {int(top.message_size)} B in {float(top.latency):.5f} ms (busbw); "
                            f"a2a latency: smallest alltoall row"},
        "stand_in": {
            "ib_GBps": "public ConnectX-7 NDR figure x0.9: the NCCL table covers one node (2-8 GPUs) only",
            "h2d_pinned_GBps": "public PCIe 5 figure: no host-copy table",
            "d2d_GBps": "NCCL all_gather busbw at 8 GPUs (weight moves are all-gathers/sends over NVLink)",
            "gemm_slowdown_*": "assumed, as in h100_public.json: no overlap measurement in the tables",
            "nvlink_a2a": "NCCL alltoall rows (one node, 2/4/8 GPUs) by bytes per rank; DeepEP rows (EP 8, one node) are "
                          "not used for time: our runtime's all-to-all is NCCL's",
            "wgrad_k_below_32": "the GEMM table's k starts at 32: weight-gradient GEMMs of fewer tokens read the k=32 row",
        },
        "moe_rows": {"shape": QWEN, "framework": f"{FRAMEWORK} {VERSION}", "latency_unit": "ms",
                     "rows": moe_rows},
    }


def check(device: str, path: Path) -> int:
    """Re-read the parquet and compare every row the JSON claims."""
    import pandas as pd

    raw = json.loads(path.read_text())
    root = _data_root(device)
    gdf = pd.read_parquet(root / "gemm" / FRAMEWORK / VERSION / "gemm_perf.parquet")
    gdf = gdf[gdf.gemm_dtype == "bfloat16"]
    bad = 0
    for m, n, k, lat in raw["provenance"]["gemm_rows_used"]:
        r = gdf[(gdf.m == m) & (gdf.n == n) & (gdf.k == k)]
        bad += int(len(r) != 1 or abs(float(r.latency.iloc[0]) - lat) > 1e-9)
    mdf = pd.read_parquet(root / "moe" / FRAMEWORK / VERSION / "moe_perf.parquet")
    s = raw["moe_rows"]["shape"]
    for row in raw["moe_rows"]["rows"]:
        r = mdf[(mdf.hidden_size == s["hidden_size"]) & (mdf.inter_size == s["inter_size"]) & (mdf.num_experts == s["num_experts"])
                & (mdf.topk == s["topk"]) & (mdf.moe_dtype == "bfloat16") & (mdf.moe_tp_size == 1)
                & (mdf.num_tokens == row["num_tokens"]) & (mdf.moe_ep_size == row["moe_ep_size"])
                & (mdf.distribution == row["distribution"])]
        bad += int(len(r) != 1 or abs(float(r.latency.iloc[0]) - row["latency"]) > 1e-9)
    n = len(raw["provenance"]["gemm_rows_used"]) + len(raw["moe_rows"]["rows"])
    g = gdf.set_index(["m", "n", "k"]).latency
    for m, nn, k, lat in raw.get("gemm_table", []):
        bad += int(abs(float(g.get((m, nn, k), np.nan)) - lat) > 1e-6 or not np.isfinite(g.get((m, nn, k), np.nan)))
    n += len(raw.get("gemm_table", []))
    f = mdf[(mdf.moe_dtype == "bfloat16") & (mdf.moe_tp_size == 1)].set_index(MOE_COLUMNS[:6] + ["distribution"]).latency
    for dist, rows in raw.get("fused_moe", {}).get("rows", {}).items():
        for r in rows:
            got = f.get(tuple(r[:6]) + (dist,), np.nan)
            bad += int(not abs(float(got) - r[6]) <= 1e-6)
            n += 1
    print(f"{path}: {n - bad}/{n} rows match the parquet")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=sorted(DEVICES), required=True)
    p.add_argument("--check", action="store_true", help="compare an existing JSON with the parquet rows")
    p.add_argument("out", type=Path)
    a = p.parse_args(argv)
    if a.check:
        return check(a.device, a.out)
    raw = build(a.device)
    # torch._grouped_mm constants (titan_foremoe/simulator/grouped_mm.py): fitted on the H100 rows; H200 takes them
    h100 = raw if a.device == "h100" else json.loads((Path(__file__).resolve().parents[1] / "calibrations"
                                                     / "h100_measured.json").read_text())
    raw["grouped_mm_kernel"] = kernel_block(raw, h100)
    text = json.dumps(raw, indent=1)
    # one line per innermost list of numbers (a table row): 15k rows stay readable and diffable
    text = re.sub(r"\[\s*([-+0-9.eE,\s]+?)\s*\]", lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
