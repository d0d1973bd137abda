"""Collectives on host (CPU) metadata: the one place that knows NCCL refuses host tensors.

Loads, metrics, lockstep flags and placement reports are small CPU tensors. On
CUDA the default group is ``cuda:nccl,cpu:gloo`` (torchtitan's
``init_distributed(enable_cpu_backend=True)``, see ``parallelize``) and every
mesh group inherits both backends, so a host tensor goes to the gloo side as
it is. A group without a CPU backend (an NCCL-only group made elsewhere) gets
the tensor staged on its device and copied back: slower, never wrong. Nothing
outside this module calls ``torch.distributed`` collectives on host tensors
(``tests/test_collectives.py`` greps for it); the token all-to-all and the
weight moves carry device tensors and call the backend directly.

Cost: these tensors are O(layers x experts x EP) at most (the foresight loads,
``loads_MLSE`` of one EP group: 16 x 48 x 8 x 128 int64 = 6.3 MB at the
Qwen3-30B-A3B size), once per RL step; metrics are O(layers) per micro-step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _device_capability

ReduceOp = dist.ReduceOp


def active(group: dist.ProcessGroup | None = None) -> bool:
    """Whether a collective over ``group`` would involve other ranks (else the helpers are identities)."""
    return dist.is_initialized() and (group is None or dist.get_world_size(group) > 1)


def host_capable(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` has a backend for CPU tensors (gloo, or the ``cpu:gloo`` half of a mixed group)."""
    return "cpu" in _device_capability(group)


def staging_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where host tensors go for a group without a CPU backend: its (current) accelerator device."""
    kinds = [k for k in _device_capability(group) if k != "cpu"]
    if not kinds:
        raise RuntimeError(f"process group {group} has no backend for any device")
    kind = kinds[0]
    module = getattr(torch, kind, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else None
    return torch.device(kind, index) if isinstance(index, int) else torch.device(kind)


def _stage(t: torch.Tensor, group) -> tuple[torch.Tensor, bool]:
    """The tensor to hand to ``group`` and whether it was staged off the host."""
    if t.device.type != "cpu" or host_capable(group):
        return t, False
    return t.to(staging_device(group), copy=True), True


def _in_place(t: torch.Tensor, group, collective) -> torch.Tensor:
    """Run an in-place ``collective(buffer)`` on ``t`` (staged off the host if the group needs it); ``t``."""
    if not active(group):
        return t
    buf, staged = _stage(t, group)
    collective(buf)
    if staged:
        t.copy_(buf)
    return t


def all_reduce(t: torch.Tensor, op=ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place all-reduce of ``t`` (returned); a host tensor never reaches a CPU-less backend."""
    return _in_place(t, group, lambda buf: dist.all_reduce(buf, op=op, group=group))


def all_gather(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``[group size, *t.shape]``: every rank's ``t``, in group-rank order."""
    if not active(group):
        return t[None].clone()
    buf, staged = _stage(t.reshape(-1), group)
    n = dist.get_world_size(group)
    out = buf.new_empty(n * t.numel())
    dist.all_gather_into_tensor(out, buf, group=group)
    out = out.view(n, *t.shape)
    return out.to(t.device) if staged else out


def all_to_all(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``out[s] = `` peer s's ``t[this rank]``: ``t`` is ``[group size, ...]``, one equal block per peer."""
    if not active(group):
        return t.clone()
    buf, staged = _stage(t.contiguous(), group)
    out = torch.empty_like(buf)
    dist.all_to_all_single(out, buf, group=group)
    return out.to(t.device) if staged else out


def broadcast(t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place broadcast from global rank ``src`` (returned)."""
    return _in_place(t, group, lambda buf: dist.broadcast(buf, src=src, group=group))


def any_true(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Logical OR of ``flag`` over the group (lockstep loops: keep going while any rank has work)."""
    t = torch.tensor([int(flag)], dtype=torch.int64)
    return bool(all_reduce(t, ReduceOp.MAX, group).item())


def broadcast_object(obj, src: int = 0, group: dist.ProcessGroup | None = None):
    """``obj`` of global rank ``src`` on every rank (pickled; torch stages it on the backend's device)."""
    if not active(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_objects(obj, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's ``obj`` (pickled), in group-rank order; ``[obj]`` without other ranks."""
    if not active(group):
        return [obj]
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


def all_to_all_objects(objs: list, group: dist.ProcessGroup | None = None) -> list:
    """``out[s]`` = peer s's ``objs[this rank]`` (pickled): uneven host payloads, one per peer.

    Two collectives: an all-to-all of the byte counts, then one uneven ``all_to_all_single`` of the bytes, so each
    rank sends and receives only its own payloads (no rank sees another pair's bytes)."""
    import pickle

    if not active(group):
        return list(objs)
    n = dist.get_world_size(group)
    if len(objs) != n:
        raise ValueError(f"all_to_all_objects: {len(objs)} payloads for a group of {n} ranks")
    blobs = [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in objs]
    send_sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
    recv_sizes = all_to_all(send_sizes[:, None], group)[:, 0]
    send = torch.frombuffer(bytearray(b"".join(blobs)) or bytearray(1), dtype=torch.uint8)[: int(send_sizes.sum())]
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    sbuf, staged = _stage(send, group)
    rbuf = recv.to(sbuf.device) if staged else recv
    dist.all_to_all_single(rbuf, sbuf, recv_sizes.tolist(), send_sizes.tolist(), group=group)
    data = (rbuf.cpu() if staged else rbuf).numpy().tobytes()
    out, at = [], 0
    for size in recv_sizes.tolist():
        out.append(pickle.loads(data[at : at + size]))
        at += size
    return out


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Every rank of ``group`` reached this point (no tensor of ours is handed over)."""
    if active(group):
        dist.barrier(group=group)
