"""Rollouts from external engines (vLLM, SGLang, verl, slime): import, store, and feed the trainer.

``formats`` decodes each engine's routed-experts wire format, ``importer`` validates
and writes a sharded rollout directory (``store``), ``source`` hands the trainer
one step's rows per rank, from that directory or from the embedded rollout.
"""

from .formats import FORMATS
from .importer import ImportReport, import_rollouts
from .sample import ModelSpec, RolloutError, RolloutSample, validate_sample
from .store import RolloutStore, RolloutWriter

__all__ = ["FORMATS", "ImportReport", "ModelSpec", "RolloutError", "RolloutSample", "RolloutStore",
           "RolloutWriter", "import_rollouts", "validate_sample"]
