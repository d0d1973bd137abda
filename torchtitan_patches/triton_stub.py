"""torchtitan's model imports reach ``import triton`` without a GPU.

``models/common/token_dispatcher.py`` imports the MinimalAsyncEP backend, whose
``kernels.py`` starts with ``import triton``; triton is not installable on a
CPU-only machine, so even building a model fails. We register a stand-in
``kernels`` module whose functions raise a clear error if the (GPU-only)
MinimalAsyncEP dispatcher is ever used; every other dispatcher works.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch

KERNELS_MODULE = "torchtitan.distributed.minimal_async_ep.kernels"
KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)


def needed() -> bool:
    return not torch.cuda.is_available() and importlib.util.find_spec("triton") is None


def _unavailable(name: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(
            f"{name} is a triton kernel of torchtitan's MinimalAsyncEP dispatcher; "
            "it needs CUDA and triton. Use the all-to-all dispatcher on CPU."
        )

    kernel.__name__ = name
    return kernel


def apply() -> bool:
    if not needed() or KERNELS_MODULE in sys.modules:
        return False
    stub = types.ModuleType(KERNELS_MODULE)
    stub.__doc__ = "CPU stand-in installed by torchtitan_patches.triton_stub"
    for name in KERNEL_NAMES:
        setattr(stub, name, _unavailable(name))
    sys.modules[KERNELS_MODULE] = stub
    return True
