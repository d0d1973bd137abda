"""Device calibration: grouped-GEMM curves, dense matmul rate, copy bandwidths, links.

A calibration is a JSON file written by ``scripts/calibrate_gpu.py`` (measured on one
device) or by ``public_h100()`` here (built from public H100 figures, marked as such).
Grouped-GEMM curves are tables ``ms[k][n]``: one SwiGLU grouped GEMM (three matmuls) over
k experts of n tokens each, forward and backward, per expert shape ``DIMxHIDDEN``.

    python -m titan_foremoe.simulator.calibration --public-h100 calibrations/h100_public.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .fused_moe import FusedMoeCost, GemmTable
from .grouped_mm import LANDING_OVERLAP, GroupedMMCost, kernel_of

CALIBRATIONS = Path(__file__).resolve().parents[2] / "calibrations"
DEFAULT_CALIBRATION = CALIBRATIONS / "h100_measured.json"  # NVIDIA's measured tables; h100_public.json: datasheet
DEVICE_CALIBRATIONS = {"h100": CALIBRATIONS / "h100_measured.json", "h200": CALIBRATIONS / "h200_measured.json",
                       "h100_public": CALIBRATIONS / "h100_public.json"}
TOKENS_GRID = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
EXPERTS_GRID = [1, 2, 4, 8, 16, 32]
# expert kernels of a measured calibration: what the runtime runs (default), and vLLM's inference kernel
EXPERT_KERNELS = ("grouped_mm", "vllm_fused_moe")


def shape_key(dim: int, hidden: int) -> str:
    return f"{dim}x{hidden}"


@dataclass
class GemmCurve:
    """Interpolated SwiGLU grouped-GEMM time (ms) of k experts with n tokens each."""

    experts_K: np.ndarray
    tokens_N: np.ndarray
    fwd_KN: np.ndarray
    bwd_KN: np.ndarray

    def per_expert_ms(self, n: np.ndarray, k: np.ndarray, backward: bool) -> np.ndarray:
        """Time share of one expert with n tokens on a rank running k experts: T(n, k) / k.

        Piecewise linear in n (linear extrapolation past the grid) and in k: a rank's time grows by
        about one expert's work per expert, so between grid points (4, 8) a rank of 5 pays one more
        expert, not the convex log2-k blend (that charged a 5-expert rank ~3% more per expert than
        either neighbour on the public H100 curve, which is affine in k).
        """
        table = self.bwd_KN if backward else self.fwd_KN
        n = np.asarray(n, dtype=np.float64)
        k = np.clip(np.asarray(k, dtype=np.float64), self.experts_K[0], self.experts_K[-1])
        kk = self.experts_K
        j = np.clip(np.searchsorted(kk, k, side="right") - 1, 0, len(kk) - 2)
        w = np.clip((k - kk[j]) / (kk[j + 1] - kk[j]), 0.0, 1.0)
        t = (1 - w) * self._interp_n(table, j, n) + w * self._interp_n(table, j + 1, n)
        return np.where(n > 0, t / np.maximum(k, 1), 0.0)

    def _interp_n(self, table: np.ndarray, j: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Piecewise linear in n; below the grid the first point's time (a launch-bound kernel does not get
        cheaper), above it the last segment's slope (>= 0: the tables are monotone, ``monotone_table``)."""
        x = self.tokens_N.astype(np.float64)
        i = np.clip(np.searchsorted(x, n, side="right") - 1, 0, len(x) - 2)
        y0, y1 = table[j, i], table[j, i + 1]
        return y0 + (y1 - y0) * (np.maximum(n, x[0]) - x[i]) / (x[i + 1] - x[i])

    def rank_ms(self, tokens_XE: np.ndarray, backward: bool) -> np.ndarray:
        """Grouped-GEMM time of each rank from its tokens per expert (last axis)."""
        tokens_XE = np.asarray(tokens_XE)
        k_X = (tokens_XE > 0).sum(axis=-1)
        idx = np.nonzero(tokens_XE > 0)  # most experts of a rank have no tokens: evaluate the others only
        out = np.zeros(tokens_XE.shape[:-1])
        t = self.per_expert_ms(tokens_XE[idx], k_X[idx[:-1]], backward)
        np.add.at(out, idx[:-1], t)
        return out


