"""Every rank creates its process groups in the same order: recorded, and compared once at start-up.

NCCL pairs communicators by creation order (a group's name is a hash of its ranks and a per-process counter), so a
rank that made its groups in another order (a branch on its own rank, a lazily made group) talks to the wrong
peers: a hang or wrong data long after the cause. ``record()`` wraps torch's ``new_group`` and ``split_group``
(``new_subgroups_by_enumeration`` and DeviceMesh go through them) and lists each call's ranks in order;
``check_same_order()`` compares this rank's list with rank 0's through the rendezvous store and raises one line
naming the first difference.

Cost: a Python list of the calls (DeviceMesh enumerates every group of a dimension: R ranks per mesh dimension);
at the check one store write per rank (a 64-char digest) plus rank 0's list, one read per rank of rank 0's digest,
and only on a mismatch one read of rank 0's list. No collective on the device.
"""

from __future__ import annotations

import hashlib
import json

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_calls: list[list] = []
_checks = 0


def record() -> None:
    """Start recording group creations in this process (idempotent; before the first group is made)."""
    if getattr(c10d.new_group, "_records_order", False):
        return
    import torch.distributed.device_mesh as device_mesh

    def wrap(name: str, ranks_of):
        inner = getattr(c10d, name)

        def recorded(*args, **kwargs):
            _calls.append([name, ranks_of(*args, **kwargs)])
            return inner(*args, **kwargs)

        recorded._records_order = True
        recorded.__wrapped__ = inner
        for mod in (c10d, dist, device_mesh):
            if getattr(mod, name, None) is inner:
                setattr(mod, name, recorded)

    def new_group_ranks(ranks=None, *a, **k):
        return sorted(ranks) if ranks is not None else None

    def split_ranks(parent_pg=None, split_ranks=None, *a, **k):
        return sorted(sorted(r) for r in split_ranks) if split_ranks is not None else None

    wrap("new_group", new_group_ranks)
    wrap("split_group", split_ranks)


def calls() -> list[list]:
    """The group creations recorded in this process, in order: ``[function, ranks]``."""
    return [list(c) for c in _calls]


def first_difference(mine: list, theirs: list, rank: int, other: int = 0) -> str | None:
    """One line naming the first group creation where this rank's order differs from ``other``'s (None: same)."""
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return (f"process groups created in another order on rank {rank} than on rank {other}: creation #{i} is "
                    f"{a[0]}(ranks={a[1]}) here, {b[0]}(ranks={b[1]}) on rank {other}")
    if len(mine) != len(theirs):
        i = min(len(mine), len(theirs))
        extra = (mine if len(mine) > len(theirs) else theirs)[i]
        where = f"rank {rank}" if len(mine) > len(theirs) else f"rank {other}"
        return (f"process groups: rank {rank} created {len(mine)}, rank {other} {len(theirs)}; the first extra is "
                f"#{i} {extra[0]}(ranks={extra[1]}) on {where}")
    return None


def _digest(entries: list) -> str:
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def check_same_order(store: dist.Store | None = None) -> None:
    """Raise ``RuntimeError`` on every rank, with one line naming the first difference, when any rank created its
    groups in another order than rank 0 (every rank must call it; call ``record()`` first in every process).

    Store traffic per rank: rank 0 writes its list and digest, each rank reads the digest, counts itself in and
    waits for the last one; a rank that differs reads rank 0's list and writes its line."""
    global _checks
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = store or c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"titan_foremoe/group_order/{_checks}"
    _checks += 1
    mine = calls()
    if rank == 0:
        store.set(f"{key}/list", json.dumps(mine))
        store.set(f"{key}/digest", _digest(mine))
    elif store.get(f"{key}/digest").decode() != _digest(mine):
        why = first_difference(mine, json.loads(store.get(f"{key}/list").decode()), rank)
        store.set(f"{key}/why", why or f"process groups: rank {rank}'s creation record differs from rank 0's")
        store.add(f"{key}/bad", 1)
    if store.add(f"{key}/done", 1) == world:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"])
    if store.add(f"{key}/bad", 0):
        raise RuntimeError(store.get(f"{key}/why").decode())
