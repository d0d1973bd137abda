"""Relative dense cost of one sequence's forward and backward: linear work plus causal attention pairs.

Legend: N sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def causal_pairs(tokens_N: np.ndarray) -> np.ndarray:
    """``n (n + 1) / 2``: query-key pairs causal attention computes over a sequence of n positions."""
    n = np.asarray(tokens_N, dtype=np.float64)
    return n * (n + 1.0) / 2.0


@dataclass(frozen=True)
class DenseCost:
    """``token * n + pair * n (n + 1) / 2`` for a sequence of n positions (any unit: only ratios matter).

    ``token``: the projections, norms and MLP-free dense work per position; ``pair``: attention per causal
    query-key pair. With the calibrated rates of a model, ``pair / token`` is about ``2 * head_dim * heads /
    (dense FLOPs per token)``; ``pair = 0`` levels tokens only.
    """

    token: float = 1.0
    pair: float = 0.0

    def __post_init__(self):
        if not (self.token >= 0 and self.pair >= 0 and self.token + self.pair > 0):
            raise ValueError(f"DenseCost needs token >= 0 and pair >= 0, not both 0 (got token={self.token}, "
                             f"pair={self.pair})")

    def of(self, tokens_N: np.ndarray) -> np.ndarray:
        """float64 ``[N]`` cost of each sequence."""
        n = np.asarray(tokens_N, dtype=np.float64)
        return self.token * n + (self.pair * causal_pairs(n) if self.pair else 0.0)
