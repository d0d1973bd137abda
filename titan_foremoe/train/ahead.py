"""Plans from the stream: with ``[rl] max_staleness`` > 0 the next step's rollout is made ready to train (rewards
checked, advantages, sequence schedule, micro-batches, foresight loads, placement plans: ``prepare_step``) at the
first point of the current step where its rows are complete on every rank, not only after the update stage.

Points of step N (every rank passes each, in this order; ``foresight/prepared_at``):

- 0 .. U - 1 (``[rl] plan_from_stream``): 0 after the recompute stage, u after update mini-batch u (U mini-batches:
  ``updates_per_rollout``); at each a non-blocking collective poll (``source.poll(N + 1, wait=False)``: None while
  any rank's rows of step N + 1 are still generated; with ``take_first_finished``, while any rank has too few
  finished groups), and step N + 1 is prepared at the first that finds them complete;
- U, after the update stage: the blocking poll (``wait=True``), as without ``plan_from_stream``: the fallback.

Why the losses are the same whichever point prepares: the schedule and the micro-batches are pure functions of the
rows and the config (``sequence_plan.py``), the rewards and advantages of the rows alone, the foresight loads of the
rows' routes; the placement plans say only where each expert's rows run, and ``eplb_history`` plans from step N's
loads, set when step N starts. Not so balanced owners (``[balance] owner_policy = "balanced"``): their plan starts
from the owners in effect after step N's last optimizer step (the layout moves between optimizer steps), so
``plan_from_stream`` is refused with them (``config/validate_rl.py``). The foresight metrics are logged at step N + 1's
micro-steps whatever the point (``first_micro``).

Cost at R = 64 / 256 / 1024 ranks: per early point one collective of the poll (an 8-byte flag all-reduce; with
``take_first_finished`` one of (k + 4) floats), at most U per step, none per micro-step; once ready, the preparation
itself is the same work as at point U (one sequence exchange, the foresight all-gather over the EP group, the plans
in the planner's worker), now overlapping step N's remaining update instead of following it; its collectives run
between mini-batches, where ``RLTrainer.update`` runs its own. Memory: step N + 1's host micro-batches and plans
beside step N's (~0.8 GB per rank at 32 rows of 8k tokens, docs/rl.md) for up to the update stage's length longer.

Legend: U update mini-batches per step, k ``max_staleness``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..distributed import device as dev
from ..rl.dapo import shaped_rewards_N, uniform_groups_N
from ..rl.grpo import group_advantages
from ..rollouts.sources.base import settle
from ..schedule.merge import merged_cells, merged_sums
from .rl_batches import build_micro_batch

if TYPE_CHECKING:
    from .rl_trainer import RLTrainer


@dataclass
class PreparedStep:
    """A step's rollout made ready to train (``prepare_step``): everything before its recompute stage."""

    step: int
    batch: object
    bad_rewards: int
    filtered: torch.Tensor
    overlong: torch.Tensor
    batches: list
    flat: list
    live_tokens: int
    recomputed: object  # rl_trainer.RecomputeStats (rows with holes: recomputed while prepared), or None
    loads_MLSE: torch.Tensor
    foresight_M: torch.Tensor
    planned: object  # placement_plans.PlannedStep, or None without placement
    ahead: bool
    micro_steps: int  # per optimizer step (mini-batch), the same on every rank
    schedule_metrics: dict
    nonzero_advantages: int  # this rank's rollout rows whose advantage is not 0
    sleep_wait_s: float = 0.0  # waited for the rollout's engines to sleep before a live-route recompute
    rec_flat: list | None = None  # the recompute's micro-batches (``[rl] recompute_merge``); None: ``flat``
    rec_loads_MLSE: np.ndarray | None = None  # their foresight loads; None: ``loads_MLSE``

    @property
    def recompute_batches(self) -> list:
        return self.flat if self.rec_flat is None else self.rec_flat


