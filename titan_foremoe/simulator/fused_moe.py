"""Expert time from measured kernels: a fitted fused-MoE forward and the GEMM rows' backward / forward ratio.

Why not a sum of per-expert GEMM rows: vLLM's fused Triton MoE (the measured ``moe_perf`` rows) runs all
local experts in one launch and, under EP, still touches every routed (token, expert) pair of the batch;
its latency barely falls with EP at fixed tokens. Four measured effects, one coefficient each:

    forward_ms = c_launch + c_weight * active_experts * 3 D F * 2 B          (weights read once per used expert)
               + c_flop * 6 D F * local_pairs                                (the SwiGLU matmuls)
               + c_pair * scanned_pairs * (D + F) * 2 B                       (per-pair gather/activation/scatter)

fitted by non-negative least squares on relative error (``scripts/calibrate_from_aiconfigurator.py``) over
the balanced bf16 rows of half the measured shapes; the other half are held back. In vLLM's EP path
``scanned_pairs`` = tokens x top-k of the whole batch; in our runtime a rank's kernel sees only the pairs
dispatched to it, so the simulator charges scanned = local pairs.

Backward (dgrad + wgrad) = forward x (sum of measured bf16 GEMM rows at the backward shapes / at the
forward shapes), per rank over its experts' token counts: the measured backward-to-forward cost of the
same work, carried onto the fused kernel's efficiency.

Legend: X any leading axes (micro-step, layer, rank), E experts (or slots) of a rank, G grid of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FEATURES = ("launch", "weight_bytes", "flops", "pair_bytes")


def features_XF(tokens_XE: np.ndarray, scanned_X: np.ndarray, dim: int, ffn: int) -> np.ndarray:
    """The four regressors (see module doc) for each rank: [..., 4]."""
    tokens_XE = np.asarray(tokens_XE, dtype=np.float64)
    active_X = (tokens_XE > 0).sum(axis=-1)
    local_X = tokens_XE.sum(axis=-1)
    return np.stack([np.ones_like(local_X), active_X * 6.0 * dim * ffn, local_X * 6.0 * dim * ffn,
                     np.asarray(scanned_X, dtype=np.float64) * 2.0 * (dim + ffn)], axis=-1)


class GemmTable:
    """Measured bf16 GEMM latency (ms) at (m, n, k): linear in m between measured m (same n, k); past the
    largest m, proportional to m; an (n, k) off the table's grid reads the next measured (n, k) up, scaled by
    the work ratio; a reduction k below the grid's smallest reads that k (launch-bound there)."""

    def __init__(self, rows: list):
        r = np.asarray(rows, dtype=np.float64)
        self.grid = np.unique(r[:, 1])
        self.kgrid = np.unique(r[:, 2])
        self._by_nk = {}
        for n, k in {(a, b) for a, b in r[:, 1:3]}:
            s = r[(r[:, 1] == n) & (r[:, 2] == k)]
            s = s[np.argsort(s[:, 0])]
            self._by_nk[(int(n), int(k))] = (s[:, 0], s[:, 3])

    def _snap(self, x: float, grid: np.ndarray) -> int:
        i = min(int(np.searchsorted(grid, x)), len(grid) - 1)
        return int(grid[i])

    def __call__(self, m, n: int, k: int) -> np.ndarray:
        m = np.asarray(m, dtype=np.float64)
        nn, kk = self._snap(n, self.grid), self._snap(k, self.kgrid)
        if (nn, kk) not in self._by_nk:
            raise ValueError(f"no measured bf16 GEMM rows at n={nn} k={kk}")
        ms, lat = self._by_nk[(nn, kk)]
        t = np.interp(m, ms, lat)
        t = np.where(m > ms[-1], lat[-1] * m / ms[-1], t)
        return t * (n * k) / (nn * kk)

    def wgrad(self, rows_out: int, cols: int, tokens) -> np.ndarray:
        """Weight gradient (rows_out x cols) reducing over `tokens`: k = tokens, m = rows_out."""
        tokens = np.asarray(tokens, dtype=np.float64)
        ks = self.kgrid
        lat = np.array([float(self(rows_out, cols, int(k))) for k in ks])
        return np.where(tokens > ks[-1], lat[-1] * tokens / ks[-1], np.interp(tokens, ks, lat))

    def swiglu_ms(self, n, dim: int, ffn: int, backward: bool) -> np.ndarray:
        """One expert with n tokens: forward gate+up and down; backward dgrad + wgrad at their real shapes."""
        if not backward:
            return self(n, 2 * ffn, dim) + self(n, dim, ffn)
        return self(n, dim, 2 * ffn) + self(n, ffn, dim) + self.wgrad(2 * ffn, dim, n) + self.wgrad(dim, ffn, n)


