"""Turn one EP group's StagePlan into per-micro-step times.

Per micro-step m and MoE layer l, every rank r of the group: attention projections and other dense
work from the measured GEMM rows at the rank's tokens (calibrations without rows: FLOPs at the calibrated
matmul rate), the attention core from its FLOPs; dispatch / combine all-to-alls from the
bytes each rank sends and receives per link (NVLink inside a node, its own InfiniBand NIC
across nodes); grouped-GEMM time from the calibration curve for the tokens each of its
experts gets. A layer takes the slowest rank (the all-to-alls are barriers).

Weight moves (bf16 expert weights) and gradient returns of replicas:
* foresight plans (foremoe, eplb_*): a micro-step's moves are issued during the previous
  one and use the link time its all-to-alls leave idle; what does not fit is exposed. After
  an optimizer step replicas are stale, so that micro-step's moves start with it, layer by
  layer (layer l's copies must land before layer l's experts run). Copies in flight slow
  the grouped GEMMs by the calibrated factor. Planning runs on the host one micro-step
  ahead (exposed only where it is longer than that micro-step; the first recompute
  micro-step's plan is exposed).
* reactive: each layer all-gathers its counts, plans, then moves weights and tokens
  on the same links before its experts run: planning and moves are on the critical path.
* exact (MoonEP-style): each layer all-gathers its counts, plans on the device, dispatches, then pulls its
  duplicates over NVLink while its own experts' rows compute; what the pull outlasts them by is exposed.
* replica gradients go back to the owner in the next micro-step's idle link time; the
  last micro-step of an optimizer step returns them behind its remaining backward layers.
A move takes the CPU-assisted lane (owner's host staging, host hop between nodes, PCIe copy) where
the runtime would (``CostModel.use_host_path`` on these links, ``transfer_path='auto'``). Ideal: the owners' whole-expert GEMM time spread evenly over the ranks,
all-to-all traffic spread evenly (T / R per rank, sources uniform), no moves, no planning.

Shapes: M micro-steps, L MoE layers, R ranks (= sources S), E experts, P link paths.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..planner.owners import owned_slots_LRK
from ..planner.planahead import plans_lazily
from ..planner.split import source_split
from ..planner.types import CostModel, StagePlan
from .calibration import GemmCurve
from .grouped_mm import GroupedMMCost
from .models import ModelSpec

PATHS = ("nvlink", "ib", "pcie")


@dataclass(frozen=True)
class DeviceCosts:
    """Link bandwidths (GB/s per GPU and direction), latencies, copy interference and matmul rate."""

    nvlink_GBps: float
    ib_GBps: float
    h2d_GBps: float
    a2a_latency_us: float
    allgather_latency_us: float
    gemm_slowdown_h2d: float
    gemm_slowdown_p2p: float
    dense_tflops: float
    transfer_path: str = "auto"  # direct | host | auto
    act_bytes: int = 2
    weight_bytes: int = 2
    grad_bytes: int = 2
    d2h_GBps: float | None = None  # staging an owner's experts in pinned host memory (None: h2d_GBps)
    host_net_GBps: float = CostModel.host_network_bw / 1e9  # host-to-host hop of the CPU-assisted lane
    # measured NVLink all-to-all: (total bytes per rank, ms) of NCCL alltoall rows on `a2a_peers` GPUs; None: bw
    nvlink_a2a: tuple | None = None
    a2a_peers: int = 8

    def a2a_s_MLPR(self, bytes_MLPR: np.ndarray) -> np.ndarray:
        """Seconds of each path's all-to-all share (bytes a rank sends or receives per path; latency apart).
        NVLink from the measured curve when there is one: a rank that moves B bytes to its n - 1 peers is an
        alltoall of B n / (n - 1) bytes per rank (log-log interpolation, bandwidth-bound past the largest row),
        minus the all-to-all latency charged once per layer."""
        out = bytes_MLPR / self.bw_P()[None, None, :2, None]
        if self.nvlink_a2a is not None:
            size, ms = (np.asarray(x, dtype=np.float64) for x in self.nvlink_a2a)
            n = self.a2a_peers
            b = np.maximum(bytes_MLPR[:, :, 0] * n / (n - 1), 1.0)
            t = np.exp(np.interp(np.log(b), np.log(size), np.log(ms)))
            t = np.where(b > size[-1], ms[-1] * b / size[-1], t) * 1e-3
            out[:, :, 0] = np.where(bytes_MLPR[:, :, 0] > 0, np.maximum(t - self.a2a_latency_us * 1e-6, 0.0), 0.0)
        return out

    def copy_bw_P(self, nbytes: float) -> np.ndarray:
        """Bandwidth (B/s) a copy of `nbytes` gets per path: NVLink from the measured all-to-all curve at that
        size (latency included: a weight move is one transfer of its own), else the calibrated figure."""
        bw = self.bw_P()
        if self.nvlink_a2a is not None and nbytes > 0:
            size, ms = (np.asarray(x, dtype=np.float64) for x in self.nvlink_a2a)
            b = nbytes * self.a2a_peers / (self.a2a_peers - 1)
            t = float(np.exp(np.interp(np.log(b), np.log(size), np.log(ms)))) if b <= size[-1] else ms[-1] * b / size[-1]
            bw[0] = nbytes / (t * 1e-3)
        return bw

    def bw_P(self) -> np.ndarray:
        return np.array([self.nvlink_GBps, self.ib_GBps, self.h2d_GBps]) * 1e9

    def cost_model(self, expert_bytes: float) -> CostModel:
        """The runtime's cost model on these links: its ``use_host_path`` picks a move's lane."""
        return CostModel(expert_bytes=expert_bytes, intra_node_bw=self.nvlink_GBps * 1e9,
                         inter_node_bw=self.ib_GBps * 1e9, host_to_device_bw=self.h2d_GBps * 1e9,
                         device_to_host_bw=(self.d2h_GBps or self.h2d_GBps) * 1e9,
                         host_network_bw=self.host_net_GBps * 1e9)

    def host_lanes(self, expert_bytes: float) -> tuple[bool, bool]:
        """(intra-node, inter-node) moves take the CPU-assisted lane: the transfer engine's rule."""
        if self.transfer_path == "auto":
            cost = self.cost_model(expert_bytes)
            return cost.use_host_path(False), cost.use_host_path(True)
        return (self.transfer_path == "host",) * 2


