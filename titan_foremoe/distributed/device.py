"""Streams, events, pinned buffers, device moves and host reads: the one module the runtime calls.

Why: on CPU every ``device.type == "cuda"`` branch used to be skipped, so CI ran another program than a GPU
would. Now the runtime makes the same calls on every device and a *backend* decides what they do:

* ``cuda``: torch's own objects (``torch.cuda.Stream``, ``Event``, ``Tensor.record_stream``, pinned memory).
* ``plain`` (CPU default): one stream, events are host clocks, moves are copies on the host.
* ``checked`` (CPU, ``[debug] check_streams = true``; ``checked.py``): the same calls, in the same order, on
  emulated streams and events, fed to torch's CUDA sanitizer analysis by a dispatch mode that tags every
  aten op and collective with the emulated current stream; frees of tensors another stream may still use
  without ``record_stream`` are reported; inside ``strict`` regions any host read of a device tensor raises.

Names follow torch: ``Stream.wait_stream``, ``Stream.wait_event``, ``Event.record``, ``record_stream``.
Cost (cuda, plain): one Python call per use, no extra device work. Host syncs made through this module:
``to_host``, ``Event.synchronize``, ``synchronize``; each is counted by the checked backend.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch


class _PlainStream:
    """The single stream of a host-only run: waits are no-ops (everything runs in program order)."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _PlainEvent:
    """A host clock reading: on CPU the work before ``record`` is done when it returns."""

    def __init__(self, enable_timing: bool = False):
        self.t = None

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_ms(self, end: "_PlainEvent") -> float:
        return (end.t - self.t) * 1e3


class Plain:
    """CPU without checks: what the code did before on CPU, through the same calls."""

    name = "plain"
    host_is_device = True  # the job's device is the host: a receive may land in device memory directly
    _STREAM = _PlainStream()

    def current_stream(self, device=None):
        return self._STREAM

    def new_stream(self, device=None):
        return self._STREAM

    def use_stream(self, stream):
        return nullcontext()

    def event(self, enable_timing: bool = False):
        return _PlainEvent(enable_timing)

    def record_stream(self, t: torch.Tensor, stream) -> None:
        pass

    def host_empty(self, shape, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` (a host tensor) on the device: non-blocking from pinned memory on CUDA; ``t`` itself when the
        device is the host (callers hand over a buffer they no longer write)."""
        return t.to(device, non_blocking=True)

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives on the device rather than the host (on this backend: not on the CPU)."""
        return t.device.type != "cpu"

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of device tensor ``t``: a host sync on CUDA (the one way the runtime reads the device)."""
        return t.detach().clone() if t.device.type == "cpu" else t.detach().cpu()

    def synchronize(self, device=None) -> None:
        pass

    @contextmanager
    def strict(self, where: str):
        yield

    @contextmanager
    def host_code(self):
        yield

    @contextmanager
    def expected_sync(self, reason: str):
        yield


class Cuda(Plain):
    """torch's CUDA objects."""

    name = "cuda"
    host_is_device = False

    def current_stream(self, device=None):
        return torch.cuda.current_stream(device)

    def new_stream(self, device=None):
        return torch.cuda.Stream(device=device)

    def use_stream(self, stream):
        return torch.cuda.stream(stream)

    def event(self, enable_timing: bool = False):
        return _CudaEvent(enable_timing)

    def record_stream(self, t: torch.Tensor, stream) -> None:
        t.record_stream(stream)

    def host_empty(self, shape, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=pinned)

    def synchronize(self, device=None) -> None:
        torch.cuda.synchronize(device)


class _CudaEvent(torch.cuda.Event if hasattr(torch.cuda, "Event") else object):
    def elapsed_ms(self, end) -> float:
        return self.elapsed_time(end)


_BACKEND: Plain = Plain()


def backend() -> Plain:
    return _BACKEND


def set_backend(b: Plain) -> Plain:
    """Install ``b``; returns the one it replaces."""
    global _BACKEND
    old, _BACKEND = _BACKEND, b
    return old


def for_device(device: torch.device, check_streams: bool = False) -> Plain:
    """The backend a job on ``device`` runs with: torch's on CUDA, checked or plain on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        if check_streams:
            raise ValueError("[debug] check_streams emulates CUDA on CPU; on a GPU use torch's own sanitizer "
                             "(TORCH_CUDA_SANITIZER=1) and torch.cuda.set_sync_debug_mode")
        return Cuda()
    if check_streams:
        from .checked import Checked

        return Checked()
    return Plain()


# -- the calls the runtime makes (delegating to the installed backend) -------------------------------------
def current_stream(device=None):
    return _BACKEND.current_stream(device)


def new_stream(device=None):
    return _BACKEND.new_stream(device)


def use_stream(stream):
    return _BACKEND.use_stream(stream)


def event(enable_timing: bool = False):
    return _BACKEND.event(enable_timing)


def record_stream(t: torch.Tensor, stream) -> None:
    _BACKEND.record_stream(t, stream)


def host_empty(shape, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
    return _BACKEND.host_empty(shape, dtype, pinned)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    return _BACKEND.to_device(t, device)


def to_host(t: torch.Tensor) -> torch.Tensor:
    return _BACKEND.to_host(t)


def synchronize(device=None) -> None:
    _BACKEND.synchronize(device)


def strict(where: str):
    """Inside: no host read of a device tensor (checked backend: raises naming the call site)."""
    return _BACKEND.strict(where)


def expected_sync(reason: str):
    """Inside: host syncs that are this code's documented cost (torchtitan's dispatcher reading its split
    sizes, the reactive balancer reading its counts) are counted under ``reason`` and allowed in ``strict``."""
    return _BACKEND.expected_sync(reason)


def host_code():
    """Inside: tensors created from nothing (``torch.zeros``, ``arange``...) are host tensors (checked backend)."""
    return _BACKEND.host_code()
