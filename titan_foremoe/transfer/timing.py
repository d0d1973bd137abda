"""Exposed time that is true on CUDA: events on the compute stream around a wait, read once per micro-step.

On NCCL ``work.wait()`` returns at once (it only makes the current stream wait for the collective), so a host
timer around it reads ~0 however long the stream stalls. ``ExposedTimer`` records a CUDA event on the compute
stream before and after the wait instead: their elapsed time is how long the stream waited (plus the copies
inside the span). Events are only recorded in the layer; ``take`` resolves them (one ``synchronize`` per
event, all at the end of a micro-step or stage), never inside a layer. On CPU (gloo) the wait blocks the
host, so a host timer is the truth there. Cost on CUDA: two events per span (two spans per layer per
micro-step: ~200 events per micro-step at 48 layers, microseconds each to record), no host sync in the layers.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class ExposedTimer:
    """Sums spans of compute-stream time: CUDA events on GPU (resolved by ``take``), ``perf_counter`` on CPU."""

    def __init__(self):
        self._host_s = 0.0
        self._events: list = []  # (start, end) CUDA events on the compute stream

    @staticmethod
    def mark(device: torch.device):
        """A point on ``device``'s compute stream (a recorded CUDA event) or on the host clock (CPU)."""
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event
        return time.perf_counter()

    def since(self, start, device: torch.device):
        """Add the time from ``start`` (a ``mark``) to now on ``device``'s compute stream; returns now's mark."""
        end = self.mark(device)
        self.add(start, end)
        return end

    def add(self, start, end) -> None:
        """Add the time between two marks."""
        if isinstance(start, float):
            self._host_s += end - start
        else:
            self._events.append((start, end))

    @contextmanager
    def span(self, device: torch.device):
        start = self.mark(device)
        yield
        self.since(start, device)

    def take(self) -> float:
        """Seconds since the last ``take`` (waits for the recorded events: call once per micro-step or stage)."""
        total, self._host_s = self._host_s, 0.0
        events, self._events = self._events, []
        for start, end in events:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total
