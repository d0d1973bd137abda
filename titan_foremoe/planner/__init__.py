"""Foresight planner: per-micro-step expert placement from known loads.

Levels: owners.py (step), replicas.py (micro-step), split.py (token), transfers.py
(schedule); eplb.py and balancers.py hold the baselines behind ``plan_stage``.
"""

from .balancers import BALANCERS, plan_stage
from .planahead import StagePlanner
from .split import source_split
from .types import TRANSFER_DTYPE, CostModel, PlannerConfig, StagePlan, Topology

__all__ = [
    "BALANCERS",
    "CostModel",
    "PlannerConfig",
    "StagePlan",
    "StagePlanner",
    "TRANSFER_DTYPE",
    "Topology",
    "plan_stage",
    "source_split",
]
