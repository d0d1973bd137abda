"""Peak device memory of each RL stage (rollout, recompute, update): ``memory/<stage>_max_allocated_gib``.

``torch.cuda.max_memory_allocated`` is a peak since the last reset, so each stage resets it when it begins and
reads it when it ends; the process peak (``train/peak_memory_gib``) is kept here as the maximum of every reading,
including the one taken just before each reset. Off CUDA there is nothing to read: no metric is logged.

Cost: two calls into the caching allocator's counters per stage (host only, no sync, no collective); the
readings ride the step's existing all-reduce of the peak.
"""

from __future__ import annotations

import torch

STAGES = ("rollout", "recompute", "update")


class StageMemory:
    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = device.type == "cuda"
        self.peak_gib = 0.0  # the process peak over every reading
        self.gib: dict[str, float] = {}

    def _read(self) -> float:
        gib = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.peak_gib = max(self.peak_gib, gib)
        return gib

    def begin(self, stage: str) -> None:
        if self.enabled:
            self._read()  # the peak so far is kept before the counter restarts
            torch.cuda.reset_peak_memory_stats(self.device)

    def end(self, stage: str) -> None:
        if self.enabled:
            self.gib[stage] = self._read()

    def values(self) -> list[float]:
        """``[process peak, rollout, recompute, update]`` in GiB (0 where a stage did not run this step)."""
        return [self.peak_gib, *(self.gib.get(s, 0.0) for s in STAGES)]

    def metrics(self, values: list[float]) -> dict[str, float]:
        """The stages' TensorBoard scalars from ``values`` (all-reduced with MAX over ranks); empty off CUDA."""
        if not self.enabled:
            return {}
        return {f"memory/{s}_max_allocated_gib": v for s, v in zip(STAGES, values[1:])}
