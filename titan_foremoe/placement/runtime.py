"""Execute a stage plan: per micro-step placements on every MoE layer, transfers one micro-step ahead.

Usage for a stage of M micro-steps::

    runtime.start_stage(plan, loads_MLSE)      # issues micro-step 0's transfers
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
from ..transfer.engine import TransferEngine, TransferStats
from .active import ActivePlacement
from .layout import LayerLayout, layer_layout


@dataclass
class MicroStepReport:
    """What the runtime measured in one micro-step (this rank's view, all layers)."""

    measured_rows_L: list[int]
    planned_rows_L: list[int]
    replicas_L: list[int]
    transfers: TransferStats = field(default_factory=TransferStats)


class PlacementRuntime:
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
        self._layouts: dict[tuple[int, int], list[LayerLayout]] = {}
        self._active: list[ActivePlacement] = []
        self._bank_base = 0

    # -- plan bookkeeping ----------------------------------------------------------
    def start_stage(self, plan: StagePlan, loads_MLSE: np.ndarray) -> None:
        if plan.info.get("executable") is False:
            raise ValueError(f"balancer {plan.balancer!r} is a bound, not an executable placement")
        M, L = plan.assign_MLER.shape[:2]
        if loads_MLSE.shape[:2] != (M, L) or L != len(self.layers):
            raise ValueError(f"plan {plan.assign_MLER.shape} and loads {loads_MLSE.shape} / {len(self.layers)} layers disagree")
        self.plan, self.loads_MLSE = plan, np.asarray(loads_MLSE)
        self._layouts.clear()
        self.refresh_host_copies()
        self.prefetch(0)

    def weights_changed(self) -> None:
        """Call after an optimizer step: replicas and host copies (CPU-assisted path) are stale."""
        self._host_fresh = False
        self.engine.weights_changed()

    def _may_use_host(self) -> bool:
        """Whether any move could take the host path: topology and cost model only, not this group's plan.

        Reading sharded experts gathers over ``efsdp``, whose peers sit in other EP groups with other
        plans; deciding from the plan would let them disagree on whether to gather (a hang).
        """
        if self._host_possible is None:  # fixed for the run: one pass over rank pairs, once
            R = self.R
            self._host_possible = any(self.engine.uses_host(s, d) for s in range(R) for d in range(R) if s != d)
        return self._host_possible

    def refresh_host_copies(self) -> None:
        if self.engine.path == "direct" or self._host_fresh or not self._may_use_host():
            return
        with torch.no_grad():
            for layer in range(len(self.layers)):
                self.engine.refresh_host_copies(layer, self._owned(layer))
        self._host_fresh = True

    def layouts(self, m: int, layer: int) -> list[LayerLayout]:
        key = (m, layer)
        if key not in self._layouts:
            p = self.plan
            self._layouts[key] = [
                layer_layout(r, p.slots_MLRC[m, layer], p.assign_MLER[m, layer], self.loads_MLSE[m, layer],
                             self.node_of_rank_R)
                for r in range(self.R)
            ]
        return self._layouts[key]

    def _bank(self, m: int) -> int:
        return (self._bank_base + m) % 2

    def _owned(self, layer: int) -> tuple[torch.Tensor, ...]:
        """This EP rank's experts of ``layer`` (gathered over the expert FSDP axis if sharded now)."""
        e = self.layers[layer].routed_experts.inner_experts
        return tuple(ep_local(w.detach(), self.weights_dtype) for w in (e.w1_EFD, e.w2_EDF, e.w3_EFD))

    # -- transfers ------------------------------------------------------------------
    def prefetch(self, m: int) -> None:
        """Issue micro-step m's replica transfers (all layers) into its bank; no-op past the stage."""
        p = self.plan
        if p is None or m >= p.assign_MLER.shape[0]:
            return
        moves = p.transfers_T[p.transfers_T["micro_step"] == m]
        self.refresh_host_copies()
        with torch.no_grad():
            for layer in range(len(self.layers)):
                self.engine.prefetch(
                    layer, self._owned(layer), self.layouts(m, layer),
                    self.layouts(m - 1, layer) if m > 0 else None,
                    moves[moves["layer"] == layer], self._bank(m),
                )

    @contextmanager
    def micro_step(self, m: int):
        """Within the block every MoE layer dispatches and computes by micro-step m's plan."""
        self._active = []
        for layer, moe in enumerate(self.layers):
            ap = ActivePlacement(self.engine, layer, self.layouts(m, layer), self._bank(m))
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
        """Rows each layer's experts processed on this rank in the last ``micro_step(m)`` vs the plan."""
        measured = [sum(ap.measured_rows) for ap in self._active]
        planned = [int(self.plan.assign_MLER[m, layer, :, self.rank].sum()) for layer in range(len(self.layers))]
        replicas = [
            int(((lay.slot_expert_C >= 0) & (lay.owner_E[lay.slot_expert_C.clip(0)] != self.rank)).sum())
            for lay in (self.layouts(m, layer)[self.rank] for layer in range(len(self.layers)))
        ]
        stats, self.engine.stats = self.engine.stats, TransferStats()
        return MicroStepReport(measured, planned, replicas, stats)

    def end_stage(self) -> None:
        """Drain anything in flight; the next stage starts on the other bank parity."""
        for layer in range(len(self.layers)):
            self.engine.wait(layer)
        if self.plan is not None:
            self._bank_base = (self._bank_base + self.plan.assign_MLER.shape[0]) % 2
        self.plan = None
        self._layouts.clear()
