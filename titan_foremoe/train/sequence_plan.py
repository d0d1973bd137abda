"""The trainer's sequence schedule: every sequence of an RL step on a (rank, micro-step), before the stages start.

Right after the rollout (advantages known, before foresight loads are gathered and planned), every rank
all-gathers the step's sequence lengths (8 B per sequence) and, when the balanced schedule uses them, each
sequence's expert signature (its token-expert counts summed over layers, E x 4 B per sequence; the per-layer counts are taken once per row,
``loads.row_loads``, and also give the foresight loads); it then computes
the same schedule (``schedule.schedule_sequences``, a pure function of those: resume stays exact) and the rows
whose rank changes travel once (``schedule.exchange``). Mini-batches keep their sequences (mini-batch u is the
rows ``[u P, (u + 1) P)`` of every rank, as in rollout order) and the loss normalizers are counted over all ranks,
so the gradient does not depend on where a sequence lands.

Cost at the real size (host, per RL step, off the stages' critical path; with ``max_staleness >= 1`` a step
ahead): N = 512-4096 sequences at R = 64 / 256 / 1024: the all-gather of lengths (N x 8 B) and signatures
(N x E x 4 B = 2 MB at N = 4096, E = 128) to every rank, the schedule itself (docs/schedule.md), one exchange of
the moved rows (each rank its own). No device work, no collective per micro-step: every rank agrees on the
micro-steps per stage from the schedule.

Legend: N sequences of the step (all ranks), B rows this rank holds, E experts, U mini-batches, M micro-steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..distributed import collectives
from ..loads import row_loads
from ..rollouts.generate import Rollout
from ..schedule import DenseCost, schedule_sequences
from ..schedule.exchange import LocalRows, exchange_rows
from ..simulator.models import ModelSpec
from ..simulator.sequences import flops_cost


def dense_cost(args) -> DenseCost:
    """The dense cost of a sequence of the model ``args`` (``MoEModelArgs``) as the simulator charges it
    (``simulator.sequences.flops_cost``): per position the layers' dense FLOPs (attention projections, router,
    shared expert), the routed experts' ``top_k x expert FLOPs`` (a group's expert work follows its tokens) and
    the output head, per causal query-key pair the attention core; FLOPs compare directly across the terms."""
    return flops_cost(ModelSpec("trainer", dim=args.dim, moe_hidden=args.moe_hidden_dim, num_experts=args.num_experts,
                                top_k=args.top_k, moe_layers=args.n_layers,
                                shared_hidden=args.shared_expert_hidden_dim, vocab=args.vocab_size,
                                n_heads=args.n_heads, n_kv_heads=args.n_kv_heads, head_dim=args.head_dim))


def positions_per_micro_step(cfg) -> int:
    """The most positions one rank computes in one RL micro-step: the token budget
    (``[training] max_tokens_per_micro_step``, which needs packed rows), else ``local_batch_size x seq_len``
    (a micro-step of today's row count, padded to ``seq_len`` at worst). What bounds the activations."""
    t = cfg.training
    return t.max_tokens_per_micro_step or t.local_batch_size * t.seq_len


@dataclass
class ScheduledStep:
    """This rank's rows of a step and its micro-steps: ``plan[u][m]`` lists local rows of ``rows.rollout``."""

    rows: LocalRows
    plan: list[list[list[int]]]
    micro_steps: int  # per mini-batch, the same on every rank
    metrics: dict[str, float]
    moved_fraction: float  # sequences whose rank changed


class SequencePlanner:
    """``[rl] sequence_schedule`` and ``[training] max_tokens_per_micro_step`` for one job."""

    def __init__(self, cfg, resolved, model_args, rank: int):
        self.policy = cfg.rl.sequence_schedule
        self.budget = cfg.training.max_tokens_per_micro_step or None
        self.rows_per_micro = cfg.training.local_batch_size
        self.micro_steps = resolved.micro_steps
        self.updates = cfg.rl.updates_per_rollout
        self.ep = resolved.ep
        self.cost = dense_cost(model_args)
        self.rank = rank

    def plan(self, rollout: Rollout, advantages_B: torch.Tensor, trained_B: torch.Tensor | None,
             signatures: bool = True) -> ScheduledStep:
        """Collective over every rank: the step's schedule and this rank's rows. ``signatures``: the routes are
        complete (no holes): each row's expert counts are taken now (``loads.row_loads``, whose sums over layers the
        balanced schedule spreads and whose sums over rows are the micro-steps' foresight loads)."""
        B = int(rollout.lengths_B.shape[0])
        if B % self.updates:
            raise ValueError(f"{B} rows on rank {self.rank} do not split into {self.updates} mini-batches "
                             "([rl] updates_per_rollout)")
        tokens_B = (rollout.lengths_B - 1).clamp_min(0).numpy().astype(np.int64)
        loads_BLE = row_loads(rollout.routes) if signatures else None  # counted once: foresight sums rows of it
        use_sig = signatures and self.policy == "balanced"
        mine = (tokens_B, loads_BLE.sum(1).numpy() if use_sig else None)
        every = collectives.all_gather_objects(mine)
        counts_R = np.array([len(t) for t, _ in every], dtype=np.int64)
        offsets_R = np.concatenate([[0], np.cumsum(counts_R)])
        tokens_N = np.concatenate([t for t, _ in every])
        source_N = np.repeat(np.arange(len(every)), counts_R)
        local_N = np.arange(len(tokens_N)) - offsets_R[source_N]  # row index on its source rank
        minibatch_N = local_N // (counts_R[source_N] // self.updates)
        loads_NE = np.concatenate([s for _, s in every]) if use_sig else None
        sched = schedule_sequences(
            tokens_N, minibatch_N, source_N, ranks=len(every), policy=self.policy,
            rows_per_micro=None if self.budget or self.policy == "balanced" else self.rows_per_micro,
            micro_steps=None if self.budget or self.policy == "rollout_order" else self.micro_steps,
            max_tokens=self.budget, cost=self.cost, loads_NE=loads_NE, ep=self.ep,
        )
        dest_N = np.asarray(sched.rank_N)
        moved = dest_N != source_N
        ids_B = np.arange(offsets_R[self.rank], offsets_R[self.rank + 1])
        if not moved.any():  # rollout order (or a schedule that moves nothing): the rows stay as they are
            rows = LocalRows(rollout, advantages_B, trained_B, ids_B, loads_BLE)
        else:
            rows = exchange_rows(rollout, advantages_B, trained_B, ids_B, dest_N[ids_B], loads_BLE=loads_BLE)
        plan = [[rows.local(seqs) for seqs in update] for update in sched.rows(self.rank)]
        metrics = {f"schedule/{k}": float(v) for k, v in sched.metrics(tokens_N, self.cost).items()}
        return ScheduledStep(rows, plan, int(sched.micro_steps), metrics, float(moved.mean()))
