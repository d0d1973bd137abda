"""Qwen3-MoE-style decoder built from torchtitan's ``models/common`` blocks.

Importing this package applies ``torchtitan_patches`` first: torchtitan's
model modules import triton and read the device type at import time, so the
CPU fixes must be in place before the first of them is imported.
"""

import torchtitan_patches

torchtitan_patches.apply_all()
