"""``memory/<stage>_max_allocated_gib``: the allocator's peak reset per RL stage (a faked ``torch.cuda`` memory API)."""

from __future__ import annotations

import torch

from titan_foremoe.metrics.stage_memory import StageMemory


class FakeAllocator:
    """``max_memory_allocated`` / ``reset_peak_memory_stats`` over a scripted allocation trace."""

    def __init__(self):
        self.now = self.peak = 0

    def alloc(self, gib: float):
        self.now += int(gib * 2**30)
        self.peak = max(self.peak, self.now)

    def free(self, gib: float):
        self.now -= int(gib * 2**30)

    def max_memory_allocated(self, device=None):
        return self.peak

    def reset_peak_memory_stats(self, device=None):
        self.peak = self.now


def test_each_stage_reports_its_own_peak_and_the_process_peak_is_kept(monkeypatch):
    a = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", a.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", a.reset_peak_memory_stats)
    m = StageMemory(torch.device("cuda", 0))
    a.alloc(10)  # weights
    a.alloc(40), a.free(40)  # a load before the first step: the process peak, 50
    m.begin("rollout"); a.alloc(30); a.free(30); m.end("rollout")  # noqa: E702
    m.begin("recompute"); a.alloc(5); a.free(5); m.end("recompute")  # noqa: E702
    m.begin("update"); a.alloc(20); a.free(20); m.end("update")  # noqa: E702
    assert m.values() == [50.0, 40.0, 15.0, 30.0]
    assert m.metrics(m.values()) == {"memory/rollout_max_allocated_gib": 40.0,
                                     "memory/recompute_max_allocated_gib": 15.0,
                                     "memory/update_max_allocated_gib": 30.0}


def test_nothing_is_read_or_logged_off_cuda(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the CUDA allocator read on CPU")

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", boom)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", boom)
    m = StageMemory(torch.device("cpu"))
    m.begin("rollout"), m.end("rollout")
    assert m.metrics(m.values()) == {}
