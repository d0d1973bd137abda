"""Every rollout source: embedded generation, and files from external engines (vLLM, SGLang, verl, slime).

``generate`` decodes on the policy itself and records every token's experts; ``formats`` decodes each
engine's routed-experts wire format, ``importer`` validates and writes a sharded rollout directory
(``store``); ``sources`` hands the trainer one step's rows per rank, a module per source behind one interface.
"""

from .formats import FORMATS
from .importer import ImportReport, import_rollouts
from .sample import ModelSpec, RolloutError, RolloutSample, validate_sample
from .store import RolloutStore, RolloutWriter

__all__ = ["FORMATS", "ImportReport", "ModelSpec", "RolloutError", "RolloutSample", "RolloutStore",
           "RolloutWriter", "import_rollouts", "validate_sample"]
