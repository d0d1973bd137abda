"""Expert time of the kernels the runtime runs: ``torch._grouped_mm`` forward and backward, permute, slot gather.

The runtime (``models/moe.py`` ``grouped_swiglu``, ``models/slot_gemm.py``) runs per MoE layer and rank:
forward  three grouped GEMMs (2-D x 3-D): ``x @ w1^T``, ``x @ w3^T`` (rows x F, reduce D), ``h @ w2^T``
         (rows x D, reduce F); SiLU and the product (elementwise); the permute of the received rows into
         expert order and the unpermute after; with a placement, the slot gather of each matrix's C slots.
backward per matrix the data gradient (2-D x 3-D: ``g @ w``) and the weight gradient (2-D x 2-D,
         ``x^T @ g`` per group: out = the weight's shape, reduction over the group's rows); the
         elementwise backward; the permute's and unpermute's gradients; with a placement the slot
         re-gather and the ``index_add`` of slot gradients onto owned / bank rows.

Grouped GEMM time, from NVIDIA's measured dense bf16 GEMM rows (``gemm_table``) per group shape:

    call_ms = launch + sum_g max(gemm(rows_g, n, k) - launch, weight bytes / HBM) / eta

``launch``: the smallest measured GEMM row (a launch and nothing else); ``eta``: the grouped kernel's
efficiency relative to cuBLAS on the same group shapes, one number, fitted on published torch._grouped_mm
timings (``calibrations/grouped_mm_public.json``, role "fit"; the other figures are held back). The
weight gradient's group shape is ``gemm(m = out rows, n = out cols, k = group rows)``: a group of few rows is
a short reduction, which the measured rows charge at their (poor) efficiency. Memory-bound work (permute,
activation, slot gather) moves its bytes at the HBM rate of the fused-MoE fit's weight-read term (the
tables' only measured bandwidth), each kernel one launch.

    python -m titan_foremoe.simulator.grouped_mm --write     # fit eta, store it in the measured JSONs
    python -m titan_foremoe.simulator.grouped_mm --validate  # error per published figure
    python -m titan_foremoe.simulator.grouped_mm --validate --tile-cost  # the earlier form's errors

Legend: X leading axes (micro-step, layer, rank), E experts (groups) of a rank, G groups of one call.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .fused_moe import GemmTable

PUBLIC = Path(__file__).resolve().parents[2] / "calibrations" / "grouped_mm_public.json"
TILE = 128  # output tile edge of the CUTLASS SM90 grouped kernel (assumed)
FWD_KERNELS, BWD_KERNELS = 5, 7  # elementwise / copy kernels around the GEMMs (permute, silu, mul, unpermute, ...)


def hbm_Bps(raw: dict) -> float:
    """HBM bytes/s: the fused-MoE fit's weight-read coefficient (ms per byte of weights read)."""
    return 1.0 / (raw["fused_moe"]["coeffs_ms"][1] * 1e-3)


def launch_ms(gemm: GemmTable) -> float:
    return float(min(lat.min() for _, lat in gemm._by_nk.values()))


