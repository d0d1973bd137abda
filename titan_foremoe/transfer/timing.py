"""Exposed time that is true on CUDA: events on the compute stream around a wait, resolved without draining.

On NCCL ``work.wait()`` returns at once (it only makes the current stream wait for the collective), so a host
timer around it reads ~0 however long the stream stalls. ``ExposedTimer`` records an event on the compute
stream before and after the wait instead (``distributed/device.py``: CUDA events on GPU, host clocks on
CPU, where gloo's wait blocks the host): their elapsed time is how long the stream waited (plus the copies
inside the span). Events are only recorded in the layer; ``take`` adds the spans whose end event has
completed (``query``, no sync) and keeps the others for a later ``take``; ``take(drain=True)`` (once per
optimizer step) waits for the rest. Cost on CUDA: two events per span (two spans per layer per micro-step:
~200 events per micro-step at 48 layers, microseconds each to record), no host sync in the layers or between
micro-steps.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..distributed import device as dev


class ExposedTimer:
    """Sums spans of compute-stream time between events (``device.event``), resolved by ``take``."""

    def __init__(self):
        self._events: list = []  # (start, end) events on the compute stream

    @staticmethod
    def mark(device: torch.device | None = None):
        """A point on the current (compute) stream: a recorded timing event."""
        event = dev.event(enable_timing=True)
        event.record(dev.current_stream(device))
        return event

    def since(self, start, device: torch.device | None = None):
        """Add the time from ``start`` (a ``mark``) to now on the compute stream; returns now's mark."""
        end = self.mark(device)
        self.add(start, end)
        return end

    def add(self, start, end) -> None:
        """Add the time between two marks."""
        self._events.append((start, end))

    @contextmanager
    def span(self, device: torch.device | None = None):
        start = self.mark(device)
        yield
        self.since(start, device)

    def take(self, drain: bool = False) -> float:
        """Seconds of the spans completed since the last ``take`` (``drain``: waits for all: once per step)."""
        total, left = 0.0, []
        for start, end in self._events:
            if drain:
                end.synchronize()
            elif not end.query():
                left.append((start, end))
                continue
            total += start.elapsed_ms(end) / 1e3
        self._events = left
        return total