@dataclass
class StageTimes:
    """Per micro-step (ms) and per rank (bytes) results of one group's stage."""

    dur_M: np.ndarray  # whole micro-step
    moe_M: np.ndarray  # inside MoE layers (all-to-alls, experts, exposed moves and planning)
    exposed_transfer_M: np.ndarray  # weight moves + gradient returns not hidden
    exposed_plan_M: np.ndarray
    expert_M: np.ndarray  # straggler grouped-GEMM time summed over layers
    transfer_bytes_R: np.ndarray
    grad_bytes_R: np.ndarray
    a2a_busy_last_PR: np.ndarray  # idle-window input of the next stage
    parts_M: dict | None = None  # where the MoE time goes per micro-step (ms): see stage_times


_A2A_CACHE: dict = {}


def _a2a(loads_MLSE: np.ndarray, assign_MLER: np.ndarray, node_R: np.ndarray, act: float):
    """Bytes each rank sends / receives per path (nvlink, ib) for one dispatch: [M, L, 2, R] each.

    Memoized on the inputs' contents: stages and balancers often share a token assignment.
    """
    key = (hashlib.sha1(loads_MLSE.tobytes()).digest(), hashlib.sha1(assign_MLER.tobytes()).digest(),
           node_R.tobytes(), act, loads_MLSE.shape)
    if key not in _A2A_CACHE:
        if len(_A2A_CACHE) > 256:
            _A2A_CACHE.clear()
        _A2A_CACHE[key] = _a2a_uncached(loads_MLSE, assign_MLER, node_R, act)
    return _A2A_CACHE[key]


def _a2a_uncached(loads_MLSE, assign_MLER, node_R, act):
    M, L, S, E = loads_MLSE.shape
    same = node_R[:, None] == node_R[None, :]
    off = ~np.eye(S, dtype=bool)
    send = np.zeros((M, L, 2, S))
    recv = np.zeros((M, L, 2, S))
    for m in range(M):
        for l in range(L):
            t_SR = source_split(loads_MLSE[m, l], assign_MLER[m, l], node_R).sum(axis=1) * act
            for p, mask in enumerate((same & off, ~same)):
                x = np.where(mask, t_SR, 0.0)
                send[m, l, p], recv[m, l, p] = x.sum(axis=1), x.sum(axis=0)
    return send, recv