@dataclass
class GroupedMM:
    """One device's torch._grouped_mm model: measured dense rows, launch, HBM rate, grouped efficiency."""

    gemm: GemmTable
    eta: float
    launch: float  # ms
    hbm: float  # bytes / s
    tile_ms: float = 0.0  # fixed cost per 128 x 128 output tile on one SM (prologue / epilogue / group switch)
    sms: int = 132
    mem_scale: float = 1.0  # permute / activation / unpermute bytes multiplier (1 / their fraction of the HBM rate)
    _grid: dict = field(default_factory=dict, repr=False)

    def _group_ms(self, rows: np.ndarray, n: int, k: int, wgrad: bool) -> np.ndarray:
        """Per-group time (ms, launch apart) of gemm(rows, n, k), or of the weight gradient of an n x k
        weight over `rows` rows; interpolated on a log grid of rows (exact at the grid)."""
        key = (n, k, wgrad)
        if key not in self._grid:
            g = np.unique(np.concatenate([2.0 ** np.arange(0, 21), self.gemm.grid]))
            t = self.gemm.wgrad(n, k, g) if wgrad else self.gemm(g, n, k)
            floor = n * k * 2 / self.hbm * 1e3
            tiles = np.ceil(n / TILE) * np.ceil(k / TILE) if wgrad else np.ceil(g / TILE) * np.ceil(n / TILE)
            self._grid[key] = (g, np.maximum(t - self.launch, floor) / self.eta + tiles * self.tile_ms / self.sms)
        g, t = self._grid[key]
        rows = np.asarray(rows, dtype=np.float64)
        t_rows = np.where(rows > g[-1], t[-1] * rows / g[-1], np.interp(rows, g, t))  # compute-bound past the grid
        return np.where(rows > 0, t_rows, 0.0)

    def call_ms(self, rows_XG: np.ndarray, n: int, k: int, wgrad: bool = False) -> np.ndarray:
        """One grouped GEMM call over the groups (last axis); 0 where no group has rows."""
        rows_XG = np.asarray(rows_XG, dtype=np.float64)
        t = self._group_ms(rows_XG, n, k, wgrad).sum(axis=-1)
        return np.where(rows_XG.sum(axis=-1) > 0, self.launch + t, 0.0)

    def copy_ms(self, nbytes) -> np.ndarray:
        return np.asarray(nbytes, dtype=np.float64) / self.hbm * 1e3


SLOT_PATHS = ("gather", "inplace", "none")


# Assumed until measured on a GPU: an ``index_add_`` at HBM speed beside compute-bound GEMMs shares the SMs and the
# memory bandwidth with them; half of its time is charged to the compute stream (NCCL's copies, on a few SMs, are
# charged 6%: ``calibration.py``'s ``gemm_slowdown_with_p2p``).
LANDING_OVERLAP = 0.5


