"""Transfer engine: replica weights moved one micro-step ahead, gradients returned to owners."""

from .engine import ReplicaWeights, TransferEngine, TransferStats

__all__ = ["ReplicaWeights", "TransferEngine", "TransferStats"]
