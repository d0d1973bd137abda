"""Exposed-transfer metrics on a mocked CUDA backend: they come from events on the compute stream around the
wait (which returns at once on NCCL), queried between micro-steps and waited for once per optimizer step."""

from __future__ import annotations

import numpy as np
import torch

from titan_foremoe.distributed import device as dev
from titan_foremoe.transfer.engine import TransferEngine, _Pending

MS_PER_RECORD = 250.0  # the fake device clock advances this much between two recorded events


class _Cuda(dev.Plain):
    """A device backend whose events log every call in order, on a fake device clock."""

    name = "fake-cuda"

    def __init__(self):
        self.log, self.clock = [], 0.0
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self, stream=None):
                cuda.log.append(("record", stream))
                self.t = cuda.clock
                cuda.clock += MS_PER_RECORD

            def query(self):
                cuda.log.append(("query", None))
                return False  # still running: resolved at the optimizer step

            def synchronize(self):
                cuda.log.append(("synchronize", None))

            def elapsed_ms(self, end):
                return end.t - self.t

        self.Event = Event

    def event(self, enable_timing=False):
        return self.Event(enable_timing)

    def current_stream(self, device=None):
        return "compute"


class _Work:
    def __init__(self, log):
        self.log = log

    def wait(self):
        self.log.append(("wait", None))  # NCCL: returns at once, the stream waits


def test_exposed_and_direct_seconds_come_from_compute_stream_events():
    cuda = _Cuda()
    old = dev.set_backend(cuda)
    try:
        engine = TransferEngine(None, 0, 1, np.zeros(1, dtype=np.int64))
        owned = tuple(torch.zeros(2, *s) for s in ((4, 8), (8, 4), (4, 8)))
        lb = engine.banks(0, owned, 1, torch.float32)
        issued = engine._exposed.mark(lb.device)  # the prefetch's issue point: clock 0
        cuda.clock += 3 * MS_PER_RECORD  # layers run in between
        lb.pending = _Pending([_Work(cuda.log)], 1, 0, issued)  # one row received (straight into the bank)
        cuda.log.clear()
        engine.wait(0)
        # an event before and after the wait on the compute stream; nothing waits for the device inside the layer
        assert [c for c, _ in cuda.log] == ["record", "wait", "record"]
        assert {s for c, s in cuda.log if c == "record"} == {"compute"}
        assert lb.pending is None  # landed: the all-to-all wrote into the bank, the wait copies nothing
        stats = engine.take_stats()  # between micro-steps: events queried, never waited for
        assert "synchronize" not in [c for c, _ in cuda.log] and stats.exposed_s == 0.0
        stats = engine.take_stats(drain=True)  # once per optimizer step
        assert [c for c, _ in cuda.log].count("synchronize") == 2
        assert stats.exposed_s == MS_PER_RECORD / 1e3  # from the events, not from the host clock (~0 here)
        assert stats.seconds_by_path["direct"] == 5 * MS_PER_RECORD / 1e3  # issue mark -> arrival
        assert engine.take_stats(drain=True).exposed_s == 0.0  # taken once
    finally:
        dev.set_backend(old)