def _moves_MLPR(rows: np.ndarray, M: int, L: int, R: int, nbytes: float, node_R: np.ndarray, link: DeviceCosts):
    """Link seconds per (micro-step, layer, path, rank) of weight moves (max of send and receive), and
    bytes received. A CPU-assisted move (lane chosen as the runtime does) charges the receiver's PCIe
    lane its whole ``CostModel.host_path_s`` (staging, host hop, host-to-device copy)."""
    bw_P = link.copy_bw_P(nbytes)
    send = np.zeros((M, L, 3, R))
    recv = np.zeros((M, L, 3, R))
    recv_bytes = np.zeros((M, L, 3, R))
    if len(rows):
        m, l = rows["micro_step"].astype(np.int64), rows["layer"].astype(np.int64)
        src, dst = rows["src_rank"].astype(np.int64), rows["dst_rank"].astype(np.int64)
        inter = node_R[src] != node_R[dst]
        host_intra, host_inter = link.host_lanes(nbytes)
        host = np.where(inter, host_inter, host_intra)
        p = np.where(host, 2, np.where(inter, 1, 0))
        cost = link.cost_model(nbytes)
        sec = np.where(host, np.where(inter, cost.host_path_s(True), cost.host_path_s(False)), nbytes / bw_P[p])
        np.add.at(recv, (m, l, p, dst), sec)
        np.add.at(send, (m, l, p, src), np.where(host, 0.0, sec))
        np.add.at(recv_bytes, (m, l, p, dst), nbytes)
    return np.maximum(send, recv), recv_bytes


