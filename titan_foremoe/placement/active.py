"""The placement of one (micro-step, layer), as the dispatcher and the experts see it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..transfer.engine import TransferEngine
from .layout import LayerLayout


@dataclass
class ActivePlacement:
    engine: TransferEngine
    layer: int
    layouts_R: list[LayerLayout]  # every rank's layout (the gradient return needs them all)
    bank: int
    measured_rows: list[int] = field(default_factory=list)  # rows the experts actually processed

    @property
    def layout(self) -> LayerLayout:
        return self.layouts_R[self.engine.rank]