@dataclass
class GroupedMMCost:
    """Per-rank expert time (ms) of one MoE layer as the runtime runs it (the simulator's expert model).

    slot_path: how the runtime reads a rank's C slots (K owned, then S spare) in every grouped GEMM call:
    "gather" (``slot_gemm.py``'s ``cat([owned, bank]).index_select(slots)``: a copy of all C slots per call,
    empty ones included), "inplace" (owned slots read in place from the EP shard, the S spare slots' bank rows
    gathered, a second grouped call per GEMM), "none" (torchtitan's own path, balancer "off": no slots)."""

    k: GroupedMM
    dim: int
    ffn: int
    act_bytes: int = 2
    slot_path: str = "inplace"  # the runtime's (models/slot_gemm.py)
    # the share of an owner's landing of returned gradients that still delays its compute stream when it runs on
    # the landing stream beside the dense backward (``transfer/landing.py``); ``scripts/gpu_check.sh`` measures it
    # (the calibration's ``copies.landing_overlap``)
    landing_overlap: float = LANDING_OVERLAP

    def __post_init__(self) -> None:
        if self.slot_path not in SLOT_PATHS:
            raise ValueError(f"unknown slot path {self.slot_path!r}; choose from {SLOT_PATHS}")

    def gemm_ms(self, tokens_XE: np.ndarray, backward: bool) -> np.ndarray:
        D, F, k = self.dim, self.ffn, self.k
        if not backward:  # w1, w3: rows x F reducing D; w2: rows x D reducing F
            return 2 * k.call_ms(tokens_XE, F, D) + k.call_ms(tokens_XE, D, F)
        dgrad = k.call_ms(tokens_XE, F, D) + 2 * k.call_ms(tokens_XE, D, F)  # g2 @ w2; g1 @ w1, g3 @ w3
        wgrad = 2 * k.call_ms(tokens_XE, F, D, wgrad=True) + k.call_ms(tokens_XE, D, F, wgrad=True)
        return dgrad + wgrad

    def memory_ms(self, tokens_XE: np.ndarray, backward: bool) -> np.ndarray:
        """Permute, activation and unpermute (and their gradients): bytes per routed row at the HBM rate."""
        rows = np.asarray(tokens_XE, dtype=np.float64).sum(axis=-1)
        D, F, b = self.dim, self.ffn, self.act_bytes
        per_row = (14 * D + 12 * F) * b / 2 if backward else (8 * D + 10 * F) * b / 2
        # fwd: permute r+w D, silu r+w F, mul r 2F w F, unpermute r+w D; bwd: their gradients + dgrad sum
        n = BWD_KERNELS if backward else FWD_KERNELS
        return np.where(rows > 0, self.k.mem_scale * self.k.copy_ms(rows * per_row) + n * self.k.launch, 0.0)

    def slot_ms(self, backward: bool, slots: int, spare: int, spare_rows=0.0, path: str | None = None,
                shapes: bool = True):
        """The slot path's own cost per layer and rank (``path``: default this model's ``slot_path``). "gather":
        per matrix and call ``cat`` (K + B rows read and written) and ``index_select`` (C rows), ~2 copies of the
        ``slots`` slots, whatever their tokens; backward gathers again, zeroes the owned + bank gradient and
        ``index_add``s the slot gradients (~2 more). "inplace" (``slot_gemm.py``'s in-place split): the ``spare``
        slots' bank rows gathered (forward one copy; backward one more, the bank gradient's zeros and its
        ``index_add``, and the return's packing of it into rows), plus per GEMM a second grouped call, and in
        forward the copy of the spare rows' final output into place (``spare_rows`` x D, read and written:
        ``models/slot_swiglu.py`` joins the rest through ``out=`` writes); launches: gather 6 forward / 12 backward, in place 9 / 18. In place with no spare rows
        (a rank, in a layer, whose spare slots run no token; every rank of ``static`` and ``ideal``) none of it
        runs: ``slot_swiglu.py`` skips the spare part and gives the bank no gradient, so 0. With one spare slot
        the slot reads the bank's one row in order (``InPlaceSplit.bank_in_order``): the bank is read as it is and
        its weight gradient comes straight from the GEMM, so the bank rows' gather, zeros and ``index_add`` (and
        their launches) are not paid either; and the bank's w1 and w3 rows are one ``[2F, D]`` matrix
        (``transfer/banks.py`` lays a row out w1 | w3 | w2): one GEMM for both forward, one data and one weight
        gradient backward, so in place then 2 / 4 launches (the one row's w2 GEMM and w13 data gradient write their
        rows in place: no output copy; its weight gradients are written as one packed row, which the return sends
        as it is) and the fused GEMMs'
        shapes for the spare slot's group (``w13_ms``; ``shapes=False`` leaves that difference out: the planner's
        prices, linear in the rows, ``spare_row_ms`` / ``spare_part_ms``)."""

        path = self.slot_path if path is None else path
        if path == "none" or slots <= 0:
            return np.zeros_like(np.asarray(spare_rows, dtype=np.float64))
        matrix = 3 * self.dim * self.ffn * 2  # one slot's three matrices, bf16
        if path == "gather":  # forward cat + index_select (2 copies, r + w); backward again + zeros + index_add
            t = self.k.copy_ms(slots * matrix * (8 if backward else 4)) + (12 if backward else 6) * self.k.launch
        elif spare == 1:  # the bank's row in order: no gather (models/slot_swiglu.py, transfer/engine.py)
            t = 0.0
        else:  # the spare slots' bank rows: forward index_select (r + w); backward again, zeros, index_add, and
            # the gradient return's packing of the bank gradient (transfer/banks.grad_rows: one row needs none)
            t = self.k.copy_ms(spare * matrix * (8 if backward else 2)) + (12 if backward else 6) * self.k.launch
        if path == "inplace":  # models/slot_swiglu.py: owned and spare parts apart through the SwiGLU, joined by
            # out= writes; only the spare rows' final output (D wide, forward) is copied into place
            width = 0 if backward else self.dim
            rows = np.asarray(spare_rows, dtype=np.float64)
            if spare == 1:  # in order: w1 and w3 one [2F, D] matrix, 2 / 4 grouped calls (w13, w2); the one
                # bank row's w2 GEMM writes the spare rows' output in place (torch.mm out=): no copy
                t = t + (self.w13_ms(rows, backward) if shapes else 0.0) + (4 if backward else 2) * self.k.launch
            else:
                t = t + (6 if backward else 3) * self.k.launch + self.k.copy_ms(rows * width * self.act_bytes * 2)
            return np.where(rows > 0, t, 0.0)  # no spare row: the spare part is not run
        return np.asarray(t, dtype=np.float64)

    def landing_ms(self, rows) -> np.ndarray:
        """An owner adding ``rows`` returned replica gradients into its experts' own, per layer and update
        micro-step (``TransferEngine._land``: one ``index_add_`` per matrix, on the landing stream from the owner's
        post-accumulate-grad hooks, ``land_async``, or on the compute stream at the block's gate): each row read,
        the owner's row read and written (bf16), 3 launches; 0 without a row. The time on its stream; what the
        compute stream pays of it: ``simulator/timing.py`` (``landing_overlap``)."""
        rows = np.asarray(rows, dtype=np.float64)
        matrix = 3 * self.dim * self.ffn * 2
        return np.where(rows > 0, self.k.copy_ms(rows * matrix * 3) + 3 * self.k.launch, 0.0)

    def w13_ms(self, rows, backward: bool) -> np.ndarray:
        """What running a group's w1 and w3 as one ``[2F, D]`` matrix changes in its GEMM time (launches apart:
        ``slot_ms`` counts them): forward ``gemm(rows, 2F, D)`` for two ``gemm(rows, F, D)``; backward the data
        gradient ``gemm(rows, D, 2F)`` for two ``gemm(rows, D, F)`` and the weight gradient of a ``2F x D`` weight
        for two of ``F x D``. ``gemm_ms`` charges every group at the apart shapes; this is the difference."""
        D, F, g = self.dim, self.ffn, self.k._group_ms
        rows = np.asarray(rows, dtype=np.float64)
        if not backward:
            return g(rows, 2 * F, D, False) - 2 * g(rows, F, D, False)
        return (g(rows, D, 2 * F, False) - 2 * g(rows, D, F, False)
                + g(rows, 2 * F, D, True) - 2 * g(rows, F, D, True))

    def rank_ms(self, tokens_XE: np.ndarray, backward: bool, slots: int = 0, spare: int = 0,
                spare_rows=0.0) -> np.ndarray:
        """Expert time of each rank from its tokens per expert (last axis), slot path included when ``slots``."""
        return self.gemm_ms(tokens_XE, backward) + self.memory_ms(tokens_XE, backward) + self.slot_ms(
            backward, slots, spare, spare_rows)


