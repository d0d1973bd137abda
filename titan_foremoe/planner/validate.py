"""Input checks: bad loads or budgets must fail loudly before any planning."""

from __future__ import annotations

import numpy as np

from .types import PlannerConfig, Topology


def validate_loads(loads_MLSE: np.ndarray, topology: Topology) -> np.ndarray:
    """Return loads as int64 [M, L, S, E]; raise ValueError naming the problem.

    Sources are the data-parallel ranks, which are the expert-parallel ranks here (S == R).
    """
    if not isinstance(loads_MLSE, np.ndarray):
        raise ValueError(f"loads must be a numpy array, got {type(loads_MLSE).__name__}")
    if loads_MLSE.ndim != 4:
        raise ValueError(
            f"loads must be 4-D [micro_steps, layers, source_ranks, experts], got shape {loads_MLSE.shape}"
        )
    M, L, S, E = loads_MLSE.shape
    if min(M, L, E) < 1:
        raise ValueError(f"loads has an empty dimension: shape {loads_MLSE.shape}")
    if S != topology.num_ranks:
        raise ValueError(f"loads has {S} source ranks but the topology has {topology.num_ranks} ranks")
    if E % topology.num_ranks:
        raise ValueError(f"experts ({E}) must divide evenly over ranks ({topology.num_ranks})")
    if loads_MLSE.dtype.kind == "f":
        if np.isnan(loads_MLSE).any():
            raise ValueError("loads contain NaN")
        if not np.isfinite(loads_MLSE).all():
            raise ValueError("loads contain inf")
        if (loads_MLSE != np.round(loads_MLSE)).any():
            raise ValueError("loads must be whole token counts")
    elif loads_MLSE.dtype.kind not in "iub":
        raise ValueError(f"loads must be numeric, got dtype {loads_MLSE.dtype}")
    if (loads_MLSE < 0).any():
        raise ValueError("loads contain negative counts")
    return loads_MLSE.astype(np.int64, copy=False)


def validate_budget(config: PlannerConfig, num_experts: int, topology: Topology) -> int:
    """Spare slots per rank for this model; raises if the budget cannot hold the owners."""
    return config.resolve_spare(num_experts, topology.num_ranks)
