"""One RL step's wall time from its branches: synchronous (``[rl] max_staleness = 0``) or one-step off-policy (1).

Synchronous: rollout, then the weight sync, then the trainer's stages (recompute, update, optimizer), in turn.

One-step off-policy: the engine generates step N+1's rollouts while the trainer trains step N; after each
optimizer pass the trainer broadcasts its weights to the engine. Steady state per step:
* **disaggregated** (engines on their own GPUs, ``rollout_gpus > 0``): the two branches run on different GPUs,
  so the step is ``max(rollout, train) + weight sync`` (the broadcast occupies both pools: the trainer sends,
  the engine must hold its weights still while it receives);
* **colocated** (engine and trainer time-share the same GPUs, ``rollout_gpus = 0``): decode is HBM-bound and
  the trainer's GEMMs are compute- and HBM-bound on the same SMs and memory, and the engine's weights, KV cache
  and the trainer's activations must fit together; we model no device-side overlap (a time-shared GPU runs the
  two branches one after the other), so the step equals the synchronous one. What colocated async does overlap
  is host-side (reward scoring, tokenization, the next batch's data), which the simulator does not charge.
A deeper staleness (> 1) only buffers more rollouts: the same steady state here (no per-step variance modelled),
so it is refused rather than silently equal.
"""

from __future__ import annotations

from dataclasses import dataclass

STALENESS = (0, 1)


@dataclass(frozen=True)
class StepBranches:
    """Wall times (ms) of one RL step's parts."""

    rollout_ms: float
    weight_sync_ms: float
    train_ms: float


def rl_step_ms(b: StepBranches, max_staleness: int, disaggregated: bool) -> dict:
    """{"step_ms" (at max_staleness), "step_ms_sync", "step_ms_async", "overlap_ms" (sync - async),
    "longer_branch" ("rollout" | "train": the branch that sets the async step)}."""
    if max_staleness not in STALENESS:
        raise ValueError(f"max_staleness {max_staleness} not modelled: 0 (synchronous) or 1 (one-step off-policy)")
    if min(b.rollout_ms, b.weight_sync_ms, b.train_ms) < 0:
        raise ValueError(f"negative branch time in {b}")
    sync = b.rollout_ms + b.weight_sync_ms + b.train_ms
    asyn = max(b.rollout_ms, b.train_ms) + b.weight_sync_ms if disaggregated else sync
    return {"step_ms": asyn if max_staleness else sync, "step_ms_sync": sync, "step_ms_async": asyn,
            "overlap_ms": sync - asyn, "longer_branch": "rollout" if b.rollout_ms >= b.train_ms else "train"}