def _grid(tokens_per_slot: float) -> tuple[float, np.ndarray]:
    """(n0, 64 group sizes in [n0/4, 2 n0]): where the planner's costs are fitted, around the typical tokens per slot."""
    n0 = max(tokens_per_slot, 4.0)
    return n0, np.linspace(n0 / 4, 2 * n0, 64)


def _stage_ms(cost: GroupedMMCost, rows_XE: np.ndarray, backward: bool, forward: bool = True) -> np.ndarray:
    """A rank's expert time in the recompute stage (forward) or the update stage (``backward``: forward + backward);
    ``forward=False``: the backward pass alone."""
    return (cost.rank_ms(rows_XE, False) if forward else 0.0) + (cost.rank_ms(rows_XE, True) if backward else 0.0)


def slot_tokens(cost: GroupedMMCost, tokens_per_slot: float, backward: bool = True) -> int:
    """The planner's ``CostModel.slot_overhead_tokens`` from this model: the fixed cost of one more slot with
    tokens (a grouped-GEMM group: at least its weight read, in every GEMM; the slot path's copies are paid for
    every slot, used or not, and do not count) in the update stage (forward + backward) or the recompute
    (``backward=False``), fitted as a + b n over n in [n/4, 2n] around the typical tokens per slot, beside a
    rank's other slots at that load; a / b is the fixed cost in tokens, capped at the typical tokens per slot
    (where the marginal cost per token is small, a / b exceeds a whole expert's load and the token-unit planner,
    which moves tokens, stops balancing: the cap was the better of the two, docs/simulator.md)."""
    n0, n = _grid(tokens_per_slot)
    other = np.full((64, 1), n0)
    extra = _stage_ms(cost, np.concatenate([other, n[:, None]], axis=1), backward) - _stage_ms(cost, other, backward)
    b, a = np.polyfit(n, extra, 1)  # one more group of n rows
    return int(round(min(max(a, 0.0) / b, tokens_per_slot))) if b > 0 else int(round(tokens_per_slot))


