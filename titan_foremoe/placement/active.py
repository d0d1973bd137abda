"""The placement of one (micro-step, layer) as the model sees it: implements ``models.seams.PlacementSeam``."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from ..transfer.engine import TransferEngine
from ..transfer.timing import ExposedTimer
from .tables import LayerDispatch, LayerTables


@dataclass
class ActivePlacement:
    engine: TransferEngine
    layer: int
    tables: LayerTables
    bank: int
    route_bad: torch.Tensor | None = None  # 0-d device flag of this (micro-step, layer), read once per stage
    received_rows: int = 0  # rows the dispatcher's all-to-all delivered (the received tensor's size)
    expert_timer: ExposedTimer = field(default_factory=ExposedTimer)  # events around the expert compute
    recompute: bool = False  # activation checkpointing's recompute of this (micro-step, layer): no side effects

    def for_recompute(self) -> "ActivePlacement":
        """The same tables and bank for activation checkpointing's recompute (``models/seams.RecomputeSeams``):
        the forward already waited for the replicas, issued the next transfers and counted rows, timings and
        route flags; the recompute only reads. Counters of its own, so the forward's are not counted twice."""
        return replace(self, route_bad=None, received_rows=0, expert_timer=ExposedTimer(), recompute=True)

    @property
    def dispatch(self) -> LayerDispatch:
        return self.tables.dispatch

    def slot_weights(self, owned: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return self.engine.slot_weights(self.layer, owned, self.tables.slot_source_C, self.tables.transfers,
                                        self.bank, dtype, wait=not self.recompute, split=self.tables.split)

    def index(self, name: str, device: torch.device) -> torch.Tensor:
        """Dispatch table ``name`` on the device (``recv_C``: ``recv_SC`` flattened), from the stage's upload."""
        d = self.dispatch
        if name == "recv_C":
            return self.engine._index(d.recv_SC, device, "flat", lambda: d.recv_SC.reshape(-1))
        return self.engine._index(getattr(d, name), device)

    def check_loads(self, num_tokens_per_expert_E: torch.Tensor) -> None:
        """Routes must equal the loads the plan was made for: flagged on the device (raised at the stage's
        end by the runtime, no sync here); without a flag (a placement installed by hand) checked now."""
        if self.recompute:  # the forward checked these very routes
            return
        planned_E = self.index("tokens_E", num_tokens_per_expert_E.device)
        differs = (num_tokens_per_expert_E.to(planned_E.dtype) != planned_E).any()
        if self.route_bad is not None:
            self.route_bad.logical_or_(differs)
        elif differs:
            raise RuntimeError(
                f"layer {self.layer}: this micro-step's routes {num_tokens_per_expert_E.tolist()} differ from the "
                f"loads the plan was made for {planned_E.tolist()}"
            )

    def record_received(self, rows: int) -> None:
        self.received_rows += int(rows)

    @contextmanager
    def time_experts(self, device: torch.device):
        if self.recompute:  # expert time is the forwards'
            yield
            return
        with self.expert_timer.span(device):
            yield
