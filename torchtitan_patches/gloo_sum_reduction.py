"""gloo has no ``PREMUL_SUM`` reduce op, which FSDP2 uses for gradients.

torchtitan calls ``set_gradient_divide_factor(1.0)`` on every FSDP module
(``distributed/fsdp.py: disable_fsdp_gradient_division``); FSDP2 then
reduce-scatters gradients with ``PREMUL_SUM``, which gloo rejects. Asking FSDP
for a plain SUM (``set_force_sum_reduction_for_comms(True)``) keeps the same
math (the divide factor is 1.0) with an op gloo supports.
"""

from __future__ import annotations

import torch

_MARK = "_titan_foremoe_force_sum"


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> bool:
    if not needed():
        return False
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule

    original = tt_fsdp.disable_fsdp_gradient_division
    if getattr(original, _MARK, False):
        return False

    def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    setattr(disable_fsdp_gradient_division, _MARK, True)
    tt_fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division
    return True
