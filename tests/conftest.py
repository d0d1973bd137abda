"""Tests run on CPU; torchtitan's CPU patches go in before anything imports it."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torchtitan_patches  # noqa: E402

torchtitan_patches.apply_all()
