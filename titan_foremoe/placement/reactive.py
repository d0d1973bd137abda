"""The reactive baseline in the real runtime: each MoE layer plans itself at its dispatch, in every forward.

What Megatron-LM's virtual-expert balancing and LLEP do, with this project's pieces: at a layer's dispatch
(the router's expert ids are known there) this rank's token counts are all-gathered over the EP group
(``distributed/collectives.py``), the layer is planned by ``planner/reactive.py`` (``plan_stage("reactive")``
on a ``[1, 1, S, E]`` load), this rank's tables are compiled by ``placement/tables.py`` (the foresight
compiler; every replica fetched from its owner, nothing resident across forwards), and at the layer's
expert compute the replicas are moved over the transfer engine's lanes and waited for at once. Planning
and moves therefore sit on the critical path of every layer; there is no look-ahead and no prefetch.

Backward uses the forward's tables: a layer's ``ReactivePlacement`` lives for the whole micro-step
(forward and backward), and a second dispatch of the same layer in one micro-step (activation
checkpointing's recompute) reuses its plan and replicas instead of planning again. Replica gradients
return to the owners through ``transfer/autograd.py`` as in the foresight path.

Cost per layer per micro-step per rank at the Qwen3-30B-A3B size (E = 128, EP = 64): a device-to-host copy
of the counts (a sync on GPU), one count all-gather of E int64 (128 x 8 B x 64 = 64 KiB received), the
layer's plan and one-layer table compile (0.48 + 0.36 ms, ``benchmarks/bench_reactive_layer.py``), then up to
``spare_slots`` expert moves (9.4 MB each in bf16) exposed. Memory: one layer's
tables (KiB) and the layer's bank (``spare_slots`` experts), as the foresight path.

Legend: S source ranks (== R), E experts, R ranks, C slots per rank.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from ..distributed import device as dev
from ..distributed import collectives
from ..planner.balancers import plan_stage
from ..planner.types import PlannerConfig, Topology
from ..transfer.stats import TransferStats
from .active import ActivePlacement
from .runtime import MicroStepReport, PlacementRuntime
from .tables import LayerTables, compile_micro_step

BANK = 0  # every forward refills its layer's bank from the owners: one bank suffices


@dataclass
class OnlinePlan:
    """Stands for a stage plan while the reactive runtime runs a stage: the plans are made per layer at run time.

    ``plan_ms_M``: this rank's measured planning time per micro-step, all layers (count all-gather, plan,
    table compile), all of it on the critical path; ``gather_ms_M``: the count all-gathers' part of it (on a
    loaded machine mostly waiting for the slowest rank to reach the layer).
    """

    balancer: str
    plan_ms_M: np.ndarray
    gather_ms_M: np.ndarray
    info: dict = field(default_factory=dict)


@dataclass
class ReactivePlacement(ActivePlacement):
    """One layer of one micro-step; plans at the dispatch (``prepare``) and moves at the expert compute."""

    runtime: "ReactiveRuntime | None" = None
    tokens_E: np.ndarray | None = None  # the counts the tables were planned for
    moved: bool = False

    def prepare(self, num_tokens_per_expert_E: torch.Tensor) -> None:
        """Gather the layer's counts over the EP group, plan the layer and compile this rank's tables."""
        if self.recompute:  # activation checkpointing: the forward's plan and moves (no sync, no all-gather)
            return
        with dev.expected_sync("the reactive balancer reads its counts in the layer"):
            mine_E = dev.to_host(num_tokens_per_expert_E.detach()).to(torch.int64)
            if self.tokens_E is not None:
                if np.array_equal(mine_E.numpy(), self.tokens_E):
                    return  # the same layer again in this micro-step (recompute): the forward's plan
                raise RuntimeError(f"layer {self.layer}: dispatched twice in a micro-step with different routes")
            self.tables = self.runtime.plan_layer(self.layer, mine_E)
            self.tokens_E = mine_E.numpy()

    def slot_weights(self, owned: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        if self.tables is None:
            raise RuntimeError(f"layer {self.layer}: experts ran before the reactive plan (no dispatch)")
        if not self.moved:  # synchronous move from the owners, on the critical path
            self.runtime.move(self.layer, owned, self.tables)
            self.moved = True
        return super().slot_weights(owned, dtype)


class ReactiveRuntime(PlacementRuntime):
    """``PlacementRuntime``'s interface for the trainer, with plans made per layer inside the forward.

    ``count_group``: the EP process group the counts are all-gathered over (host tensors: its gloo side).
    """

    def __init__(self, *args, topology: Topology, config: PlannerConfig, count_group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.topology, self.config, self.count_group = topology, config, count_group
        self.spare = config.resolve_spare(self._experts(), self.R)
        self._plan_ms = self._gather_ms = 0.0
        self._planned_rows_L = np.zeros(len(self.layers), dtype=np.int64)
        self._replicas_L = np.zeros(len(self.layers), dtype=np.int64)

    def _experts(self) -> int:
        return self.layers[0].routed_experts.inner_experts.w1_EFD.shape[0]

    # -- the trainer's stage interface -------------------------------------------------------
    def compile(self, plan, loads_MLSE):
        raise RuntimeError("the reactive runtime plans at run time: it compiles no stage")

    def start_stage(self, plan, loads_MLSE: np.ndarray, tables=None, name: str = "stage", tokens_M=None) -> None:
        """``plan``, ``tables`` and ``tokens_M`` are ignored (each layer plans from its own counts);
        ``loads_MLSE`` only serves the metrics' conservation check."""
        self.loads_MLSE = np.asarray(loads_MLSE)
        M = self.loads_MLSE.shape[0]
        self.plan = OnlinePlan("reactive", np.zeros(M), np.zeros(M))
        self._new_route_flags(M)

    def prefetch(self, m: int) -> None:
        """Nothing moves ahead: every layer moves its replicas in its own forward."""

    @contextmanager
    def micro_step(self, m: int):
        self._plan_ms = self._gather_ms = 0.0
        self.engine.stage_indices = {}  # uploaded per layer by its plan; alive as long as its tables
        flags = self.route_bad_ML
        try:
            with self.installed([ReactivePlacement(self.engine, layer, None, BANK, runtime=self,
                                                   route_bad=None if flags is None else flags[m, layer])
                                 for layer in range(len(self.layers))]):
                yield
        finally:
            self.engine.stage_indices = {}
            if self.plan is not None and m < len(self.plan.plan_ms_M):
                self.plan.plan_ms_M[m], self.plan.gather_ms_M[m] = self._plan_ms, self._gather_ms

    def report(self, m: int) -> MicroStepReport:
        stats = self.engine.take_stats()  # spans whose events completed (the rest: a later report)
        return MicroStepReport(
            [ap.received_rows for ap in self._active], self._planned_rows_L.tolist(), self._replicas_L.tolist(),
            [ap.expert_timer for ap in self._active], stats,
        )


    # -- per layer, inside the forward ------------------------------------------------------
    def plan_layer(self, layer: int, mine_E: torch.Tensor) -> LayerTables:
        """All-gather the counts, plan the layer, compile this rank's tables (timed: ``placement/plan_ms``)."""
        t0 = time.perf_counter()
        loads_SE = collectives.all_gather(mine_E, self.count_group).numpy()
        self._gather_ms += (time.perf_counter() - t0) * 1e3
        plan = plan_stage("reactive", loads_SE[None, None], self.topology, self.config)
        intra, inter = self.engine.host_lanes()
        rt = compile_micro_step(
            plan.slots_MLRC[0], plan.assign_MLER[0], loads_SE[None], self.rank, self.topology.ranks_per_node,
            prev_slots_LRC=None, moves_T=plan.transfers_T, stale=True, host_intra=intra, host_inter=inter,
        )
        self._planned_rows_L[layer] = rt.planned_rows_L[0]
        self._replicas_L[layer] = rt.replicas_L[0]
        self.upload_tables([rt.layers[0]])  # the layer's device indices, in one copy
        self._plan_ms += (time.perf_counter() - t0) * 1e3
        return rt.layers[0]

    def move(self, layer: int, owned: tuple[torch.Tensor, ...], tables: LayerTables) -> None:
        """Fill the layer's bank from the owners and wait for it (the exposed move)."""
        self._send(layer, owned, tables.transfers, BANK, self.spare)
        self.engine.wait(layer)
