"""Execute a stage plan: per micro-step placements on every MoE layer, transfers one micro-step ahead.

Usage for a stage of M micro-steps::

    tables = runtime.compile(plan, loads_MLSE) # this rank's tables (planner thread: StagePlanner.submit(then=))
    runtime.start_stage(plan, loads_MLSE, tables)  # issues micro-step 0's transfers
    for m in range(M):
        with runtime.micro_step(m):
            out = model(...)                   # dispatch follows the plan; layer l waits for its replicas
            runtime.prefetch(m + 1)            # m+1's replicas travel during m's backward
            loss.backward()                    # replica gradients go back to their owners
    runtime.end_stage()

Every balancer (``static``, ``eplb_history``, ``eplb_oracle``, ``foremoe``)
runs through this one path; they differ only in the plan.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ..distributed.ep import ep_local
from ..models.seams import moe_layers
from ..planner.types import StagePlan
from ..transfer.engine import TransferEngine
from ..transfer.stats import TransferStats
from .active import ActivePlacement
from .tables import RankTables, compile_stage


@dataclass
class MicroStepReport:
    """What the runtime measured in one micro-step (this rank's view, all layers).

    ``measured_rows_L``: rows the dispatcher's all-to-all delivered (the received tensors' sizes);
    ``expert_ms_L``: expert compute time (forwards; CUDA events on GPU, ``perf_counter`` on CPU).
    """

    measured_rows_L: list[int]
    planned_rows_L: list[int]
    replicas_L: list[int]
    expert_ms_L: list[float] = field(default_factory=list)
    transfers: TransferStats = field(default_factory=TransferStats)


class PlacementRuntime:
    """Runs stage plans on one EP group: ``group`` is the EP process group, ``rank``/``num_ranks`` this
    rank's index in it and its size, ``node_of_rank_R`` the node of each EP rank."""

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup | None, rank: int, num_ranks: int,
                 node_of_rank_R: np.ndarray, path: str = "direct", cost=None,
                 host_group: dist.ProcessGroup | None = None, weights_dtype: torch.dtype | None = None):
        self.layers = moe_layers(model)
        self.rank, self.R = rank, num_ranks
        self.weights_dtype = weights_dtype  # FSDP's compute dtype: replicas are copies of what owners compute with
        self.node_of_rank_R = node_of_rank_R
        self.engine = TransferEngine(group, rank, num_ranks, node_of_rank_R, path, cost, host_group)
        self._host_fresh = False
        self._host_possible: bool | None = None
        self.plan: StagePlan | None = None
        self.tables: list[RankTables] = []
        self._bank_rows = 0
        self._active: list[ActivePlacement] = []
        self._bank_base = 0

    # -- plan bookkeeping ----------------------------------------------------------
    def compile(self, plan: StagePlan, loads_MLSE: np.ndarray) -> list[RankTables]:
        """This rank's tables for every micro-step of ``plan`` (pure; safe in the planner thread)."""
        intra, inter = self.engine.host_lanes()
        return compile_stage(plan, loads_MLSE, self.rank, host_intra=intra, host_inter=inter)

    def start_stage(self, plan: StagePlan, loads_MLSE: np.ndarray, tables: list[RankTables] | None = None) -> None:
        if plan.info.get("executable") is False:
            raise ValueError(f"balancer {plan.balancer!r} is a bound, not an executable placement")
        M, L = plan.assign_MLER.shape[:2]
        if loads_MLSE.shape[:2] != (M, L) or L != len(self.layers):
            raise ValueError(f"plan {plan.assign_MLER.shape} and loads {loads_MLSE.shape} / {len(self.layers)} layers disagree")
        if plan.topology.num_ranks != self.R:
            raise ValueError(f"plan is for {plan.topology.num_ranks} EP ranks, this EP group has {self.R}")
        E = plan.assign_MLER.shape[2]
        if plan.balancer.startswith("foremoe") and not np.array_equal(
                plan.owner_MLE, np.broadcast_to(np.arange(E) // (E // self.R), plan.owner_MLE.shape)):
            raise ValueError("the runtime keeps experts on their DTensor shards: plan with owner_policy='contiguous'")
        self.plan, self.loads_MLSE = plan, np.asarray(loads_MLSE)
        self.tables = tables if tables is not None else self.compile(plan, self.loads_MLSE)
        if len(self.tables) != M or any(t.rank != self.rank for t in self.tables):
            raise ValueError(f"tables for {len(self.tables)} micro-steps / another rank; the plan has {M}")
        # banks hold the spare slots (more only for plans that put non-owned experts in owned slots: EPLB)
        spare = plan.slots_MLRC.shape[3] - plan.assign_MLER.shape[2] // self.R
        self._bank_rows = max(spare, *(t.num_bank_rows for t in self.tables))
        self.refresh_host_copies()
        self.prefetch(0)

    def weights_changed(self) -> None:
        """Call after an optimizer step: replicas and host copies (CPU-assisted path) are stale."""
        self._host_fresh = False
        self.engine.weights_changed()

    def _may_use_host(self) -> bool:
        """Whether any move could take the host lane: topology and cost model only, not this group's plan.

        Reading owned experts gathers over ``efsdp``, whose peers sit in other EP groups with other
        plans; deciding from the plan would let them disagree on whether to gather (a hang).
        """
        if self._host_possible is None:
            intra, inter = self.engine.host_lanes()
            multi_node = len(np.unique(self.node_of_rank_R)) > 1
            self._host_possible = bool((intra and self.R > 1) or (inter and multi_node))
        return self._host_possible

    def refresh_host_copies(self) -> None:
        """Stage this rank's own experts in host memory, once per optimizer step, if any move may need them."""
        if self.engine.path == "direct" or self._host_fresh or not self._may_use_host():
            return
        with torch.no_grad():
            for layer in range(len(self.layers)):
                self.engine.refresh_host_copies(layer, self._owned(layer), self._dtype(layer))
        self._host_fresh = True

    def _bank(self, m: int) -> int:
        return (self._bank_base + m) % 2

    def _owned(self, layer: int) -> tuple[torch.Tensor, ...]:
        """This EP rank's experts of ``layer`` (gathered over the expert FSDP axis if sharded now)."""
        e = self.layers[layer].routed_experts.inner_experts
        return tuple(ep_local(w.detach(), self.weights_dtype) for w in (e.w1_EFD, e.w2_EDF, e.w3_EFD))

    def _dtype(self, layer: int) -> torch.dtype:
        return self.layers[layer].routed_experts.inner_experts.compute_dtype

    # -- transfers ------------------------------------------------------------------
    def prefetch(self, m: int) -> None:
        """Issue micro-step m's replica transfers (all layers) into its bank; no-op past the stage."""
        if self.plan is None or m >= len(self.tables):
            return
        self.refresh_host_copies()
        with torch.no_grad():
            for layer, lt in enumerate(self.tables[m].layers):
                self.engine.prefetch(layer, self._owned(layer), lt.transfers, self._bank(m), self._bank_rows,
                                     self._dtype(layer))

    @contextmanager
    def micro_step(self, m: int):
        """Within the block every MoE layer dispatches and computes by micro-step m's plan."""
        self._active = []
        for layer, moe in enumerate(self.layers):
            ap = ActivePlacement(self.engine, layer, self.tables[m].layers[layer], self._bank(m))
            moe.routed_experts.token_dispatcher.placement = ap
            moe.routed_experts.inner_experts.placement = ap
            self._active.append(ap)
        try:
            yield
        finally:
            for moe in self.layers:
                moe.routed_experts.token_dispatcher.placement = None
                moe.routed_experts.inner_experts.placement = None

    def report(self, m: int) -> MicroStepReport:
        """Rows each layer's dispatcher delivered to this rank in the last ``micro_step(m)``, vs the plan."""
        t = self.tables[m]
        stats, self.engine.stats = self.engine.stats, TransferStats()
        return MicroStepReport(
            [ap.received_rows for ap in self._active], t.planned_rows_L.tolist(), t.replicas_L.tolist(),
            [ap.expert_ms() for ap in self._active], stats,
        )

    def end_stage(self) -> None:
        for layer in range(len(self.layers)):
            self.engine.wait(layer)
        if self.plan is not None:
            self._bank_base = (self._bank_base + len(self.tables)) % 2
        self.plan = None
        self.tables = []
