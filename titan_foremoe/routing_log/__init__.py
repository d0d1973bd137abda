"""Routing logs: every token's experts at every MoE layer, recorded by the rollout."""

from .external import from_external
from .log import RoutingLog, RoutingLogError, route_dtype

__all__ = ["RoutingLog", "RoutingLogError", "from_external", "route_dtype"]