def spare_token_weight(cost: GroupedMMCost, tokens_per_slot: float, backward: bool = True, spare: int = 1) -> float:
    """The planner's ``CostModel.spare_token_weight`` from this model: what a token costs in a spare slot
    relative to an owned one with ``spare`` spare slots per rank. On the in-place slot path with two or more the
    spare slots' output rows are copied into place, so a spare token costs its GEMMs and permute (the marginal time
    per token, around the typical tokens per slot) plus that copy; 1 with one spare slot (its GEMM writes them in
    place) and on the other paths."""
    if cost.slot_path != "inplace":
        return 1.0
    _, n = _grid(tokens_per_slot)
    per_token = np.polyfit(n, _stage_ms(cost, n[:, None], backward), 1)[0]
    copy = [cost.slot_ms(b, spare + 1, spare, 2.0, shapes=False) - cost.slot_ms(b, spare + 1, spare, 1.0, shapes=False)
            for b in ((False, True) if backward else (False,))]
    return float(1.0 + sum(copy) / per_token) if per_token > 0 else 1.0


def group_ms_table(cost: GroupedMMCost, tokens_per_slot: float, backward: bool = True,
                   forward: bool = True) -> tuple[tuple, tuple]:
    """The planner's ``CostModel.group_ms``: the time (ms) one more group of n rows adds to a rank beside its other
    groups at the typical load (the same difference as ``slot_tokens``, not fitted to a line), at n on a grid from
    1 row to 8 x the typical tokens per slot, per stage (``backward``: forward + backward; ``forward=False``: the
    backward pass alone)."""
    n0 = max(tokens_per_slot, 4.0)
    n = np.unique(np.concatenate([np.geomspace(1.0, 8 * n0, 48).round(), np.arange(0.0, 8 * n0 + 1, TILE),
                                  np.arange(1.0, 8 * n0 + 1, TILE)]))[1:]  # both sides of a tile's edge
    other = np.full((len(n), 1), n0)
    extra = (_stage_ms(cost, np.concatenate([other, n[:, None]], axis=1), backward, forward)
             - _stage_ms(cost, other, backward, forward))
    return tuple(float(x) for x in n), tuple(float(x) for x in np.maximum(extra, 0.0))


def spare_row_ms(cost: GroupedMMCost, backward: bool = True, forward: bool = True, spare: int = 1) -> float:
    """The planner's ``CostModel.spare_row_ms`` with ``spare`` spare slots per rank: what a row costs more in a
    spare slot (the in-place slot GEMM copies the spare slots' output rows into place; 0 with one spare slot, whose
    GEMM writes them in place, and on the other paths); ``forward=False``: the backward's alone.
    The fused w1 / w3 GEMMs' shape difference (``GroupedMMCost.w13_ms``) is left out: on the measured GEMM rows it
    is not linear in the rows (a few us either way, noise between 1 and 2 rows), so a 1 -> 2 row difference of it
    would price a spare row at up to 600x its copy."""
    if cost.slot_path != "inplace":
        return 0.0
    return float(sum(cost.slot_ms(b, spare + 1, spare, 2.0, shapes=False)
                     - cost.slot_ms(b, spare + 1, spare, 1.0, shapes=False)
                     for b in (False, True) if (b and backward) or (not b and forward)))