@dataclass
class Calibration:
    raw: dict
    path: str
    _gemm: GemmTable | None = None

    @property
    def kind(self) -> str:
        return self.raw.get("kind", "measured")

    def curve(self, dim: int, hidden: int, kernel: str = "grouped_mm", slot_path: str = "inplace"
              ) -> "GemmCurve | FusedMoeCost | GroupedMMCost":
        """Expert time model of shape (dim, hidden). Measured calibrations: ``grouped_mm`` (default) is
        torch._grouped_mm forward / backward with permute and slot gather as the runtime runs them
        (``grouped_mm.py``); ``vllm_fused_moe`` the fitted model of vLLM's fused Triton kernel (inference).
        Others (datasheet, calibrate_gpu.py): the grouped-GEMM table of that shape. A calibration with
        ``slot_swiglu`` tables (``scripts/gpu_check.sh``: the runtime's slot SwiGLU timed per path, the permute
        not included) gives that path's table for ``slot_path`` "inplace" / "gather", the dense
        ``torch._grouped_mm`` table (``grouped_mm``) for "none" (torchtitan's path, balancer ``off``)."""
        if kernel not in EXPERT_KERNELS:
            raise ValueError(f"unknown expert kernel {kernel!r}; choose from {EXPERT_KERNELS}")
        slot = self.raw.get("slot_swiglu", {}).get(shape_key(dim, hidden), {})
        if kernel == "grouped_mm" and slot_path in slot:  # our slot kernel as measured (scripts/gpu_check.sh)
            return _table_curve(slot[slot_path], f"calibration {self.path}: slot_swiglu {shape_key(dim, hidden)} "
                                                 f"{slot_path}")
        if kernel == "grouped_mm" and "grouped_mm_kernel" in self.raw:
            overlap = self.raw.get("copies", {}).get("landing_overlap", LANDING_OVERLAP)  # gpu_check.sh's, measured
            return GroupedMMCost(kernel_of(self.raw), dim, hidden, slot_path=slot_path, landing_overlap=overlap)
        if "fused_moe" in self.raw:
            return self.fused(dim, hidden)
        return self.gemm_curve(dim, hidden)

    def gemm_table(self) -> GemmTable | None:
        """The measured bf16 GEMM rows (None for calibrations without them)."""
        if "gemm_table" not in self.raw:
            return None
        if self._gemm is None:
            self._gemm = GemmTable(self.raw["gemm_table"])
        return self._gemm

    @property
    def hbm_GBps(self) -> float:
        """HBM bandwidth: the measured tables' (grouped_mm_kernel.hbm_GBps), else the datasheet figure x 0.8."""
        datasheet = H100["hbm_TBps"] * 1e3 * H100["hbm_achieved_fraction"]
        return float(self.raw.get("grouped_mm_kernel", {}).get("hbm_GBps", datasheet))

    def fused(self, dim: int, hidden: int) -> FusedMoeCost:
        if "fused_moe" not in self.raw or "gemm_table" not in self.raw:
            raise ValueError(f"calibration {self.path} has no fused_moe / gemm_table fields "
                             "(write it with scripts/calibrate_from_aiconfigurator.py)")
        if self._gemm is None:
            self._gemm = GemmTable(self.raw["gemm_table"])
        return FusedMoeCost(np.asarray(self.raw["fused_moe"]["coeffs_ms"], dtype=np.float64), self._gemm, dim, hidden)

    def gemm_curve(self, dim: int, hidden: int) -> GemmCurve:
        key = shape_key(dim, hidden)
        g = self.raw["grouped_mm"].get(key)
        if g is None:
            raise ValueError(f"calibration {self.path} has no grouped_mm curve for expert shape {key} "
                             f"(has {sorted(self.raw['grouped_mm'])}); run scripts/calibrate_gpu.py for it")
        return _table_curve(g, f"calibration {self.path}: grouped_mm {key}")

    @property
    def dense_tflops(self) -> float:
        return float(self.raw["dense_matmul"]["achieved_tflops"])

    def copies(self) -> dict:
        return self.raw["copies"]

    def links(self) -> dict:
        return self.raw["links"]


