"""Per-EP-group work of one RL iteration: expert loads and attention sizes per micro-step.

Schedule: a rollout of ``updates_per_rollout x global_batch`` responses; each optimizer
step's ``global_batch`` responses are dealt to the D = gpus / ep EP groups, each group
running micro-steps of ``responses_per_microstep`` (one EP group's micro-batch, split
evenly over its ep source ranks). With one group this is exactly
``planner.trace.schedule_responses`` (the bench_planner schedule). A trace with fewer
responses than the rollout needs is cycled through further seeded permutations.

Shapes: G groups, M micro-steps per stage (per group), L MoE layers, S source ranks, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..planner.synthetic import MODEL_SHAPES, synthetic_loads
from ..planner.trace import load_trace, loads_from_trace
from ..schedule.merge import merged_sums


@dataclass(frozen=True)
class RLSchedule:
    global_batch: int  # responses per optimizer step, whole cluster
    responses_per_microstep: int  # per EP group
    updates_per_rollout: int  # optimizer steps per rollout (update stage)

    def micro_steps_per_step(self, groups: int) -> int:
        per_group = self.global_batch // groups
        if self.global_batch % groups or per_group % self.responses_per_microstep or per_group == 0:
            raise ValueError(
                f"global batch {self.global_batch} does not split into {groups} EP groups x micro-steps of "
                f"{self.responses_per_microstep} responses (need a multiple of {groups * self.responses_per_microstep})")
        return per_group // self.responses_per_microstep


@dataclass
class GroupWork:
    """One EP group's stage input (recompute and update replay the same micro-steps)."""

    loads_MLSE: np.ndarray
    tokens_MS: np.ndarray  # tokens per source rank per micro-step
    pairs_MS: np.ndarray  # causal query-key pairs per source rank per micro-step (attention)
    response_lens: np.ndarray | None = None  # generated tokens of each of the group's responses (rollout)
    # real (packed) tokens and pairs where tokens_MS / pairs_MS charge padded positions (sequences.py); None: the same
    real_tokens_MS: np.ndarray | None = None
    real_pairs_MS: np.ndarray | None = None


def _responses(n: int, needed: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = [rng.permutation(n)]
    while sum(len(x) for x in out) < needed:
        out.append(rng.permutation(n))
    return np.concatenate(out)[:needed]


def trace_work(path: str, ep: int, groups: int, sched: RLSchedule, seed: int, num_experts: int | None = None
               ) -> tuple[list[GroupWork], int]:
    """(work per group, number of experts padded to a multiple of ep)."""
    experts, offsets, E = load_trace(path, num_experts)
    if E % ep:
        E = -(-E // ep) * ep  # never-used experts pad E to divide over the EP ranks (as bench_planner)
    mps = sched.micro_steps_per_step(groups)
    B, U = sched.responses_per_microstep, sched.updates_per_rollout
    if B % ep:
        raise ValueError(f"responses per micro-step ({B}) must be a multiple of ep ({ep})")
    resp = _responses(len(offsets) - 1, U * sched.global_batch, seed).reshape(U, groups, mps, B)
    lens = np.diff(offsets)
    work = []
    for g in range(groups):
        r_MB = resp[:, g].reshape(U * mps, B)
        loads = loads_from_trace(experts, offsets, r_MB, ep, E)
        n_MSb = lens[r_MB].reshape(U * mps, ep, B // ep).astype(np.float64)
        work.append(GroupWork(loads, n_MSb.sum(axis=2), (n_MSb * (n_MSb + 1) / 2).sum(axis=2), lens[r_MB].ravel()))
    return work, E


def synthetic_work(model: str, ep: int, groups: int, sched: RLSchedule, seed: int, skew: float = 0.8
                   ) -> tuple[list[GroupWork], int]:
    """Synthetic skewed loads (planner.synthetic, lognormal sigma ``skew``) per group; responses share a source's
    tokens evenly."""
    shp = MODEL_SHAPES[model]
    mps = sched.micro_steps_per_step(groups)
    B = sched.responses_per_microstep
    if B % ep:
        raise ValueError(f"responses per micro-step ({B}) must be a multiple of ep ({ep})")
    M, per_src = sched.updates_per_rollout * mps, B // ep
    work = []
    for g in range(groups):
        loads = synthetic_loads(model, M, ep, per_src, seed + 1000 * g, skew)
        tokens = loads[:, 0].sum(axis=2) / shp.top_k
        n = tokens / per_src
        work.append(GroupWork(loads, tokens.astype(np.float64), per_src * n * (n + 1) / 2, np.repeat(n.ravel(), per_src)))
    return work, shp.num_experts


def merged_work(w: GroupWork, k: int) -> GroupWork:
    """The recompute's work with ``[rl] recompute_merge`` k: the runtime's groups of micro-steps
    (``schedule.merge``), their expert loads, tokens and causal pairs summed (packed rows: a merged row's attention
    pairs are its sequences')."""
    if k == 1:
        return w
    loads, tokens, pairs, real_tokens, real_pairs = (
        None if x is None else merged_sums(x, k)
        for x in (w.loads_MLSE, w.tokens_MS, w.pairs_MS, w.real_tokens_MS, w.real_pairs_MS))
    return GroupWork(loads, tokens, pairs, w.response_lens, real_tokens, real_pairs)
