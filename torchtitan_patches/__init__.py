"""Small, explicit fixes that let torchtitan 0.3.0 run on CPU/gloo, and on torch 2.11-2.14.

Each patch is one module with an ``apply()`` that is a no-op where it is not
needed: the CPU patches where CUDA is present, ``torch_compat`` on torch 2.13+. ``apply_all()`` must be called before
any torchtitan model module is imported, because torchtitan reads the device
type and imports triton kernels at import time.
"""

from __future__ import annotations

from . import cpu_device, dtensor_cpu_init, gloo_sum_reduction, pg_set_timeout, torch_compat, triton_stub

# Order matters: the device type must be fixed before other torchtitan
# modules do ``from torchtitan.tools.utils import device_type``; torch_compat
# (which imports torchtitan's qwen3 parallelize on torch 2.11, so after the
# triton stub) before anything imports ``torchtitan.distributed.fsdp``.
PATCHES = (cpu_device, triton_stub, torch_compat, gloo_sum_reduction, pg_set_timeout, dtensor_cpu_init)

_applied: list[str] = []


def apply_all() -> list[str]:
    """Apply every patch once; return the names of those that changed something."""
    if not _applied:
        for patch in PATCHES:
            if patch.apply():
                _applied.append(patch.__name__.rsplit(".", 1)[-1])
    return list(_applied)


def cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()
