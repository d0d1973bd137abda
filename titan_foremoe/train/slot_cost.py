"""The foremoe planner's slot cost per stage: one cost model with the cluster simulator (issue 28).

``[balance] slot_overhead_tokens = "auto"`` prices one more expert group on a rank as the simulator charges it:
``simulator.grouped_mm.slot_tokens`` on the measured expert model of ``[balance] slot_cost_device`` at the
model's shape, fitted around the step's mean tokens per expert (the formula of ``simulator.simulate``'s "auto"),
forward only for the recompute stage and forward + backward for the update stage; with it, what a token costs in
a spare slot (``simulator.grouped_mm.spare_token_weight``: the in-place slot GEMM copies a spare slot's output rows
into place), the fixed time of a rank's spare part where it runs rows (``spare_part_ms``) and the expert
model's time of one group per row count (``group_ms_table``), on which foremoe's last
token polish levels the ranks (``planner/time_polish.py``), and the update stage's forward and backward tables
(``pass_tables``, used with ``[balance] pass_polish``). An int is used as is (and tokens are tokens).

Legend: M micro-steps, L layers, S source ranks, E experts.
"""

from __future__ import annotations

import numpy as np

from ..planner.types import CostModel
from ..simulator.calibration import load_calibration
from ..simulator.grouped_mm import (GroupedMMCost, group_ms_table, landing_prices, pass_tables, slot_tokens,
                                    spare_part_ms, spare_row_ms, spare_token_weight)

STAGES = ("recompute", "update")


class SlotCost:
    """``[balance] slot_overhead_tokens`` resolved per RL step: the planner's ``CostModel`` of each stage.

    ``auto`` loads the device's calibration curve once (here, per job: ~0.3 s with the imports); each step then
    costs one sum of the loads and two fits of 64 points (``slot_tokens``: the expert model's time at 64 group
    sizes, a degree-1 polyfit) and the time tables (the update stage's pass tables 0.3 ms of it): ~2.2 ms of numpy
    on the host for both stages (this 2-core machine, Qwen3-30B-A3B shape), no device sync, no collective."""

    def __init__(self, setting: str | int, device: str, dim: int, moe_hidden: int, spare_slots: int = 1):
        self.fixed = None if setting == "auto" else int(setting)
        self.spare_slots = spare_slots  # [balance] spare_slots: the spare part's fixed time gathers their bank rows
        self.curve = None
        if self.fixed is None:
            curve = load_calibration(device).curve(dim, moe_hidden)
            if not isinstance(curve, GroupedMMCost):
                raise ValueError(f"[balance] slot_cost_device: {device!r}'s calibration has no grouped_mm expert "
                                 'model to price a slot with: set [balance] slot_overhead_tokens to an int')
            self.curve = curve

    def tokens(self, loads_MLSE: np.ndarray) -> dict[str, int]:
        """``{stage: slot_overhead_tokens}`` for a step whose stages run ``loads_MLSE`` (both stages run the same
        rows). Depends on ``loads_MLSE`` alone: ranks holding the same loads get the same value."""
        return self.cost_models(loads_MLSE)[1]

    def cost_models(self, loads_MLSE: np.ndarray, rec_loads_MLSE: np.ndarray | None = None
                    ) -> tuple[dict[str, CostModel], dict[str, int]]:
        """(the planner's ``CostModel`` per stage, the tokens per stage): with ``auto`` the slot cost and the spare
        token weight of each stage (``grouped_mm.slot_tokens``, ``spare_token_weight``) at the stage's tokens per
        expert and micro-step (``rec_loads_MLSE``: the recompute's, where its micro-steps are not the update's);
        with an int that int and tokens as tokens."""
        if self.fixed is not None:
            tok, w = dict.fromkeys(STAGES, self.fixed), dict.fromkeys(STAGES, 1.0)
            table = dict.fromkeys(STAGES, {})
        else:
            stage_loads = {"recompute": loads_MLSE if rec_loads_MLSE is None else rec_loads_MLSE, "update": loads_MLSE}
            per = {s: float(np.asarray(x, dtype=np.float64).sum(axis=2).mean()) for s, x in stage_loads.items()}
            tok = {s: slot_tokens(self.curve, per[s], backward=s == "update") for s in STAGES}
            w = {s: spare_token_weight(self.curve, per[s], backward=s == "update", spare=self.spare_slots)
                 for s in STAGES}
            # and the time table the last token polish levels on (planner/time_polish.py), as the simulator's "auto"
            table = {s: {"group_ms": group_ms_table(self.curve, per[s], backward=s == "update"),
                         "spare_row_ms": spare_row_ms(self.curve, backward=s == "update", spare=self.spare_slots),
                         "spare_part_ms": spare_part_ms(self.curve, self.spare_slots, backward=s == "update",
                                                        tokens_per_slot=per[s]),
                         "passes": pass_tables(self.curve, per[s], backward=s == "update", spare=self.spare_slots),
                         **landing_prices(self.curve, backward=s == "update")}
                     for s in STAGES}
        return {s: CostModel(slot_overhead_tokens=t, spare_token_weight=w[s], **table[s]) for s, t in tok.items()}, tok
