"""CUDA IPC buffers allocated outside expandable segments, so another process can open them without pidfd_getfd.

The launcher runs the workers with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (``launch.allocator_env``).
torch shares a block of an expandable segment (``ExpandableSegment::share`` in ``c10/cuda/CUDACachingAllocator.cpp``,
torch 2.11-2.13) as POSIX file descriptors of its ``cuMemCreate`` handles plus the exporter's pid; the importer
(``fromShared``, run when the engine rebuilds the tensor) calls ``pidfd_open(pid)`` and ``pidfd_getfd`` for every
handle. ``pidfd_getfd`` needs ptrace-attach permission over the exporter (same user and Yama
``kernel.yama.ptrace_scope`` 0, or ``CAP_SYS_PTRACE``; container seccomp profiles often deny it): where it is
missing the engine fails the first weight sync with ``pidfd_getfd: Operation not permitted`` (``ENOSYS``: torch's
"The kernel on this machine does not support the pidfd_getfd syscall ..."). A block of a ``cudaMalloc`` segment
is shared with ``cudaIpcGetMemHandle`` instead, which needs no such permission. So the weight-sync buffer (one per
node rank, the largest bucket: hundreds of MB, made once per sync) is allocated with expandable segments off,
torch's own advice in that message; every other allocation keeps them.

Cost: two allocator-setting calls per sync (host only).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)
_said = False


def expandable_segments_on(env=os.environ) -> bool:
    """``expandable_segments:True`` in the allocator's configuration variable (torch reads either name)."""
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or ""
    return any(part.strip().replace(" ", "").lower() == "expandable_segments:true" for part in conf.split(","))


@contextmanager
def ipc_shareable(device: torch.device | None):
    """CUDA allocations inside come from ``cudaMalloc`` segments (expandable segments switched off and back on)."""
    global _said
    if device is None or device.type != "cuda" or not expandable_segments_on():
        yield
        return
    if not _said:
        logger.info("CUDA IPC weight-sync buffer allocated with expandable_segments:False (its importer would need "
                    "pidfd_getfd permission over this process otherwise)")
        _said = True
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
