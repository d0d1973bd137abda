"""The transfer lane's own communicators: process groups over the same ranks as the EP group.

Weight prefetches run on a communicator of their own, so backward's token all-to-all never queues behind
them on the EP group's communicator (NCCL serializes the operations of one communicator); gradient returns
on a second one (``TransferEngine(grad_group=)``), so a layer's return never waits behind the next
micro-step's prefetches of all 48 layers. Cost of that second communicator, made only when a balancer runs:
one more NCCL communicator per EP group, its buffers allocated at its first all-to-all (NCCL_BUFFSIZE 4 MB
per channel and peer connection: tens of MB per rank on GPU), plus a gloo half (host memory, small). ``twin_group`` makes one for every EP group at once: ``new_subgroups_by_enumeration``
is collective over the whole world, so each rank learns every EP group's ranks first (one
``all_gather_object`` at start-up); works for any EP layout (EP inside a node, with or without FSDP
or replicate dimensions around it).
"""

from __future__ import annotations

import torch.distributed as dist

from ..distributed import groups


def twin_group(group: dist.ProcessGroup, backend: str | None = None) -> dist.ProcessGroup:
    """A new process group over ``group``'s ranks (``backend``: e.g. ``"gloo"`` for the host lane).

    Every rank of the world must call it, each with its own group; the groups must partition the world.
    """
    ranks = dist.get_process_group_ranks(group)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, ranks)
    unique = sorted({tuple(r) for r in every})
    seen = [r for g in unique for r in g]
    if len(seen) != len(set(seen)) or len(seen) != dist.get_world_size():
        raise ValueError(f"twin_group: the groups {unique} do not partition the {dist.get_world_size()} ranks")
    return groups.subgroups([list(g) for g in unique], backend=backend)  # with the job's timeout
