"""Does a rollout directory fit the job: one set of rules for the pre-flight and for every rank.

The pre-flight (``config/validate_rl.py``) checks all the rows the job will read,
before torchrun starts; each rank's ``FileSource`` checks again, its own rows
only, so a directory changed in between is still refused before any step.
"""

from __future__ import annotations

import numpy as np

from .sample import RolloutError
from .store import RolloutStore


def check_length(store: RolloutStore, row: int, T: int, seq_len: int, overlong: str) -> None:
    """A row of ``T`` tokens feeds ``T - 1`` positions; more than ``seq_len`` is refused unless truncating."""
    if T - 1 > seq_len and overlong == "refuse":
        raise RolloutError(f"{store.path} row {row}", "tokens",
                           f"{T} tokens = {T - 1} input positions > [training] seq_len {seq_len} "
                           "(set [rl] rollout_overlong = 'truncate' to cut them)")


def check_fits(store: RolloutStore, *, num_layers: int, top_k: int, num_experts: int, steps: int,
               rows_per_step: int, seq_len: int, overlong: str, ranges: list[range]) -> None:
    """Routes of the model's shape, ``steps x rows_per_step`` rows, and no row of ``ranges`` too long."""
    spec = store.spec()
    if (spec.num_layers, spec.top_k, spec.num_experts) != (num_layers, top_k, num_experts):
        raise RolloutError(str(store.path), "index.json",
                           f"routes for {spec.num_layers} layers x top-{spec.top_k} of {spec.num_experts} experts; "
                           f"the model has {num_layers} x top-{top_k} of {num_experts}")
    if steps * rows_per_step > store.rows:
        raise RolloutError(str(store.path), "rows", f"{store.rows} rows, the job needs {steps} steps x {rows_per_step} "
                           "rows ([training] steps x rollout rows)")
    if overlong != "refuse":
        return
    for rows in ranges:  # offsets only: no token is read
        lengths = store.lengths(rows)
        over = np.flatnonzero(lengths - 1 > seq_len)
        if len(over):
            check_length(store, rows.start + int(over[0]), int(lengths[over[0]]), seq_len, overlong)
