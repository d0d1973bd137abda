"""Sequence schedule: which rank and micro-step computes each sequence of a step, decided before the stage.

Data path: rollout -> routing log -> sequence schedule -> per-micro-step loads -> planner. A pure function of
the step's sequence lengths (and optionally their expert loads), so every rank computes the same schedule and a
resumed run recomputes it exactly. See docs/schedule.md.
"""

from .cost import DenseCost
from .sequences import POLICIES, schedule_sequences
from .types import SequenceSchedule

__all__ = ["DenseCost", "POLICIES", "SequenceSchedule", "schedule_sequences"]
