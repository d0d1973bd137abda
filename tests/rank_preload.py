"""What the forkserver of ``distributed_helpers.run_ranks`` imports once, so that a spawned rank forks with it
loaded instead of importing it (torch, torchtitan and the trainer: ~3 s of CPU per rank on a quiet 2-core
machine, most of a small multi-rank test). The CPU patches go in first, as in ``conftest.py``."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torchtitan_patches  # noqa: E402

torchtitan_patches.apply_all()

import torch.distributed  # noqa: E402, F401

import titan_foremoe.train.rl_trainer  # noqa: E402, F401
import titan_foremoe.train.trainer  # noqa: E402, F401
