"""Transfer engine: replica weights moved one micro-step ahead, gradients returned to owners.

``schedule.py`` (the per-rank send/receive lists, compiled by ``placement/tables.py``), ``banks.py`` (replica
buffers), ``engine.py`` (executes the lists), ``autograd.py`` (gradient return), ``stats.py``.
"""

from .autograd import ReplicaWeights
from .engine import TransferEngine
from .schedule import Exchange, LayerTransfers
from .stats import TransferStats

__all__ = ["Exchange", "LayerTransfers", "ReplicaWeights", "TransferEngine", "TransferStats"]
