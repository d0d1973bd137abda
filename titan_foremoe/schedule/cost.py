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

    ``token``: the work per position (projections, norms, MLPs; the trainer's ``dense_cost`` adds the routed
    experts' FLOPs, since an EP group's expert work follows its tokens); ``pair``: attention per causal query-key
    pair. In FLOPs, ``pair / token`` is about ``4 * head_dim * heads / (FLOPs per token per layer)``;
    ``pair = 0`` levels tokens only.
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
