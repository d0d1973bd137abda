"""``[rl] recompute_merge``: the recompute's micro-steps as every ``k`` consecutive cells of the schedule.

One grouping rule for the runtime (its micro-batches and foresight loads, ``train/ahead.py``) and the simulator
(its recompute work, ``simulator/workload.merged_work``): groups of k consecutive micro-steps, the last one shorter
when k does not divide the stage. Every rank groups the same micro-step indices, so the stage's micro-step count
agrees with no collective.

Legend: M micro-steps of the stage.
"""

from __future__ import annotations

import numpy as np


def merged_cells(cells: list[list[int]], k: int) -> list[list[int]]:
    """Every ``k`` consecutive micro-steps' sequences as one, in order (a rank's packed merged row is its parts'
    rows end to end, so the recompute's log-probs split back exactly: ``train/rl_batches.split_recomputed``)."""
    return [[s for cell in cells[i : i + k] for s in cell] for i in range(0, len(cells), k)]


def merged_sums(x_M: np.ndarray, k: int) -> np.ndarray:
    """``x_M`` summed over the same groups of ``k`` consecutive micro-steps (axis 0): loads, tokens, pairs."""
    return np.stack([x_M[i : i + k].sum(axis=0) for i in range(0, len(x_M), k)])