def spare_part_ms(cost: GroupedMMCost, spare: int, backward: bool = True, forward: bool = True,
                  tokens_per_slot: float | None = None) -> float:
    """The planner's ``CostModel.spare_part_ms``: the fixed time of a rank's spare part in a layer with ``spare``
    spare slots (the slot path's time at one spare row less that row's copy), paid only where the spare slots run
    rows (0 on the other paths, whose slot path every rank pays alike); ``forward=False``: the backward's alone.
    With one spare slot (in order: w1 and w3 one GEMM) and ``tokens_per_slot``, plus the fused GEMMs' shape
    difference (``GroupedMMCost.w13_ms``) at that many rows: not linear in the rows, so priced once, at the
    typical group (None: launches and copies only). Never below 0."""
    if cost.slot_path != "inplace" or spare <= 0:
        return 0.0
    n0 = None if tokens_per_slot is None or spare != 1 else max(float(tokens_per_slot), 1.0)
    return sum(max(float(cost.slot_ms(b, spare + 1, spare, 1.0, shapes=False)) - spare_row_ms(cost, b, not b, spare)
                   + (0.0 if n0 is None else float(cost.w13_ms(n0, b))), 0.0)
               for b in (False, True) if (b and backward) or (not b and forward))


def landing_prices(cost: GroupedMMCost, backward: bool = True) -> dict:
    """The planner's ``CostModel.landing_ms`` / ``landing_fixed_ms``: what an owner's compute stream pays per
    replica gradient returned to it in a layer and once per layer that has any (``GroupedMMCost.landing_ms``: the
    copy per row, the launches once; times ``landing_overlap``: the landing runs on its own stream beside the
    block's dense backward, ``simulator/timing._landing_exposed``, which it fits on the shapes we run once the
    return is issued before the owned part of the expert backward); none without a backward (the recompute stage
    returns nothing). Priced in full instead: trace 387.7 against 387.1 ms, Qwen3 660.4 against 660.6
    (docs/simulator.md step 9)."""
    if not backward:
        return {"landing_ms": 0.0, "landing_fixed_ms": 0.0}
    one, two = (float(cost.landing_ms(n)) * cost.landing_overlap for n in (1.0, 2.0))
    return {"landing_ms": two - one, "landing_fixed_ms": max(2 * one - two, 0.0)}


def pass_tables(cost: GroupedMMCost, tokens_per_slot: float, backward: bool = True, spare: int = 1) -> tuple:
    """The planner's ``CostModel.passes``: per pass that waits for its own slowest rank, ``(group_ms_table,
    spare_row_ms, spare_part_ms)``: the update stage's forward and backward; () for the recompute (one pass,
    ``group_ms``)."""
    if not backward:
        return ()
    return tuple((group_ms_table(cost, tokens_per_slot, backward=b, forward=not b), spare_row_ms(cost, b, not b, spare),
                  spare_part_ms(cost, spare, b, not b, tokens_per_slot)) for b in (False, True))


def kernel_of(raw: dict, eta: float | None = None, tile_ms: float | None = None,
              mem_scale: float | None = None) -> GroupedMM:
    g = GemmTable(raw["gemm_table"])
    block = raw["grouped_mm_kernel"]
    e = block["eta"] if eta is None else eta
    c = block["tile_us"] * 1e-3 if tile_ms is None else tile_ms
    m = block.get("mem_scale", 1.0) if mem_scale is None else mem_scale
    return GroupedMM(g, float(e), launch_ms(g), hbm_Bps(raw), float(c), mem_scale=float(m))


