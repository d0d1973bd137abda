"""``torch.distributed.set_timeout`` is absent in torch 2.13.

torchtitan's ``distributed.utils.set_pg_timeouts`` (used to tighten the
collective timeout after the first step) calls it; torch 2.13 only has the
``ProcessGroup.set_timeout`` method. We provide the module-level function on
top of that method. Where the function exists the patch does nothing.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def needed() -> bool:
    return not hasattr(dist, "set_timeout")


def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    pg.set_timeout(timeout)


def apply() -> bool:
    if not needed():
        return False
    dist.set_timeout = set_timeout
    return True