def _exact_pull_s(plan: StagePlan, fwd_MLR: np.ndarray, nbytes: float, link: DeviceCosts
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The exact balancer's weight pull (MoonEP: duplicates read from the owners over NVLink, inside a node, after
    the plan and the dispatch; the rank computes its own experts' rows meanwhile). Returns the layer's exposed
    seconds [M, L] (slowest rank with its exposed pull, minus the slowest rank without) and NVLink seconds per
    rank [M, R] (max of its sends and receives, all layers). The copies' slowdown of the GEMMs is not charged."""
    M, L, E, R = plan.assign_MLER.shape
    K = E // R
    owned_ER = (np.arange(E)[:, None] // K) == np.arange(R)[None, :]
    dup_MLER = (plan.assign_MLER > 0) & ~owned_ER
    sec = nbytes / link.copy_bw_P(nbytes)[0]
    recv_MLR = dup_MLER.sum(axis=2) * sec
    send_MLR = dup_MLER.sum(axis=3).reshape(M, L, R, K).sum(axis=3) * sec
    pull_MLR = np.maximum(recv_MLR, send_MLR)
    rows_MLR = plan.assign_MLER.sum(axis=2)
    own_MLR = (plan.assign_MLER * owned_ER).sum(axis=2)
    own_s_MLR = fwd_MLR * np.where(rows_MLR > 0, own_MLR / np.maximum(rows_MLR, 1), 1.0)
    exposed_MLR = np.maximum(recv_MLR - own_s_MLR, 0.0)
    extra_ML = (fwd_MLR + exposed_MLR).max(axis=2) - fwd_MLR.max(axis=2)
    return extra_ML, pull_MLR.sum(axis=1)


def _landing_exposed(land_MLR: np.ndarray, layer_dense_MR: np.ndarray, a2a_ML: np.ndarray, grad_MLPR: np.ndarray,
                     overlap: float, overlapped: bool, head_MLR: np.ndarray | float = 0.0
                     ) -> tuple[np.ndarray, np.ndarray]:
    """What a rank's compute stream waits at the block's gate for the gradient return and the owners' landing
    (seconds per layer): (the landing's part, the return's part).

    The placement runtime issues the return from the fused SwiGLU's backward as soon as it has the bank's
    gradient, before the owned part (``head_MLR``: the rank's own expert backward, which the return overlaps;
    0 where the layer's slots are gathered and ``ReplicaWeights`` issues it after them), starts the landing on
    the landing stream once the owner's own gradient is accumulated and the return is in (``transfer/landing.py``),
    and the gate (before FSDP's reduce-scatter of the block) waits for both. After the expert backward run the
    dispatch's backward all-to-all and the block's dense backward (2x its forward): the window. The return (on the
    rank's busiest path, sent or received) that outlasts head and window is waited for in full; of the landing
    after it, the part that fits in what is left of the window is charged ``overlap`` (shared SMs and HBM), the
    rest in full. The reactive runtimes (``exact`` too) return synchronously and land on the compute stream
    (``overlapped`` False): the landing in full, their return not charged here."""
    if not overlapped:
        return land_MLR, np.zeros_like(land_MLR)
    start_MLR = np.maximum(grad_MLPR.max(axis=2) - head_MLR, 0.0)  # the return's arrival after the expert backward
    window_MLR = a2a_ML[:, :, None] + 2 * layer_dense_MR[:, None, :]
    late_MLR = np.maximum(start_MLR - window_MLR, 0.0)
    fits = np.minimum(land_MLR, np.maximum(window_MLR - start_MLR, 0.0))
    return overlap * fits + (land_MLR - fits), late_MLR


def _fifo_exposed(tx_L: np.ndarray, need_L: np.ndarray) -> float:
    """Moves sent in order over one link from t=0; layer l's must land by need_L[l]: the delay."""
    return float(max(0.0, (np.cumsum(tx_L) - need_L).max(initial=0.0)))


def _grad_exposed(tx_L: np.ndarray, ready_L: np.ndarray, end: float) -> float:
    """Gradients of layer l sent once its backward ends (backward order); past `end` is exposed."""
    if not tx_L.any():
        return 0.0
    t = 0.0
    for l in np.argsort(ready_L, kind="stable"):
        t = max(t, ready_L[l]) + tx_L[l]
    return max(0.0, t - end)


def _in_place_MLR(plan: StagePlan) -> np.ndarray:
    """Where the runtime reads a rank's owned slots in place (each holds the rank's own row c, or nothing): the
    fused slot SwiGLU's path (``placement/tables.slot_splits``); elsewhere it gathers all C slots."""
    M, L, R, C = plan.slots_MLRC.shape
    K = plan.assign_MLER.shape[2] // R
    own_MLRK = np.stack([owned_slots_LRK(plan.layout_owner_MLE[m], R) for m in range(M)])  # rows in shard order
    head = plan.slots_MLRC[..., :K]
    return ((head == own_MLRK) | (head < 0)).all(axis=3)


def _slot_path_s(plan: StagePlan, curve: GroupedMMCost, ideal: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Forward and backward seconds [M, L, R] of the runtime's slot path (``models/slot_gemm.py``): in place
    where every owned slot holds the rank's own row c (or nothing), plus the copy of the rows its spare slots run;
    the gather of all C slots where a plan puts another expert in an owned slot (EPLB: the runtime's fallback);
    and where it runs in place (``_in_place_MLR``). ``ideal``: the same runtime, every rank's own experts in
    place, nothing on spare slots."""
    M, L, R, C = plan.slots_MLRC.shape
    E = plan.assign_MLER.shape[2]
    K = E // R
    owner_MLE = plan.layout_owner_MLE
    if ideal:
        in_place_MLR, spare_rows_MLR = np.ones((M, L, R), dtype=bool), np.zeros((M, L, R))
    else:
        in_place_MLR = _in_place_MLR(plan)
        foreign_MLER = owner_MLE[:, :, :, None] != np.arange(R)[None, None, None, :]
        spare_rows_MLR = (plan.assign_MLER * foreign_MLER).sum(axis=2).astype(np.float64)
    path = curve.slot_path
    out = []
    for bwd in (False, True):
        t = curve.slot_ms(bwd, C, C - K, spare_rows_MLR, path)
        if path == "inplace":  # EPLB-style layers fall back to the gather of all slots
            t = np.where(in_place_MLR, t, curve.slot_ms(bwd, C, C - K, spare_rows_MLR, "gather"))
        out.append(np.broadcast_to(t, (M, L, R)) * 1e-3)
    return out[0], out[1], in_place_MLR


def _lazy_waits(plan_s_M: np.ndarray, dur_M: np.ndarray, head_s: float = 0.0) -> np.ndarray:
    """Each micro-step's wait for its plan (s) in a lazily planned stage (``placement/lazy.py``): micro-step 0 planned
    on the training thread from ``-head_s`` (the stage may start at 0), micro-steps 1.. one after another in the
    planner's worker from then on, micro-step m starting when m - 1 ends and its plan is ready."""
    ready_M = np.cumsum(plan_s_M) - head_s
    wait_M, t = np.zeros(len(plan_s_M)), 0.0
    for m in range(len(plan_s_M)):
        wait_M[m] = max(float(ready_M[m]) - t, 0.0)
        t += wait_M[m] + float(dur_M[m])
    return wait_M


def _ahead_waits(ready_M: np.ndarray, dur_M: np.ndarray) -> np.ndarray:
    """Each micro-step's wait for plans (s) in a stage planned micro-step by micro-step in the worker while an
    earlier stage ran (the update, ``placement/lazy.py``): ``ready_M`` from the stage's start; micro-step 0 takes
    plans 0 and 1 at its entry, micro-step m >= 1 takes m + 1's (``PlacementRuntime.micro_step``)."""
    M = len(ready_M)
    wait_M, t = np.zeros(M), 0.0
    for m in range(M):
        need = max(float(ready_M[m]) if m == 0 else -np.inf, float(ready_M[m + 1]) if m + 1 < M else -np.inf)
        wait_M[m] = max(need - t, 0.0)
        t += wait_M[m] + float(dur_M[m])
    return wait_M


def stage_times(
    plan: StagePlan,
    loads_MLSE: np.ndarray,
    tokens_MS: np.ndarray,
    pairs_MS: np.ndarray,
    model: ModelSpec,
    curve: GemmCurve,
    link: DeviceCosts,
    *,
    backward: bool,
    micro_steps_per_step: int,
    prev_idle_PR: np.ndarray | None,
    dense_gemm=None,
    planned_ahead: bool = False,
    plan_head_s: float = 0.0,
    plan_ready_s: float | np.ndarray = -np.inf,
) -> StageTimes:
    """Times of every micro-step of one group's stage under `plan`.

    prev_idle_PR: idle link seconds per path and rank before the stage's first micro-step
    (None: unbounded, e.g. behind the rollout: the synchronous recompute stage, planned as the runtime does:
    foremoe's first micro-step before it, micro-step m >= 1 in the planner's worker while m - 1 runs, its moves
    issued at m's entry (``placement/lazy.py``); the other balancers' whole stage before it).
    dense_gemm: measured bf16 GEMM rows (``fused_moe.GemmTable``) for the dense projections (None: FLOPs at the
    calibrated dense rate); backward = 2x forward either way. ``planned_ahead``: the recompute stage was planned
    whole before it (asynchronous RL: ``[rl] max_staleness`` > 0 plans a step in the worker while the previous
    one trains), so no plan is exposed and moves are prefetched one micro-step ahead. ``plan_head_s``: host time
    before a synchronous recompute stage that its plans run in (colocated engines falling asleep after the rollout:
    the trainer plans while it waits for them, ``rollouts/fleet/sleep.py``): foremoe's first plan on the training
    thread from ``-plan_head_s``, then micro-steps 1.. back to back in the planner's worker (``_lazy_waits``).
    ``plan_ready_s``: a stage after the recompute (``prev_idle_PR`` given), planned in the worker: when its plan is
    ready, from the stage's start (``simulate.update_plan_ready_s``); planned whole (a float) it waits that long at
    micro-step 0; micro-step by micro-step (an array, foremoe synchronously) m waits at its entry for m + 1's
    (``_ahead_waits``); its moves leave one micro-step ahead either way.
    """
    M, L, E, R = plan.assign_MLER.shape
    node_R = plan.topology.node_of_rank_R()
    bw = link.bw_P()
    reactive = bool(plan.info.get("reactive"))
    ideal = plan.info.get("executable", True) is False
    lat = link.a2a_latency_us * 1e-6

    # Dense work per rank (seconds), per MoE layer and outside MoE layers.
    rate = link.dense_tflops * 1e12
    if dense_gemm is None:
        layer_dense_MR = (tokens_MS * model.layer_dense_flops(True) + pairs_MS * model.attn_pair_flops()) / rate
        other_MR = (tokens_MS * (model.dense_layers * model.layer_dense_flops(False) + model.head_flops())
                    + pairs_MS * model.dense_layers * model.attn_pair_flops()) / rate
    else:  # projections, router, shared / dense MLPs and the head from the measured GEMM rows at m = the rank's
        # tokens (each as one GEMM of the same weights); the attention core (query-key pairs) at the dense rate
        D = model.dim

        def proj_s(flops_per_token: float) -> np.ndarray:
            if flops_per_token <= 0:
                return np.zeros_like(tokens_MS)
            t = dense_gemm(np.maximum(tokens_MS, 1.0), int(round(flops_per_token / (2 * D))), D) * 1e-3
            return np.where(tokens_MS > 0, t, 0.0)

        layer_dense_MR = proj_s(model.layer_dense_flops(True)) + pairs_MS * model.attn_pair_flops() / rate
        other_MR = (model.dense_layers * (proj_s(model.layer_dense_flops(False)) + pairs_MS * model.attn_pair_flops() / rate)
                    + proj_s(model.head_flops()))
    layer_dense_M = layer_dense_MR.max(axis=1)
    dense_mult = 3 if backward else 1  # backward = 2x forward FLOPs
    other_M = other_MR.max(axis=1) * dense_mult

    # All-to-alls: dispatch and combine move the same bytes, in the forward and again in the backward.
    if ideal:  # perfectly balanced traffic: every rank receives T / R, from sources spread evenly
        act = model.dim * link.act_bytes
        P = plan.topology.ranks_per_node
        frac = np.array([(P - 1) / R, (R - P) / R])[None, None, :, None]
        send = loads_MLSE.sum(axis=3)[:, :, None, :] * frac * act
        recv = np.broadcast_to(loads_MLSE.sum(axis=(2, 3))[:, :, None, None] / R * frac * act, send.shape)
    else:
        send, recv = _a2a(loads_MLSE, plan.assign_MLER, node_R, model.dim * link.act_bytes)
    a2a_MLPR = link.a2a_s_MLPR(np.maximum(send, recv))  # [M, L, 2, R]
    a2a_ML = lat + a2a_MLPR.max(axis=(2, 3))
    n_a2a = 2 * (2 if backward else 1)
    busy_MPR = np.zeros((M, 3, R))
    busy_MPR[:, :2] = a2a_MLPR.sum(axis=1) * n_a2a

    # Expert compute per rank.
    tok_MLRE = plan.assign_MLER.transpose(0, 1, 3, 2)
    K = E // R
    if ideal:  # the owners' expert work (whole experts, no splitting) spread perfectly evenly
        tok_MLRE = loads_MLSE.sum(axis=2).reshape(M, L, R, E // R)
    # every plan runs the runtime's slot path (placement/runtime.py: one path for all balancers), ideal too (the
    # same runtime, perfectly balanced); balancer "off" (torchtitan's path) is timed with slot_path "none"
    fwd_MLR = curve.rank_ms(tok_MLRE, backward=False) * 1e-3
    bwd_MLR = curve.rank_ms(tok_MLRE, backward=True) * 1e-3 if backward else np.zeros_like(fwd_MLR)
    slot_MLR = np.zeros_like(fwd_MLR)
    in_place_MLR = np.zeros_like(fwd_MLR, dtype=bool)  # where the fused slot SwiGLU runs (no slot path: nowhere)
    work_MLR = fwd_MLR + bwd_MLR  # grouped GEMMs + permute / activation, no slot path (for the parts below)
    exact = reactive and bool(plan.info.get("exact"))
    # exact (MoonEP): duplicates are pulled straight into the grouped GEMM's weight range, no slot gather
    if isinstance(curve, GroupedMMCost) and not exact:  # the slot path reads all C slots whatever their tokens
        slot_f, slot_b, in_place_MLR = _slot_path_s(plan, curve, ideal)
        slot_MLR = slot_f + (slot_b if backward else 0.0)
        fwd_MLR = fwd_MLR + slot_f
        if backward:
            bwd_MLR = bwd_MLR + slot_b
    if ideal:
        fwd_MLR = np.broadcast_to(fwd_MLR.mean(axis=2, keepdims=True), fwd_MLR.shape)
        bwd_MLR = np.broadcast_to(bwd_MLR.mean(axis=2, keepdims=True), bwd_MLR.shape)

    # Weight moves and replica gradients.
    wbytes = model.expert_params * link.weight_bytes
    rows = plan.transfers_T if not ideal else plan.transfers_T[:0]
    tx_MLPR, recv_bytes = _moves_MLPR(rows, M, L, R, wbytes, node_R, link)
    transfer_bytes_R = recv_bytes.sum(axis=(0, 1, 2))
    grad_MLPR = np.zeros((M, L, 3, R))
    grad_bytes_R = np.zeros(R)
    land_MLR = np.zeros((M, L, R))  # the owners adding the returned replica gradients into their experts' own
    late_MLR = np.zeros((M, L, R))  # the gate waiting for the return itself
    gated = not reactive and isinstance(curve, GroupedMMCost)  # returns waited for at each block's gate
    if backward and not ideal:
        slots = plan.slots_MLRC
        m, l, r, c = np.nonzero(slots[:, :, :, K:] >= 0)
        used = plan.assign_MLER[m, l, slots[m, l, r, K + c], r] > 0
        m, l, r, e = m[used], l[used], r[used], slots[m, l, r, K + c][used]
        owner = plan.owner_MLE[m, l, e]
        inter = node_R[owner] != node_R[r]
        gb = model.expert_params * link.grad_bytes
        bw = link.copy_bw_P(gb)
        p = np.where(inter, 1, 0)
        g_send, g_recv = np.zeros_like(grad_MLPR), np.zeros_like(grad_MLPR)
        np.add.at(g_send, (m, l, p, r), gb / bw[p])
        np.add.at(g_recv, (m, l, p, owner), gb / bw[p])
        grad_MLPR = np.maximum(g_send, g_recv)
        np.add.at(grad_bytes_R, r, gb)
        if isinstance(curve, GroupedMMCost):  # the owners' landing, before FSDP's reduce-scatter; a slot holding
            # its own rank's expert returns nothing (as ``time_polish.landing_LR``)
            away = owner != r
            np.add.at(land_MLR, (m[away], l[away], owner[away]), 1.0)
            land_MLR = curve.landing_ms(land_MLR) * 1e-3
            # issued from the fused SwiGLU's backward before its owned part (in place), else after the expert backward
            head_MLR = np.where(in_place_MLR, bwd_MLR, 0.0) if curve.slot_path == "inplace" else 0.0
            land_MLR, late_MLR = _landing_exposed(land_MLR, layer_dense_MR, a2a_ML, grad_MLPR,
                                                  curve.landing_overlap, overlapped=gated, head_MLR=head_MLR)
            bwd_MLR = bwd_MLR + land_MLR

    plan_s_M = plan.plan_ms_M * 1e-3
    plan_s_ML = plan.info.get("plan_ms_ML", np.zeros((M, L))) * 1e-3
    allgather = link.allgather_latency_us * 1e-6

    # Base micro-step: forward layers, then backward layers in reverse (no background traffic).
    moe_fwd_ML = 2 * a2a_ML + fwd_MLR.max(axis=2)
    late_ML = late_MLR.max(axis=2)  # the gate's wait for a return that outlasts its window (the latest rank's)
    moe_bwd_ML = (2 * a2a_ML + bwd_MLR.max(axis=2) + late_ML) if backward else np.zeros((M, L))
    inline_tr = np.zeros(M)  # reactive: moves on the critical path
    exposed_plan = np.zeros(M)
    if exact:
        # counts all-gather + device plan before the dispatch; duplicates pulled over NVLink after it, overlapped
        # with the rank's own experts' rows (MoonEP's order): the rest of the pull is exposed
        extra_ML, pull_MR = _exact_pull_s(plan, fwd_MLR, wbytes, link)
        moe_fwd_ML = moe_fwd_ML + allgather + plan_s_ML + extra_ML
        inline_tr = extra_ML.sum(axis=1)
        exposed_plan = plan_s_ML.sum(axis=1) + L * allgather
        busy_MPR[:, 0] += pull_MR
    elif reactive:
        # counts all-gather + plan + tokens and weights on the same links, before the experts
        both = a2a_MLPR + tx_MLPR[:, :, :2]
        react_ML = lat + both.max(axis=(2, 3))
        moe_fwd_ML = moe_fwd_ML + allgather + plan_s_ML + (react_ML - a2a_ML)
        inline_tr = (react_ML - a2a_ML).sum(axis=1)
        exposed_plan = plan_s_ML.sum(axis=1) + L * allgather
        busy_MPR[:, :2] += tx_MLPR[:, :, :2].sum(axis=1)
    fwd_M = layer_dense_M * L + other_M / dense_mult + moe_fwd_ML.sum(axis=1)
    dur_M = layer_dense_M * L * dense_mult + other_M + moe_fwd_ML.sum(axis=1) + moe_bwd_ML.sum(axis=1)

    # Background link use per micro-step: prefetch of m+1 (foresight) and gradients of m-1. The synchronous
    # recompute stage's lazily planned micro-steps (``placement/lazy.py``) issue theirs at their own entry instead.
    lazy = prev_idle_PR is None and not planned_ahead and not reactive and not ideal and plans_lazily(plan.balancer)
    bg_MPR = np.zeros((M, 3, R))
    stall = np.zeros(M)  # exposed moves / gradient returns outside the background budget
    if not reactive:
        tx_MPR = tx_MLPR.sum(axis=1)
        for m in range(M):
            boundary = backward and m > 0 and m % micro_steps_per_step == 0
            if m == 0:
                if prev_idle_PR is not None:
                    stall[0] += float(np.maximum(tx_MPR[0] - prev_idle_PR, 0).max())
            elif boundary or lazy:  # after an optimizer step, or planned while m - 1 ran: moves pipelined layer by
                # layer inside m
                start_L = (np.arange(L) + 1) * layer_dense_M[m] + np.concatenate([[0], np.cumsum(moe_fwd_ML[m])[:-1]])
                need_L = start_L + a2a_ML[m]
                stall[m] += max(_fifo_exposed(tx_MLPR[m, :, p, r], need_L) for p in range(3) for r in range(R))
                bg_MPR[m] += tx_MPR[m]
            else:
                bg_MPR[m - 1] += tx_MPR[m]
    if backward:
        for m in range(M):
            if gated:  # the placement runtime's gates wait for each layer's return (``late_ML``): micro-step m's links
                bg_MPR[m] += grad_MLPR[m].sum(axis=0)
            elif (m + 1) % micro_steps_per_step == 0 or m == M - 1:
                # last micro-step before an optimizer step: returned behind its remaining backward layers
                bwd_layer_L = 2 * layer_dense_M[m] + moe_bwd_ML[m]
                ready_L = fwd_M[m] + other_M[m] * 2 / 3 + np.cumsum(bwd_layer_L[::-1])[::-1]
                stall[m] += max(_grad_exposed(grad_MLPR[m, :, p, r], ready_L, dur_M[m]) for p in range(3) for r in range(R))
            else:
                bg_MPR[m + 1] += grad_MLPR[m].sum(axis=0)
    idle_MPR = dur_M[:, None, None] - busy_MPR
    stall += np.where(bg_MPR > 0, np.maximum(bg_MPR - idle_MPR, 0.0), 0.0).max(axis=(1, 2))
    frac = np.minimum(bg_MPR / np.maximum(dur_M[:, None, None], 1e-12), 1.0)  # [M, P, R]
    slow_MR = 1.0 + link.gemm_slowdown_h2d * frac[:, 2] + link.gemm_slowdown_p2p * frac[:, :2].max(axis=1)
    expert_ML = fwd_MLR.max(axis=2) + bwd_MLR.max(axis=2)
    slowed_ML = (fwd_MLR * slow_MR[:, None, :]).max(axis=2) + (bwd_MLR * slow_MR[:, None, :]).max(axis=2)
    extra_compute_M = (slowed_ML - expert_ML).sum(axis=1)
    plans = not reactive and plan.balancer not in ("off", "static", "ideal")  # the others plan nothing
    if plans and planned_ahead:
        pass  # planned while the previous step trained
    elif plans and prev_idle_PR is None and not lazy:
        exposed_plan[0] += max(plan_s_M.sum() - plan_head_s, 0.0)  # the whole recompute stage before it starts
    elif plans and prev_idle_PR is None:
        exposed_plan += _lazy_waits(plan_s_M, dur_M + extra_compute_M + stall, plan_head_s)  # the whole micro-step
    elif plans and np.ndim(plan_ready_s):  # planned micro-step by micro-step while the stage before it ran
        exposed_plan += _ahead_waits(np.asarray(plan_ready_s, dtype=np.float64), dur_M + extra_compute_M + stall)
    elif plans:
        exposed_plan[0] += max(plan_ready_s, 0.0)  # planned whole in the worker while the stage before it ran
    if ideal:
        exposed_plan[:] = 0.0

    ahead_plan = 0.0 if reactive else exposed_plan  # reactive planning is already inside moe_fwd_ML
    moe_M = moe_fwd_ML.sum(axis=1) + moe_bwd_ML.sum(axis=1) + extra_compute_M + stall + ahead_plan
    dur_M = dur_M + extra_compute_M + stall + ahead_plan
    # Where the MoE time goes (ms per micro-step, summed over layers): the mean rank's expert work and slot
    # gathers, the straggler's excess over the mean rank, all-to-alls (reactive: with its moves), the rest.
    parts = {"expert_work": work_MLR.mean(axis=2).sum(axis=1), "slot_gather": slot_MLR.mean(axis=2).sum(axis=1),
             "imbalance": expert_ML.sum(axis=1) - (work_MLR + slot_MLR + land_MLR).mean(axis=2).sum(axis=1),
             "grad_landing": land_MLR.mean(axis=2).sum(axis=1), "grad_return_wait": late_ML.sum(axis=1),
             "all_to_all": (moe_fwd_ML + moe_bwd_ML).sum(axis=1) - expert_ML.sum(axis=1) - late_ML.sum(axis=1)
             - (plan_s_ML.sum(axis=1) + L * allgather if reactive else 0.0) - (inline_tr if exact else 0.0),
             "copy_slowdown": extra_compute_M, "exposed_moves": stall + (inline_tr if exact else 0.0),
             "planning": exposed_plan}
    parts_M = {k: np.broadcast_to(v, (M,)) * 1e3 for k, v in parts.items()}
    return StageTimes(dur_M, moe_M, inline_tr + stall, exposed_plan, slowed_ML.sum(axis=1), transfer_bytes_R,
                      grad_bytes_R, dur_M[-1] - busy_MPR[-1], parts_M)