@dataclass
class FusedMoeCost:
    """Per-rank expert time (ms) of one MoE layer on a device with measured fused-MoE coefficients."""

    coeffs: np.ndarray  # [4], ms per feature unit, FEATURES order
    gemm: GemmTable
    dim: int
    ffn: int
    _ratio_grid: tuple = field(default=None, repr=False)

    def forward_ms(self, tokens_XE: np.ndarray, scanned_X: np.ndarray | None = None) -> np.ndarray:
        """Fused forward of each rank; scanned pairs default to the rank's own (dispatched) pairs."""
        tokens_XE = np.asarray(tokens_XE, dtype=np.float64)
        scanned_X = tokens_XE.sum(axis=-1) if scanned_X is None else scanned_X
        t = features_XF(tokens_XE, scanned_X, self.dim, self.ffn) @ self.coeffs
        return np.where(tokens_XE.sum(axis=-1) > 0, t, 0.0)

    def _gemm_ms(self, tokens_XE: np.ndarray, backward: bool) -> np.ndarray:
        if self._ratio_grid is None:
            g = np.unique(np.concatenate([[1.0], 2.0 ** np.arange(0, 21), self.gemm.grid]))
            self._ratio_grid = (g, self.gemm.swiglu_ms(g, self.dim, self.ffn, False),
                                self.gemm.swiglu_ms(g, self.dim, self.ffn, True))
        g, f, b = self._ratio_grid
        t = np.interp(tokens_XE, g, b if backward else f)
        return np.where(tokens_XE > 0, t, 0.0).sum(axis=-1)

    def rank_ms(self, tokens_XE: np.ndarray, backward: bool) -> np.ndarray:
        """Expert time of each rank from its tokens per expert (last axis), as the simulator's GemmCurve."""
        tokens_XE = np.asarray(tokens_XE, dtype=np.float64)
        fwd = self.forward_ms(tokens_XE)
        if not backward:
            return fwd
        f = self._gemm_ms(tokens_XE, False)
        return np.where(f > 0, fwd * self._gemm_ms(tokens_XE, True) / np.maximum(f, 1e-30), 0.0)


def fit_nnls(X_RF: np.ndarray, y_R: np.ndarray, iters: int = 20000) -> np.ndarray:
    """Non-negative least squares on relative error: min || (X c - y) / y ||, c >= 0 (projected Newton on
    the active set; small F, numpy only so CI can re-fit)."""
    A = X_RF / y_R[:, None]
    scale = np.linalg.norm(A, axis=0)
    A = A / scale
    b = np.ones(len(y_R))
    free = np.ones(A.shape[1], dtype=bool)
    for _ in range(A.shape[1] + 1):  # drop negative coefficients one at a time (Lawson-Hanson-like)
        c = np.zeros(A.shape[1])
        c[free] = np.linalg.lstsq(A[:, free], b, rcond=None)[0]
        if (c >= 0).all():
            break
        free[np.argmin(np.where(free, c, np.inf))] = False
    return np.maximum(c, 0) / scale