def _figure_ms(kern: GroupedMM, f: dict) -> float:
    """The model's time for one published figure."""
    if "experts" not in f:
        rows = (np.asarray(f["rows_G"], dtype=np.float64) if "rows_G" in f
                else np.full(f["groups"], float(f["rows_each"])))
    if f["op"] == "grouped_mm":
        return float(kern.call_ms(rows, f["n"], f["k"]))
    if f["op"] == "backward_over_forward":  # one matrix: dgrad + wgrad over forward
        n, k = f["n"], f["k"]
        fwd = kern.call_ms(rows, n, k)
        return float((kern.call_ms(rows, k, n) + kern.call_ms(rows, n, k, wgrad=True)) / fwd)
    # moe_forward, balanced routing: permute, (fused) gate-up, activation, down, unpermute
    D, F = f["dim"], f["ffn"]
    per_e = np.full(f["experts"], f["tokens"] * f["top_k"] / f["experts"])
    up = kern.call_ms(per_e, 2 * F, D) if f.get("fused_gate_up") else 2 * kern.call_ms(per_e, F, D)
    cost = GroupedMMCost(kern, D, F)
    return float(up + kern.call_ms(per_e, D, F) + cost.memory_ms(per_e, False))


def _solve_fit(raw_h100: dict, figures: list, tile_free: bool) -> tuple[float, float]:
    """(1 / eta, x) solving the two 'fit' figures exactly: a figure's time is linear in 1 / eta and in x, the
    tile cost (ms) or, ``tile_free`` (no tile cost), the permute / activation bytes multiplier; evaluate the model
    at x = 0 with 1 / eta = 1 and 2, and at x = 1, and solve the 2 x 2 system."""
    fit = [f for f in figures if f["role"] == "fit" and f["device"] == "h100"]
    if len(fit) != 2:
        raise ValueError(f"need exactly two 'fit' figures, got {len(fit)}")

    def at(inv_eta: float, x: float) -> np.ndarray:
        kern = (kernel_of(raw_h100, 1.0 / inv_eta, 0.0, x) if tile_free
                else kernel_of(raw_h100, 1.0 / inv_eta, x, 1.0))
        return np.array([_figure_ms(kern, f) for f in fit])

    t00 = at(1.0, 0.0)
    a, b = at(2.0, 0.0) - t00, at(1.0, 1.0) - t00  # per unit of 1 / eta; per unit of x
    c0 = t00 - a  # the part independent of both (launches)
    inv_eta, x = np.linalg.solve(np.stack([a, b], axis=1), np.array([f["measured_ms"] for f in fit]) - c0)
    if inv_eta <= 0 or x < 0:
        raise ValueError(f"fit gave 1/eta={inv_eta:.3f}, {'bytes x' if tile_free else 'tile ms'}={x:.5f}: not physical")
    return float(inv_eta), float(x)


def fit_eta_tile(raw_h100: dict, figures: list) -> tuple[float, float]:
    """The earlier form (2026-11-25 afternoon), for comparison only: (eta, tile ms) solving the two 'fit' figures
    with a fixed cost per output tile and the permute / activation bytes at the HBM rate. The kernel-only H200
    figures (TileOPs, torch 2.13) leave no room for its 10 us per tile at small K (up to 2.2x too slow)."""
    inv_eta, tile = _solve_fit(raw_h100, figures, tile_free=False)
    return 1.0 / inv_eta, tile


def fit_eta_mem(raw_h100: dict, figures: list) -> tuple[float, float]:
    """The model's constants: (eta, permute / activation bytes multiplier) solving the two 'fit' figures with no
    per-tile cost: what a MoE layer spends beyond its GEMMs is memory-bound work (permute, activation, unpermute:
    gathers and scatters by index, well below the HBM rate)."""
    inv_eta, mem = _solve_fit(raw_h100, figures, tile_free=True)
    return 1.0 / inv_eta, mem


