"""Per-micro-step loads: the planner's input, built from routing logs before a stage runs."""

from .loads import gather_source_loads, micro_step_loads, row_loads, sequence_loads

__all__ = ["gather_source_loads", "micro_step_loads", "row_loads", "sequence_loads"]
