"""Where a job's inference engines run and which trainer ranks feed each one its weights.

Two placements (verl / slime / NeMo-RL run both):

- **colocated**: the engines share the trainer's GPUs (vLLM's sleep mode frees them while the trainer runs).
  Engine k holds the ``gpus_per_engine`` consecutive GPUs ``[k * g, (k + 1) * g)`` of the job, so it lies inside
  one node (``g`` divides the node's GPUs); its **source** (the rank that launches it and posts its weights by
  CUDA IPC) is the first rank of its block, its **members** the ranks of its block (their GPUs hold its
  workers). ``engines = 0`` means one per ``g`` GPUs: one per node at ``g = n``.
- **disaggregated**: the engines run on GPUs of their own (nodes the trainer does not use, or processes the
  user runs at ``urls``). Engine k's slot names a source on a different trainer node where possible
  (``sync_cost.source_rank``: engines dealt round-robin over the trainer's nodes, then over each node's GPUs) and
  its members the other GPUs of that node (``sync_cost.group_ranks``): per-engine transfer groups, the cost
  model's ``per_engine`` row. The runtime's NCCL sync runs ``one_group`` instead:
  engine 0's source and its node's ranks, then every engine's workers, in one group (vLLM's ``rank_offset``).

Cost: O(K) to build, K = engines (<= R); every rank builds the same layout from the config, no collective.

Legend: R trainer ranks, n GPUs per node, g GPUs per engine, K engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..engines.sync_cost import group_ranks, source_rank


@dataclass(frozen=True)
class EngineSlot:
    """One engine of the fleet."""

    index: int
    gpus: int  # the engine's GPUs (its tensor / expert parallel workers)
    source_rank: int  # the trainer rank that sends it the weights (its transfer group's rank 0, or the IPC poster)
    members: tuple[int, ...]  # trainer ranks in its weight transfer, source first (relays, or the IPC node's GPUs)
    node: int = -1  # colocated: the trainer node it runs on; -1: GPUs of its own
    url: str = ""  # a user-run engine's address ("" : launched by the job)

    @property
    def launched(self) -> bool:
        return not self.url


@dataclass(frozen=True)
class EngineLayout:
    engines: tuple[EngineSlot, ...]
    colocated: bool
    trainer_gpus: int
    gpus_per_node: int

    @property
    def count(self) -> int:
        return len(self.engines)

    @property
    def engine_gpus(self) -> int:
        """GPUs the engines hold of their own (0 when colocated)."""
        return 0 if self.colocated else sum(e.gpus for e in self.engines)

    def launcher_rank(self, k: int) -> int:
        """The trainer rank that starts launched engine k: colocated, its source (on the engine's node);
        disaggregated, rank 0 (the engines' nodes run no trainer rank; on one machine they run beside it)."""
        return self.engines[k].source_rank if self.colocated else 0

    def sources(self) -> list[int]:
        return [e.source_rank for e in self.engines]

    def one_group(self) -> list[int]:
        """The trainer ranks of the fleet's ONE weight-transfer group (``one_group``: every engine's workers after
        them, ``engines/vllm_weights.PackedNCCLSender``): engine 0's source first, then the other ranks of its node
        (relays: the broadcast ring leaves the node on each of their NICs), as the one-engine path's group."""
        src, n = self.engines[0].source_rank, self.gpus_per_node
        first = src - src % n
        return [src] + [r for r in range(first, min(first + n, self.trainer_gpus)) if r != src]


class LayoutError(ValueError):
    """A fleet that cannot be laid out on the job (one line naming what is wrong)."""


def engine_layout(*, trainer_gpus: int, gpus_per_node: int, engines: int, gpus_per_engine: int, colocated: bool,
                  urls: Sequence[str] = ()) -> EngineLayout:
    """The fleet of the job (module docstring). ``urls`` non-empty: the user's engines, one slot each (their
    count wins over ``engines``). ``engines = 0``: colocated, one per ``gpus_per_engine`` GPUs of the job;
    disaggregated, one."""
    R, n, g = int(trainer_gpus), max(1, int(gpus_per_node)), int(gpus_per_engine)
    if R < 1:
        raise LayoutError(f"engine fleet: {R} trainer GPUs")
    if g < 1:
        raise LayoutError(f"[rollout_engine] gpus_per_engine = {g}: must be >= 1")
    if colocated:
        if urls:
            raise LayoutError("[rollout_engine] urls with colocated engines: colocated engines are launched by "
                              "the job on its own GPUs (drop urls, or run them on GPUs of their own)")
        if g > n or n % g:
            raise LayoutError(f"[rollout_engine] gpus_per_engine = {g} does not divide a node's {n} GPUs: a "
                              f"colocated engine must lie inside one node")
        if R % g:
            raise LayoutError(f"[rollout_engine] gpus_per_engine = {g} does not divide the job's {R} GPUs")
        K = engines or R // g
        if K * g > R:
            raise LayoutError(f"[rollout_engine] engines = {K} of {g} GPUs need {K * g} GPUs; the job has {R}")
        slots = tuple(EngineSlot(k, g, k * g, tuple(range(k * g, (k + 1) * g)), node=(k * g) // n)
                      for k in range(K))
        return EngineLayout(slots, True, R, n)
    K = len(urls) or max(1, engines)
    src_K = source_rank(np.arange(K), R, n)
    slots = tuple(EngineSlot(k, g, int(src_K[k]), tuple(group_ranks(k, R, n)), url=urls[k] if urls else "")
                  for k in range(K))
    return EngineLayout(slots, False, R, n)


def fleet_of(e, trainer_gpus: int, gpus_per_node: int) -> EngineLayout:
    """The fleet an engine config section (``[rollout_engine]`` / ``[sglang_engine]``) lays out: ``urls``, else
    ``url`` as a one-engine fleet, else ``engines`` launched."""
    return engine_layout(trainer_gpus=trainer_gpus, gpus_per_node=gpus_per_node, engines=e.engines,
                         gpus_per_engine=e.gpus_per_engine, colocated=e.colocated,
                         urls=list(e.urls) or ([e.url] if e.url else []))


def describe(layout: EngineLayout) -> str:
    """One line naming the fleet (the pre-flight's and the dry run's)."""
    where = "colocated" if layout.colocated else (
        "run by the user" if layout.engines and not layout.engines[0].launched else "launched, GPUs of their own")
    g = layout.engines[0].gpus if layout.engines else 0
    return f"{layout.count} engine(s) x {g} GPU(s) ({where}), weights from trainer ranks {layout.sources()}"