def isotonic(y: np.ndarray) -> np.ndarray:
    """The least-squares non-decreasing fit of ``y`` (pool adjacent violators): a dip is averaged with what it
    dips below, not lifted to the maximum, so one slow outlier does not raise every larger shape."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in np.asarray(y, dtype=np.float64):
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return np.concatenate([np.full(int(c), s / c) for s, c in blocks])


def monotone_table(ms_KN: np.ndarray) -> np.ndarray:
    """A ``ms[k][n]`` table made non-decreasing in tokens per group (each row) and then in groups (each column).
    The isotonic fit preserves order (inputs ordered elementwise stay ordered), so the column pass keeps the
    rows monotone. A monotone table (every published and GPU-measured one so far) comes back unchanged."""
    rows = np.stack([isotonic(r) for r in np.asarray(ms_KN, dtype=np.float64)])
    return np.stack([isotonic(c) for c in rows.T]).T


def _table_curve(g: dict, name: str = "table") -> GemmCurve:
    """A ``ms[k][n]`` table (``experts_per_rank`` x ``tokens_per_expert``, ``fwd_ms``, ``bwd_ms``) as a curve,
    made monotone (``monotone_table``: a loaded CPU measured 2 groups x 1 row slower than 2 x 8, and the linear
    extrapolation of that dip charged a step -455,631 ms); a time still <= 0 after the fit is refused in one line."""
    K, N = np.asarray(g["experts_per_rank"], dtype=np.float64), np.asarray(g["tokens_per_expert"])
    tables = {key: monotone_table(g[key]) for key in ("fwd_ms", "bwd_ms")}
    for key, t in tables.items():
        if t.shape != (len(K), len(N)):
            raise ValueError(f"{name} {key}: shape {list(t.shape)}, expected [{len(K)}, {len(N)}] "
                             f"(experts_per_rank x tokens_per_expert)")
        if not (t > 0).all():
            k, n = np.argwhere(~(t > 0))[0]
            raise ValueError(f"{name} {key}[k={K[k]:g}][n={N[n]}] is {t[k, n]:g} ms after the monotone fit: a "
                             "calibration must predict a positive time for every shape (re-measure it)")
    return GemmCurve(K, N, tables["fwd_ms"], tables["bwd_ms"])


def load_calibration(path: str | Path | None = None) -> Calibration:
    """Read a calibration JSON; `path` may also name a device: h100, h200 (measured) or h100_public."""
    path = DEVICE_CALIBRATIONS.get(str(path), path)
    path = Path(path or DEFAULT_CALIBRATION)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"calibration file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration file {path} is not JSON: {exc}") from None
    for key in ("grouped_mm", "dense_matmul", "copies", "links"):
        if key not in raw:
            raise ValueError(f"calibration {path} is missing the field '{key}'")
    return Calibration(raw, str(path))


# Public H100 SXM5 figures (see README "Cluster simulator" for the sources).
H100 = {
    "dense_bf16_peak_tflops": 989.0,  # NVIDIA H100 datasheet, SXM5, dense (no sparsity)
    "achieved_fraction": 0.65,  # assumed: large bf16 GEMMs reach ~600-700 TFLOP/s in public benchmarks
    "hbm_TBps": 3.35,  # HBM3, datasheet
    "hbm_achieved_fraction": 0.8,  # assumed
    "nvlink_GBps_per_direction": 450.0,  # NVLink 4: 900 GB/s bidirectional per GPU
    "nvlink_achieved_fraction": 0.8,  # assumed for all-to-all / p2p (NCCL busbw on H100 DGX ~ 360 GB/s)
    "ib_Gbps_per_gpu": 400.0,  # ConnectX-7 NDR, one per GPU (DGX H100)
    "ib_achieved_fraction": 0.9,  # assumed
    "pcie_h2d_GBps": 55.0,  # PCIe Gen5 x16: 64 GB/s raw, ~55 GB/s achieved pinned H2D
    "small_m_half_tokens": 64,  # assumed: a grouped GEMM reaches half its rate at 64 rows per expert
    "launch_us": 8.0,  # assumed per kernel launch
    "a2a_latency_us": 25.0,  # assumed per all-to-all (NCCL small-message latency order)
    "gemm_slowdown_with_h2d": 0.02,  # assumed: copy engine, no SMs, a little HBM bandwidth
    "gemm_slowdown_with_p2p": 0.06,  # assumed: NCCL p2p kernels take a few SMs
}


def _public_curve(dim: int, hidden: int) -> dict:
    """Roofline grouped SwiGLU on H100: FLOPs at a rate that grows with rows per expert, HBM floor."""
    h = H100
    rate = h["dense_bf16_peak_tflops"] * 1e12 * h["achieved_fraction"]
    hbm = h["hbm_TBps"] * 1e12 * h["hbm_achieved_fraction"]
    K = np.array(EXPERTS_GRID, dtype=np.float64)[:, None]
    N = np.array(TOKENS_GRID, dtype=np.float64)[None, :]
    eff = N / (N + h["small_m_half_tokens"])
    flops = 2.0 * 3 * dim * hidden * N * K
    w_bytes = 3.0 * dim * hidden * 2 * K
    a_bytes = N * K * (2 * dim + 3 * hidden) * 2
    fwd = np.maximum(flops / (rate * eff), (w_bytes + a_bytes) / hbm) + 4 * h["launch_us"] * 1e-6
    bwd = np.maximum(2 * flops / (rate * eff), (3 * w_bytes + 2 * a_bytes) / hbm) + 8 * h["launch_us"] * 1e-6
    return {"dim": dim, "hidden": hidden, "dtype": "bfloat16", "experts_per_rank": EXPERTS_GRID,
            "tokens_per_expert": TOKENS_GRID, "fwd_ms": (fwd * 1e3).round(6).tolist(),
            "bwd_ms": (bwd * 1e3).round(6).tolist()}


def public_h100(shapes: list[tuple[int, int]]) -> dict:
    h = H100
    return {
        "kind": "public_figures",
        "note": ("NOT MEASURED: built from public NVIDIA H100 SXM5 specifications and stated assumptions "
                 "(fields marked 'assumed' in 'figures'); replace with scripts/calibrate_gpu.py output on a real H100."),
        "sources": [
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, NVLink 900 GB/s",
            "NVIDIA DGX H100 user guide: 8x ConnectX-7 400 Gb/s NDR InfiniBand, one per GPU",
            "PCI-SIG PCIe 5.0 x16: 64 GB/s per direction raw (~55 GB/s achieved pinned host-to-device)",
        ],
        "figures": h,
        "device": "NVIDIA H100 80GB HBM3 (public figures)",
        "torch": None,
        "date": datetime.date.today().isoformat(),
        "dense_matmul": {"dtype": "bfloat16", "peak_tflops": h["dense_bf16_peak_tflops"],
                         "achieved_fraction": h["achieved_fraction"],
                         "achieved_tflops": h["dense_bf16_peak_tflops"] * h["achieved_fraction"]},
        "grouped_mm": {shape_key(d, f): _public_curve(d, f) for d, f in shapes},
        "copies": {"h2d_pinned_GBps": h["pcie_h2d_GBps"], "d2d_GBps": h["hbm_TBps"] * 1e3 * h["hbm_achieved_fraction"] / 2,
                   "gemm_slowdown_with_h2d": h["gemm_slowdown_with_h2d"],
                   "gemm_slowdown_with_d2d": h["gemm_slowdown_with_p2p"]},
        "links": {"nvlink_GBps": h["nvlink_GBps_per_direction"] * h["nvlink_achieved_fraction"],
                  "ib_GBps": h["ib_Gbps_per_gpu"] / 8 * h["ib_achieved_fraction"],
                  "a2a_latency_us": h["a2a_latency_us"], "source": "public figures (see sources)"},
    }


def main(argv=None) -> int:
    from .models import MODELS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--public-h100", required=True, metavar="OUT_JSON")
    a = p.parse_args(argv)
    shapes = sorted({(m.dim, m.moe_hidden) for m in MODELS.values()})
    Path(a.public_h100).write_text(json.dumps(public_h100(shapes), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
