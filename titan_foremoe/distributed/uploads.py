"""Host data to the device: the one place that uploads, counting calls and bytes.

As ``collectives.py`` is the one place for host collectives, every host array the runtime path needs
on the device (plan tables, token-mask indices, a micro-batch's ids and routes) goes through ``upload``:
many arrays packed into ONE pinned host buffer (``device.host_empty``), ONE non-blocking copy, and
device views returned by name. On CUDA the copy is stream-ordered on the current stream, so nothing
waits for it on the host; the caching host allocator keeps the pinned buffer alive until the copy has
run. Uploading a stage's tables once ahead of use is what lets a MoE layer run without host syncs.

Cost: one host packing pass over the bytes (memcpy) and one H2D copy per call; ``STATS`` counts both.
Observers (``observe``) see each call's byte count (``benchmarks/count_host_syncs.py`` records call sites).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from . import device as dev

_ALIGN = 8  # every view starts at a multiple of the widest element size (int64/float64)


@dataclass
class UploadStats:
    calls: int = 0
    bytes: int = 0


STATS = UploadStats()
_observers: list[Callable[[int], None]] = []


def observe(fn: Callable[[int], None]) -> Callable[[], None]:
    """Call ``fn(nbytes)`` on every upload; returns the function that stops it."""
    _observers.append(fn)
    return lambda: _observers.remove(fn)


def _host(a) -> torch.Tensor:
    """A contiguous CPU tensor of ``a`` (numpy array, list or CPU tensor), no copy where possible."""
    if isinstance(a, torch.Tensor):
        if dev.backend().is_device_tensor(a):
            raise ValueError(f"upload takes host data, got a tensor on {a.device}")
        return a.contiguous()
    a = np.ascontiguousarray(a)
    return torch.from_numpy(a if a.dtype != np.uint64 else a.astype(np.int64))


def upload(arrays: Mapping[str, object], device: torch.device | str) -> dict[str, torch.Tensor]:
    """``{name: device tensor}`` of host ``arrays`` (any dtypes and shapes), in one packed non-blocking copy."""
    device = torch.device(device)
    hosts = {k: _host(a) for k, a in arrays.items()}
    offsets, total = {}, 0
    for k, t in hosts.items():
        offsets[k] = total
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    buf = dev.host_empty(total, torch.uint8, pinned=True)
    for k, t in hosts.items():
        n = t.numel() * t.element_size()
        if n:
            buf[offsets[k]:offsets[k] + n].copy_(t.reshape(-1).view(torch.uint8))
    on_device = dev.to_device(buf, device)  # stream-ordered on the current stream; no host wait
    STATS.calls += 1
    STATS.bytes += total
    for fn in _observers:
        fn(total)
    out = {}
    for k, t in hosts.items():
        n = t.numel() * t.element_size()
        out[k] = on_device[offsets[k]:offsets[k] + n].view(t.dtype).view(t.shape)
    return out


def upload_one(a, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One host array on the device (prefer ``upload`` of many at once); cast to ``dtype`` on the host."""
    t = _host(a)
    return upload({"a": t if dtype is None else t.to(dtype)}, device)["a"]