def prepare_step(tr: RLTrainer, step: int, batch, ahead: bool = False, first_micro: int | None = None) -> PreparedStep:
    """Collective: a step's rollout made ready to train: rewards checked, advantages, the micro-batches, the
    foresight loads and the placement plans. ``ahead`` (asynchronous RL, called during the previous step,
    ``StreamAhead``): both stages' plans are made in the planner's worker while the rest of the previous step and
    this step's weight sync run; the step itself changes nothing of the job's state until it starts
    (``StagePlacement.begin``). ``first_micro``: the micro-step index the step's first update micro-step will log
    at (default: the next one)."""
    rl = tr.cfg.rl
    bad_rewards = tr._check_rewards(step)
    rollout, rewards = batch.rollout, batch.rewards_B
    if rl.rollout_is != "off" and not batch.has_logprobs:
        raise ValueError("[rl] rollout_is needs behaviour log-probs; this step's rollouts carry none")
    shaped = shaped_rewards_N(rewards, rollout.lengths_B - rollout.prompt_lens_B, rl)
    advantages = group_advantages(shaped, rl.samples_per_prompt, rl.advantage_eps,
                                  std_norm=rl.advantage_std_norm, baseline=rl.advantage_baseline)
    filtered = torch.zeros_like(rewards, dtype=torch.bool)
    if rl.filter_groups:
        filtered |= uniform_groups_N(shaped, rl.samples_per_prompt)
    overlong = ~rollout.finished_B.bool() if rl.overlong_filter else torch.zeros_like(filtered)
    trained = ~(filtered | overlong) if rl.filter_groups or rl.overlong_filter else None
    rollout.routes.validate(
        token_lengths=rollout.lengths_B, num_layers=tr.model_args.n_layers, top_k=tr.model_args.top_k,
        num_experts=tr.model_args.num_experts,
    )
    tr.watchdog.phase(f"step {step + 1} sequence schedule")
    scheduled = tr.schedule(rollout, advantages, trained, signatures=not batch.holes_possible)
    rollout, plan = scheduled.rows.rollout, scheduled.plan  # this rank's rows now
    with dev.host_code():  # micro-batches live on the host; each is uploaded in one copy when it runs
        batches = [[build_micro_batch(rollout, seqs, scheduled.rows.advantages_B, scheduled.rows.trained_B,
                                      pack=tr.cfg.training.pack_sequences) for seqs in update]
                   for update in plan]
    flat = [mb for update in batches for mb in update]
    if ahead and batch.holes_possible:
        raise RuntimeError("a rollout with unrouted positions is routed by the current policy: not ahead")
    live_tokens = tr._live_routed_tokens(rollout, batch.holes_possible)
    recomputed = None
    sleep_wait_s = 0.0
    if live_tokens:  # holes: the recompute's live router picks their experts before anything is planned
        if not ahead:  # GPU work: the rollout's engines asleep first (``rl_step`` settles after the plans)
            sleep_wait_s = settle(tr.source)
        tr.watchdog.phase(f"step {step + 1} recompute (live routes)")
        recomputed = tr.recompute(flat, None, fill=rollout.routes)
    tr.watchdog.phase(f"step {step + 1} foresight")
    loads_MLSE, foresight_M = tr.foresight(step, rollout, plan, scheduled.rows.loads_BLE if not live_tokens
                                           else None, first_micro=first_micro)
    rec_flat = rec_loads = None
    k = rl.recompute_merge
    if k > 1 and recomputed is None:  # the recompute's micro-steps: k of the update's end to end, their loads summed
        with dev.host_code():
            rec_flat = [build_micro_batch(rollout, seqs, scheduled.rows.advantages_B, scheduled.rows.trained_B,
                                          pack=tr.cfg.training.pack_sequences)
                        for seqs in merged_cells([seqs for update in plan for seqs in update], k)]
        rec_loads = merged_sums(loads_MLSE.numpy(), k)
    planned = None
    if tr.placement is not None:  # eplb_history plans from the last step's loads, set when a step starts
        planned = tr.placement.plan_ahead(loads_MLSE.numpy(), scheduled.micro_steps, tr.history_LE,
                                          recompute_in_worker=ahead,
                                          rec_loads_MLSE=rec_loads)
    return PreparedStep(step, batch, bad_rewards, filtered, overlong, batches, flat, live_tokens, recomputed,
                        loads_MLSE, foresight_M, planned, ahead, scheduled.micro_steps, scheduled.metrics,
                        int((advantages != 0).sum()), sleep_wait_s, rec_flat, rec_loads)


def prepare_and_settle(tr: RLTrainer, step: int, batch, ahead: PreparedStep | None) -> tuple[PreparedStep, float]:
    """Collective: the step's host work (rewards, schedule, foresight, the placement plans: ``ahead``'s when it was
    prepared during the previous step) while the rollout's colocated engines fall asleep, then the wait for them,
    before any GPU work of the step (``rollouts/fleet/sleep.py``: the recompute's first plan off the critical
    path). Returns (the prepared step, the seconds waited for the engines)."""
    p = ahead if ahead is not None else tr._prepare(step, batch)
    tr.watchdog.phase(f"step {step + 1} engine sleep")
    return p, settle(tr.source) + p.sleep_wait_s  # a live-route recompute's wait (prepared ahead: none)


class StreamAhead:
    """Step N + 1 prepared at the first of step N's points where its rows are complete (module docstring).
    ``point(u)`` at u = 0 .. U - 1, then ``finish()`` after the update stage (point U, blocking)."""

    def __init__(self, tr: RLTrainer, step: int, updates: int, micro_steps: int):
        self.tr, self.step, self.updates, self.micro_steps = tr, step, updates, micro_steps
        rl = tr.cfg.rl
        self.asynchronous = rl.max_staleness > 0
        self.on = self.asynchronous and step + 1 < tr.job_steps()
        self.early = self.on and rl.plan_from_stream
        self.prepared: PreparedStep | None = None
        self.at = -1  # the point it was prepared at (-1: none)
        self.prepare_s = 0.0

    def point(self, u: int, wait: bool = False) -> None:
        """Collective: at point ``u`` (``u`` mini-batches of step N's update done), step N + 1 prepared if its
        rows are complete on every rank (``wait``: waited for), unless it already was."""
        if self.prepared is not None or not (self.early or (wait and self.on)):
            return
        tr = self.tr
        tr.watchdog.phase(f"step {self.step + 2} rollout (collect)")
        nxt = tr.source.poll(self.step + 1, wait=wait)
        if nxt is None:
            return
        t0 = time.perf_counter()
        first = tr.micro_steps_done + (self.updates - u) * self.micro_steps  # after step N's remaining ones
        self.prepared = prepare_step(tr, self.step + 1, nxt, ahead=True, first_micro=first)
        self.at, self.prepare_s = u, time.perf_counter() - t0

    def finish(self) -> PreparedStep | None:
        """Collective: after the update stage, the blocking poll when no earlier point prepared step N + 1."""
        self.point(self.updates, wait=True)
        return self.prepared

    def metrics(self) -> dict[str, float]:
        """``foresight/prepared_at``: the point step N + 1 was prepared at (-1: none, e.g. the last step)."""
        return ({"foresight/prepared_at": float(self.at), "time/prepare_next_s": self.prepare_s}
                if self.asynchronous else {})
