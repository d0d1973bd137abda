"""Guards run before every optimizer step: a non-finite loss or gradient norm never reaches the weights.

Both quantities are global (all-reduced loss, total grad norm over all ranks),
so every rank takes the same decision without another collective.
"""

from __future__ import annotations

import math


class NonFiniteError(RuntimeError):
    """Raised (``[training] nonfinite = "stop"``) before the optimizer step; no checkpoint holds the poisoned state."""


def non_finite(step: int, **quantities: float) -> str | None:
    """One line naming the step and every non-finite quantity, or None when all are finite."""
    bad = [f"{name} = {value}" for name, value in quantities.items() if not math.isfinite(value)]
    if not bad:
        return None
    return f"step {step}: non-finite {', '.join(bad)}"
