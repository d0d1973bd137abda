"""torchtitan picks ``device_type = "cuda"`` when no accelerator is found.

``torchtitan.tools.utils.get_device_info`` falls back to ``"cuda"``, so on a
CPU-only machine every ``torch.device(device_type, rank)`` and
``device_module.set_device`` call fails. We point it at the CPU before other
torchtitan modules copy the value with ``from torchtitan.tools.utils import
device_type``. ``torch.cpu.current_device()`` returns the string ``"cpu"``
where torchtitan expects a device index (``barrier(device_ids=[...])`` in
``set_pg_timeouts``), so the device module is ``torch.cpu`` with an index-0
``current_device``.
"""

from __future__ import annotations

import sys
import types

import torch


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> bool:
    if not needed():
        return False
    import torchtitan.tools.utils as tt_utils

    if tt_utils.device_type == "cpu":
        return False  # already applied
    stale = [
        name
        for name in ("torchtitan.distributed.utils", "torchtitan.models.common.token_dispatcher")
        if name in sys.modules
    ]
    if stale:
        raise RuntimeError(
            f"torchtitan_patches.cpu_device must run before importing {stale}; "
            "call torchtitan_patches.apply_all() first"
        )
    tt_utils.device_type = "cpu"
    tt_utils.device_module = cpu_device_module()
    return True


def cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` whose ``current_device()`` is the index 0, as on CUDA."""
    module = types.ModuleType("titan_foremoe_cpu_device_module")
    module.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})
    module.current_device = lambda: 0
    return module