def kernel_block(raw: dict, raw_h100: dict, figures: list | None = None) -> dict:
    """The calibration's ``grouped_mm_kernel`` field: the constants fitted on H100 (``fit_eta_mem``), this
    device's launch and HBM rate (also used by ``scripts/calibrate_from_aiconfigurator.py``)."""
    figures = json.loads(PUBLIC.read_text())["figures"] if figures is None else figures
    eta, mem = fit_eta_mem(raw_h100, figures)
    return {"kernel": "torch._grouped_mm, bf16 (CUTLASS SM90 grouped GEMM), as models/moe.py runs it",
            "eta": round(eta, 6), "tile_us": 0.0, "mem_scale": round(mem, 6), "tile": [TILE, TILE], "sms": 132,
            "fit": "eta and the permute / activation bytes multiplier solved from the two 'fit' figures of "
                   "calibrations/grouped_mm_public.json (H100); H200 uses the H100 constants (same SM90 kernel; no "
                   "published H200 figure is fitted on)",
            "launch_ms": round(launch_ms(GemmTable(raw["gemm_table"])), 6),
            "hbm_GBps": round(hbm_Bps(raw) / 1e9, 1),
            "public_figures": "calibrations/grouped_mm_public.json"}


def validate(cals: dict, figures: list, tile_cost: bool = False) -> list[dict]:
    """Predicted / measured per published figure (fit and held-back), on each figure's device; ``tile_cost``: the
    earlier form (``fit_eta_tile``'s constants on both devices) instead of the calibrations' constants."""
    eta, tile = fit_eta_tile(cals["h100"], figures) if tile_cost else (None, None)
    out = []
    for f in figures:
        kern = kernel_of(cals[f["device"]], eta, tile, 1.0) if tile_cost else kernel_of(cals[f["device"]])
        pred = _figure_ms(kern, f)
        meas = f.get("measured_ms", f.get("measured_ratio"))
        out.append({"id": f["id"], "role": f["role"], "device": f["device"], "op": f["op"], "predicted": pred,
                    "measured": meas, "ratio": pred / meas, "source": f["source"].split(" ")[0]})
    return out


def main(argv=None) -> int:
    from .calibration import DEVICE_CALIBRATIONS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="fit eta on the 'fit' figures, store it in h100/h200 JSONs")
    p.add_argument("--validate", action="store_true", help="print predicted / measured per published figure")
    p.add_argument("--tile-cost", action="store_true", help="with --validate: the earlier form (a fixed cost per output "
                   "tile, eta and that cost solved from the same two fit figures), for comparison")
    a = p.parse_args(argv)
    figures = json.loads(PUBLIC.read_text())["figures"]
    paths = {d: DEVICE_CALIBRATIONS[d] for d in ("h100", "h200")}
    cals = {d: json.loads(pth.read_text()) for d, pth in paths.items()}
    if a.write:
        for d, pth in paths.items():  # the fit is H100's; H200 takes its constants
            block = kernel_block(cals[d], cals["h100"], figures)
            text = pth.read_text()
            # keep the file's one-row-per-line layout: replace the trailing block only
            if '"grouped_mm_kernel"' in text:
                text = text[: text.index(',\n "grouped_mm_kernel"')] + "\n}\n"
            body = json.dumps(block, indent=1).replace("\n", "\n ")
            body = re.sub(r"\[\s*([-+0-9.eE,\s]+?)\s*\]",  # one line per list, as calibrate_from_aiconfigurator.py
                          lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", body)
            pth.write_text(text.rstrip().rstrip("}").rstrip() + f',\n "grouped_mm_kernel": {body}\n}}\n')
            assert json.loads(pth.read_text())["grouped_mm_kernel"] == block  # still valid JSON
        print(f"eta = {block['eta']:.4f}, permute / activation bytes x {block['mem_scale']:.3f} written to "
              f"{', '.join(str(x) for x in paths.values())}")
    if a.validate:
        if a.tile_cost:
            eta, tile = fit_eta_tile(cals["h100"], figures)
            print(f"earlier form (tile cost): eta {eta:.4f}, tile {tile * 1e3:.3f} us, permute / activation bytes x 1")
        for r in validate(cals, figures, a.tile_cost):
            print(f"{r['id']:36} {r['role']:8} {r['device']} {r['op']:22} predicted {r['predicted']:10.4f} "
                  f"measured {r['measured']:10.4f} ratio {r['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
