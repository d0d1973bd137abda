"""Every process group the project creates, made with the job's collective timeout and kept so it can be tightened.

torchtitan sets the timeout of the default group and its mesh groups (``set_pg_timeouts``), nothing else. Our
own groups (the transfer lane's twin of each EP group, the host lane's gloo group, the re-layout group) would
otherwise keep torch's default (10 min on NCCL, 30 min on gloo): a stuck peer would hang a rank far past the
job's ``[comm] train_timeout_seconds``. So they are all made here, with the timeout in effect (the init timeout
until the first step ends), and ``set_timeouts`` moves every one of them to the training timeout with the mesh
groups. Nothing else in ``titan_foremoe`` calls ``new_group``/``new_subgroups*`` (``tests/test_guards.py``
greps for it).

Cost: one Python list of the groups this rank belongs to (a handful); no collective beyond the creation.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

_timeout: timedelta | None = None  # None: torch's default (no job configured, e.g. unit tests)
_groups: list[dist.ProcessGroup] = []


def set_timeouts(timeout: timedelta) -> None:
    """From now on the project's groups, existing and new, time collectives out after ``timeout``."""
    global _timeout
    _timeout = timeout
    for group in _groups:
        group.set_timeout(timeout)


def current_timeout() -> timedelta | None:
    return _timeout


def subgroups(ranks_per_group: list[list[int]], backend: str | None = None) -> dist.ProcessGroup:
    """This rank's group among ``ranks_per_group`` (a partition of the world; collective over the world)."""
    mine, _ = dist.new_subgroups_by_enumeration(ranks_per_group, timeout=_timeout, backend=backend)
    _groups.append(mine)
    return mine


def created() -> list[dist.ProcessGroup]:
    """The groups made here that this rank belongs to (tests)."""
    return list(_groups)
