"""This EP rank's experts as one plain tensor, whatever FSDP is doing to them at the moment.

torchtitan builds the expert mesh ``(dp_replicate, efsdp, ep)`` with
``efsdp = dp_shard / ep``: EP borrows ranks from the data-parallel shard axis
and FSDP shards each EP rank's experts again over ``efsdp`` (and replicates
them over ``dp_replicate``). Inside a block's forward/backward FSDP has them
unsharded (a DTensor on ``ep`` only); between micro-steps they are sharded
(``_StridedShard`` on ``efsdp``, ``Shard(0)`` on ``ep``). The placement runtime
reads owned experts between micro-steps only when ``is_ep_local`` says that is
free, and otherwise inside the layer's forward (``placement/runtime.py``).

Cost of ``ep_local`` when sharded: one all-gather over ``efsdp`` of the rank's
E/EP experts per layer (what FSDP's own forward all-gather moves); none when
``efsdp = 1``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard


def _want(w: DTensor) -> tuple:
    names = w.device_mesh.mesh_dim_names or ()
    return tuple(Shard(0) if n == "ep" else Replicate() for n in names)


def is_ep_local(w: torch.Tensor) -> bool:
    """Whether ``ep_local(w)`` is free (no collective): not a DTensor, or sharded on ``ep`` only now
    (mesh axes of size 1, e.g. ``efsdp = 1``, shard nothing)."""
    if not isinstance(w, DTensor):
        return True
    sizes = w.device_mesh.shape
    return all(p == q or n == 1 for p, q, n in zip(w.placements, _want(w), sizes))


def ep_local(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``w``'s rows of this EP rank (``[E/EP, ...]``), gathered over the other mesh axes if sharded there.

    ``dtype``: FSDP's compute dtype (``mixed_precision_param``); cast before gathering, so a bf16 job
    moves and holds bf16 copies of its fp32 master shards, as FSDP's own all-gather does.
    """
    if dtype is not None and w.dtype != dtype:
        w = w.to(dtype)
    if not isinstance(w, DTensor):
        return w
    want = _want(w)
    if tuple(w.placements) != want:
        w = w.redistribute(w.device_mesh, want)
    return w.to_local()
