"""GRPO post-training: rollout -> foresight loads -> recompute -> policy update, every step.

1. **rollout**: the policy generates ``samples_per_prompt`` completions for its
   share of prompts and records every fed token's experts (the routing log), or,
   with ``[rl] rollout_source = "file"``, the step's rows are read from a rollout
   directory imported from vLLM/SGLang/verl/slime (``titan_foremoe/rollouts/``).
2. **schedule + foresight**: the rollout is cut into the micro-steps of the
   update stage (``updates_per_rollout`` optimizer steps x micro-steps of
   ``training.local_batch_size`` sequences). Since those micro-steps replay the
   logged routes, their expert loads ``loads_MLSE`` are known now, before they
   run: this is the planner's input, logged per micro-step.
3. **recompute**: old log-probs of every micro-batch, routes replayed.
4. **update**: the policy loss of ``rl/losses.py`` (aggregation mode, clip bounds,
   rollout correction, KL, entropy from ``[rl]``), routes replayed, gradient
   accumulation over the micro-steps with the step's normalizers counted first,
   one optimizer step per mini-batch.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext as _nullcontext
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..config.job_config import JobConfig
from ..distributed import collectives, group_order
from ..metrics.stage_memory import StageMemory
from ..distributed import device as dev
from ..distributed.uploads import upload
from ..loads import gather_source_loads, micro_step_loads
from ..metrics.balance import max_over_mean, rank_loads
from ..models.attention import packed_attention_masks
from ..models.seams import recorded_routes, routing, take_mismatch
from ..placement.runtime import PlacementRuntime
from ..transfer.groups import twin_group
from ..rl.logprobs import lm_head_logprobs
from ..rl.losses import LossNorm, PolicyLossConfig, Segments, policy_loss
from ..rl.reward_check import CheckedReward, RewardError, stop_hint
from ..rl.rewards import resolve_reward
from ..rollouts.generate import GenerationConfig, Rollout
from ..rollouts.sources import build_sources, engine_section
from ..routing_log import RoutingLog
from ..metrics.balance import take_tokens_per_expert
from ..metrics.heatmap import log_heatmap
from ..metrics.placement import gather_placement_metrics
from .ahead import PreparedStep, StreamAhead, prepare_and_settle, prepare_step
from .rl_batches import RLMicroBatch, build_micro_batch, loss_references, split_recomputed
from .sequence_plan import ScheduledStep, SequencePlanner
from .state import BalancerHistory, KLReference
from .placement_plans import StagePlacement
from .trainer import Trainer, peak_memory_gib

logger = logging.getLogger("titan_foremoe")


@dataclass
class RecomputeStats:
    logp_max_abs_diff: float  # max |rollout - recompute| log-prob over response tokens
    mismatched: int  # tokens whose live top-k differs from the rollout's
    compared: int


class RLTrainer(Trainer):
    def __init__(self, cfg: JobConfig):
        super().__init__(cfg)
        # A prompt file's own (``task``) reward is math-verify correctness.
        name = "math" if cfg.data.path and cfg.rl.reward_fn == "task" else cfg.rl.reward_fn
        self.reward_fn = CheckedReward(resolve_reward(name), name)  # every value checked (_check_rewards)
        self.gen_cfg = GenerationConfig(
            max_new_tokens=cfg.rl.max_new_tokens, temperature=cfg.rl.temperature, top_p=cfg.rl.top_p
        )
        self.loads_dir = os.path.join(cfg.job.dump_folder, "loads")
        self.runtime: PlacementRuntime | None = None
        self._ahead: PreparedStep | None = None  # asynchronous RL: the next step, prepared once its rows are in
        # Checkpointed RL state (the step-seeded prompts and sampling need none; see README, Checkpointing).
        self.kl_reference = None
        if cfg.rl.kl_coef > 0:  # built now so that a checkpoint can load into it; taken at the first RL step
            from ..distributed import parallelize

            self.kl_reference = KLReference(
                parallelize.build_model(cfg, self.model_args, self.parallel_dims, self.device)
            )
            self.job_state.register("kl_reference", self.kl_reference)
        self.balancer_history = BalancerHistory(self.model_args.n_layers, self.model_args.num_experts)
        self.job_state.register("balancer_history", self.balancer_history)
        self.placement: StagePlacement | None = None
        if cfg.balance.balancer != "off":
            self.placement = StagePlacement(
                cfg, self.model, self.optimizers, self.resolved.ep, self.parallel_dims.get_mesh("ep").get_local_rank(),
                self.ep_group, self._host_group(), getattr(torch, cfg.training.mixed_precision_param),
                self.resolved.ranks_per_node,
            )
            self.runtime = self.placement.runtime
            if cfg.balance.owner_policy == "balanced":  # the owner map of each MoE layer (else always contiguous)
                self.job_state.register("expert_layout", self.placement.layout)
        self.embedded, self.source = build_sources(
            cfg, self.resolved, self.model_args, model=self.model, tokenizer=self.tokenizer, task=self.task,
            reward_fn=self.reward_fn, gen_cfg=self.gen_cfg, dp_rank=self.dp_rank, device=self.device,
            dataset=self.dataset, engine_hooks=dict(export=self._export_policy, policy_logprobs=self._policy_logprobs,
                                                    rank=self.rank, weights=self._policy_weights),
        )
        self.job_state.register("rollout_source", self.source)  # the file position (embedded: none)
        self.sequences = SequencePlanner(cfg, self.resolved, self.model_args, self.rank)
        self.stage_memory = StageMemory(self.device)  # memory/<stage>_max_allocated_gib (CUDA)
        group_order.check_same_order()  # and the transfer lane's, re-layout's and the engines' groups

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """The frozen KL reference (the policy at the start of RL), once taken."""
        ref = self.kl_reference
        return ref.model if ref is not None and ref.taken else None

    @property
    def history_LE(self):
        """The last RL step's expert loads [layers, experts] (eplb_history's input); checkpointed."""
        return self.balancer_history.loads_LE

    # -- lengths ---------------------------------------------------------------
    def optimizer_steps(self) -> int:
        rl = self.cfg.rl
        return rl.sft_warmup_steps + self.cfg.training.steps * rl.updates_per_rollout

    def run_job_step(self, step: int) -> dict[str, float]:
        if step < self.cfg.rl.sft_warmup_steps:
            return self.train_step(step)
        if self.kl_reference is not None and not self.kl_reference.taken:
            # the reference is a plain copy: the policy's experts in logical order
            with self.placement.layout.logical() if self.placement is not None else _nullcontext():
                self.kl_reference.take(self.model)
        return self.rl_step(step)

    def log_step(self, out: dict[str, float]) -> None:
        if "rl/reward_mean" not in out:
            return super().log_step(out)
        logger.info(
            "step %3d  reward %.3f  exact %.2f  len %.1f  loss %+.4f  mismatch %.4f  clip %.3f  "
            "rollout %.2fs recompute %.2fs update %.2fs  foresight max/mean %.3f  measured %.3f",
            self.step, out["rl/reward_mean"], out["rl/exact_match"], out["rl/response_len"], out["loss"],
            out["rl/route_mismatch"], out["rl/clip_frac"], out["time/rollout_s"], out["time/recompute_s"],
            out["time/update_s"], out["foresight/step_static_max_over_mean"], out["balance/step_mean_max_over_mean"],
        )

    # -- stages ------------------------------------------------------------------
    def rollout(self, step: int):
        """An embedded rollout of this rank's prompts: ``(Rollout, examples)``."""
        return self.embedded.generate(step)

    def schedule(self, rollout: Rollout, advantages_B: torch.Tensor, trained_B: torch.Tensor | None = None,
                 signatures: bool = True) -> ScheduledStep:
        """Collective: every sequence of the step on a (rank, micro-step) (``[rl] sequence_schedule``,
        ``[training] max_tokens_per_micro_step``; ``train/sequence_plan.py``): this rank's rows after the exchange
        and ``plan[update][micro_step] -> local rows``."""
        return self.sequences.plan(rollout, advantages_B, trained_B, signatures=signatures)

    def foresight(self, step: int, rollout: Rollout, plan: list[list[list[int]]],
                  loads_BLE: torch.Tensor | None = None, first_micro: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """``loads_MLSE`` of the update stage, known before it runs; logs static-placement balance at the stage's
        micro-steps (from ``first_micro``, default the next). ``loads_BLE``: the rows' expert counts when the
        schedule took them (else counted from the routes)."""
        flat = [seqs for update in plan for seqs in update]
        loads_MLSE = gather_source_loads(micro_step_loads(rollout.routes, flat, loads_BLE), self.ep_group)
        ratios_M = max_over_mean(rank_loads(loads_MLSE.sum(2).flatten(0, 1).float(), self.resolved.ep)).view(
            loads_MLSE.shape[0], -1
        ).mean(-1)
        for m, r in enumerate(ratios_M.tolist()):
            self.metric_logger.log({"foresight/static_max_over_mean": r},
                                   (self.micro_steps_done if first_micro is None else first_micro) + m)
        log_heatmap(self.metric_logger, "foresight/expert_load_heatmap", loads_MLSE.sum(dim=(0, 2)), step)
        if self.cfg.rl.save_loads and self.rank == 0:
            os.makedirs(self.loads_dir, exist_ok=True)
            torch.save({"loads_MLSE": loads_MLSE, "step": step}, os.path.join(self.loads_dir, f"step_{step:05d}.pt"))
        return loads_MLSE, ratios_M

    @torch.no_grad()
    def recompute(self, batches: list[RLMicroBatch], stage=None, fill: RoutingLog | None = None) -> RecomputeStats:
        """Old (and reference) log-probs with the rollout's routes, micro-step by micro-step.

        ``stage``: (plan, loads_MLSE) to run the policy's forwards through the placement runtime.
        ``fill``: the rollout's log, whose holes (no route) the policy's live router fills here: every
        micro-batch's routes become the ones this forward used, so the reference, foresight and update
        replay them (run with no plan: a hole's experts are unknown until now).
        """
        self.model.eval()
        rt = self.runtime if stage is not None else None
        gaps = []  # per micro-step max |recomputed - rollout| log-prob on the device, read once after the stage
        if rt is not None:
            rt.start_stage(*stage, name="recompute", tokens_M=_real_tokens(batches))
        failed = True
        try:  # no host sync between the stage's micro-steps (filling holes reads the routes: not a planned stage)
            with dev.strict("the recompute stage's micro-steps") if fill is None else _nullcontext():
                for m, mb in enumerate(batches):
                    d = self._upload(mb, loss=True)
                    with rt.micro_step(m) if rt is not None else _nullcontext():
                        mb.old_logp_BL = self._logprobs(self.model, mb, record=fill is not None, d=d).detach()
                        if fill is not None:  # the live router's picks for the holes, replayed from here on
                            used = dev.to_host(recorded_routes(self.model))
                            mb.routes_BLXK = torch.where(mb.routes_BLXK < 0, used, mb.routes_BLXK)  # holes only
                            fill.fill_holes(mb.sequences, mb.rows(mb.routes_BLXK))
                            mb.holes = False
                        if rt is not None:
                            rt.prefetch(m + 1)
                            rt.report(m)
                    if self.ref_model is not None:
                        mb.ref_logp_BL = self._logprobs(self.ref_model, mb, d=d).detach()
                    diff = (mb.old_logp_BL - d["rollout_logp"]).abs()
                    # imported rollouts may carry no behaviour log-probs (NaN): left out
                    gaps.append(torch.where(d["loss_mask"] & ~diff.isnan(), diff, 0.0).amax())
            failed = False
        finally:
            self.model.train()
            if rt is not None:
                rt.end_stage(failed=failed)
        worst = float(dev.to_host(torch.stack(gaps)).max()) if gaps else 0.0
        mismatched, compared = take_mismatch(self.model)
        return RecomputeStats(worst, mismatched, compared)

    def _export_policy(self, folder: str) -> None:
        """Collective: the policy's current weights as an HF folder for the rollout engine (logical expert order;
        every rank writes its own slices, in the engine section's ``dtype``)."""
        from .hf_export import export_hf

        with self.placement.layout.logical() if self.placement is not None else _nullcontext():
            export_hf(self.checkpointer, folder, self.hf_path, getattr(torch, engine_section(self.cfg).dtype))

    def _policy_weights(self):
        """The policy as the HF export's tensors, one parameter gathered at a time (``weight_sync = "nccl"``):
        the same adapter, logical expert order and ``[rollout_engine] dtype`` as ``_export_policy``."""
        from ..rollouts.engines.vllm_weights import HFWeightStream

        layout = (lambda: self.placement.layout.logical()) if self.placement is not None else _nullcontext
        return HFWeightStream(lambda: self.checkpointer.states["model"].state_dict(), self.checkpointer.sd_adapter,
                              getattr(torch, self.cfg.rollout_engine.dtype), layout)

    @torch.no_grad()
    def _policy_logprobs(self, tokens_T: np.ndarray, routes_RXK: np.ndarray) -> np.ndarray:
        """Collective: log p(token t | tokens < t), t >= 1, at temperature 1 with ``routes_RXK`` replayed (probe)."""
        from ..routing_log import RoutingLog

        T = len(tokens_T)
        rollout = Rollout(
            tokens_BT=torch.from_numpy(tokens_T)[None], prompt_lens_B=torch.tensor([1]), lengths_B=torch.tensor([T]),
            logprobs_BT=torch.zeros(1, T), finished_B=torch.ones(1, dtype=torch.bool),
            routes=RoutingLog.from_sequences([torch.from_numpy(routes_RXK.astype(np.int64))], [T],
                                             self.model_args.num_experts))
        mb = build_micro_batch(rollout, [0], torch.zeros(1), pack=self.cfg.training.pack_sequences)
        self.model.eval()
        try:
            logp = self._logprobs(self.model, mb, temperature=1.0)
        finally:
            self.model.train()
        take_mismatch(self.model)  # the probe's routes are not the step's
        return logp[0, : T - 1].double().cpu().numpy()

    def _upload(self, mb: RLMicroBatch, loss: bool = False) -> dict[str, torch.Tensor]:
        """The micro-batch on the device in one pinned, non-blocking copy: ids, targets, routes, mask and the
        indices of its real tokens (found on the host, where the micro-batch is: no sync in the layers);
        ``loss``: also what the loss and the rollout gap read (loss mask, advantages, behaviour log-probs);
        packed rows: also their positions and sequence bounds (and, with ``loss``, each position's sequence)."""
        mask_BL = mb.token_mask_BL
        arrays = {"inputs": mb.inputs_BL, "targets": mb.targets_BL, "routes": mb.routes_BLXK, "mask": mask_BL,
                  "index": np.flatnonzero(mask_BL.numpy())}
        if mb.packed:
            arrays.update(positions=mb.positions_BL, cu_seqlens=mb.cu_seqlens_S1)
        if loss:
            arrays.update(loss_mask=mb.loss_mask_BL, advantages=mb.advantages_B, rollout_logp=mb.rollout_logp_BL)
            if mb.packed:
                arrays.update(seq=mb.seq_BL)
        return upload(arrays, self.device)

    def _logprobs(self, model: torch.nn.Module, mb: RLMicroBatch, entropy: bool = False, record: bool = False,
                  temperature: float | None = None, d: dict[str, torch.Tensor] | None = None):
        """log pi(target) of every input position, the rollout's routes replayed (on the device);
        ``entropy``: ``(log-probs, entropy)``; ``record``: the routers keep the routes used; ``temperature``:
        default ``[rl] temperature``; ``d``: the micro-batch's upload (``_upload``), made here if not given."""
        d = self._upload(mb) if d is None else d
        t = self.cfg.rl.temperature if temperature is None else temperature
        packed = {}  # padded rows: torchtitan's causal SDPA, positions 0..L-1
        if mb.packed:  # positions restart per sequence; attention within each sequence (mask made once here)
            packed = dict(positions=d["positions"], attention_masks=packed_attention_masks(
                d["positions"], d["cu_seqlens"], mb.max_len, getattr(torch, self.cfg.training.mixed_precision_param)))
        with routing(model, token_mask_BL=d["mask"], token_index_V=d["index"], logged_BLXK=d["routes"],
                     replay=self.cfg.rl.router_replay, holes=mb.holes, record=record), \
                lm_head_logprobs(model, d["targets"], t, chunk=self.cfg.rl.logprob_chunk_tokens, entropy=entropy):
            logp, ent = model(d["inputs"], **packed)  # the lm_head returns them: no [tokens, vocab] logits kept
        return (logp, ent) if entropy else logp

    def update(self, minibatch: list[RLMicroBatch], first: int = 0, last_of_stage: bool = True) -> dict[str, float]:
        """One optimizer step over ``minibatch`` (micro-steps ``first..``), its loss normalized over all ranks."""
        loss_cfg = PolicyLossConfig.from_rl(self.cfg.rl)
        rt = self.runtime if self.runtime is not None and self.runtime.plan is not None else None
        counts = sum(LossNorm.local_counts(mb.loss_mask_BL, _segments(mb, mb.seq_BL))
                     for mb in minibatch)  # host masks: no device sync
        collectives.all_reduce(counts)
        norm = LossNorm.of(counts)
        self.optimizers.zero_grad()
        sums: dict[str, torch.Tensor] = {}  # additive metrics, each already divided by its step normalizer
        reports, tokens = [], []  # per micro-step, read once the micro-steps are done
        with dev.strict("the update stage's micro-steps"):
            for i, mb in enumerate(minibatch):
                m = first + i
                self.watchdog.phase(f"step {self.step + 1} update micro-step {m}")
                d = self._upload(mb, loss=True)
                with rt.micro_step(m) if rt is not None else _nullcontext():
                    logp, entropy = self._logprobs(self.model, mb, entropy=True, d=d)
                    old_logp, ref_logp = loss_references(mb, logp)
                    loss, metrics = policy_loss(
                        logp, old_logp, d["advantages"], d["loss_mask"], loss_cfg,
                        rollout_logp_BL=d["rollout_logp"] if loss_cfg.rollout_is != "off" else None,
                        ref_logp_BL=ref_logp, entropy_BL=entropy, norm=norm, segments=_segments(mb, d.get("seq")),
                    )
                    if rt is not None and i + 1 < len(minibatch):
                        rt.prefetch(m + 1)  # travels during this micro-step's backward
                    loss.backward()
                for k, v in metrics.items():  # stay on the device: one copy for the step below
                    sums[k] = sums[k] + v if k in sums else v
                tokens.append(take_tokens_per_expert(self.model))  # device counts, no sync
                if rt is not None:
                    reports.append((m, rt.report(m)))
        # the optimizer step's boundary: the micro-steps' metrics are read here, once
        placement_rows = self._log_placements(rt, reports) if rt is not None else []
        if rt is None:
            balance = self.log_micro_step_balances(tokens)
        else:
            balance = [r["balance/max_over_mean"] for r in placement_rows]
        keys = sorted(sums)
        step_sums = torch.stack([sums[k].double() for k in keys]).cpu()
        collectives.all_reduce(step_sums)
        totals = dict(zip(keys, step_sums.tolist()))
        grad_norm = self.optimizer_step(totals["loss"])
        if self.runtime is not None:
            self.runtime.weights_changed()
        if rt is not None and not last_of_stage:
            rt.prefetch(first + len(minibatch))  # after the optimizer step: replicas carry the new weights
        mismatch = torch.tensor(take_mismatch(self.model), dtype=torch.float64)
        collectives.all_reduce(mismatch)
        placement = {}
        if placement_rows:
            n = len(placement_rows)
            placement = {  # step aggregates of the per-micro-step figures
                "placement/step_rows_off_plan": sum(r["placement/rows_off_plan"] for r in placement_rows),
                "placement/step_rows_minus_routed": sum(r["placement/rows_minus_routed"] for r in placement_rows),
                "placement/step_expert_ms_max": sum(r["placement/expert_ms_max"] for r in placement_rows) / n,
                "placement/step_expert_ms_max_over_mean":
                    sum(r["placement/expert_ms_max_over_mean"] for r in placement_rows) / n,
                "placement/step_planned_max_over_mean": sum(r["placement/planned_max_over_mean"] for r in placement_rows) / n,
                "placement/step_replicas": sum(r["placement/replicas"] for r in placement_rows) / n,
                "transfer/step_moves": sum(r["transfer/moves"] for r in placement_rows),
                "placement/step_plan_ms": sum(r["placement/plan_ms"] for r in placement_rows),
                **({"placement/step_count_gather_ms": sum(r["placement/count_gather_ms"] for r in placement_rows)}
                   if "placement/count_gather_ms" in placement_rows[0] else {}),
                "transfer/step_exposed_s": sum(r["transfer/exposed_s"] for r in placement_rows),
            }
        return {
            **placement,
            **totals,
            "rl/route_mismatch": float(mismatch[0] / mismatch[1].clamp_min(1)),
            "grad_norm": grad_norm,
            "balance/step_mean_max_over_mean": sum(balance) / len(balance),
        }

    def _log_placements(self, rt: PlacementRuntime, reports: list) -> list[dict[str, float]]:
        """Per micro-step placement metrics of one optimizer step's ``reports`` (``metrics/placement.py``), logged."""
        rows = []
        for metrics in gather_placement_metrics(rt, reports, self.ep_group):
            self.metric_logger.log(metrics, self.micro_steps_done)
            self.micro_steps_done += 1
            rows.append(metrics)
        return rows

    def _prepare(self, step: int, batch, ahead: bool = False, first_micro: int | None = None) -> PreparedStep:
        return prepare_step(self, step, batch, ahead, first_micro)  # ``train/ahead.py``

    def rl_step(self, step: int) -> dict[str, float]:
        rl = self.cfg.rl
        t0 = time.perf_counter()
        self.watchdog.phase(f"step {step + 1} rollout")
        self.stage_memory.begin("rollout")
        batch = self.source.next_batch(step)
        self.stage_memory.end("rollout")
        t1 = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.step != step:
            raise RuntimeError(f"step {ahead.step} was prepared ahead, step {step} runs")
        if ahead is not None and ahead.batch is not batch:
            raise RuntimeError(f"step {step} was planned for another rollout than the source returned")
        p, sleep_wait_s = prepare_and_settle(self, step, batch, ahead)
        rollout, rewards, exact = batch.rollout, batch.rewards_B, batch.exact_B
        bad_rewards, filtered, overlong, batches, flat = p.bad_rewards, p.filtered, p.overlong, p.batches, p.flat
        live_tokens, recomputed, loads_MLSE, foresight_M = p.live_tokens, p.recomputed, p.loads_MLSE, p.foresight_M
        recompute_stage = update_plan = None
        if self.placement is not None:
            self.balancer_history.loads_LE = loads_MLSE.numpy().sum(axis=(0, 2))
            t_begin = time.perf_counter()
            recompute_stage, update_plan = self.placement.begin(p.planned)
            plan_wait_s = time.perf_counter() - t_begin
        recompute_micro_steps = len(p.recompute_batches)
        if recomputed is None:
            self.watchdog.phase(f"step {step + 1} recompute")
            self.stage_memory.begin("recompute")
            recomputed = self.recompute(p.recompute_batches, recompute_stage)
            if p.rec_flat is not None:  # [rl] recompute_merge: each update micro-batch's log-probs, views of them
                split_recomputed(p.rec_flat, flat, rl.recompute_merge)
                p.rec_flat = None  # the merged host micro-batches, freed before the update
            self.stage_memory.end("recompute")
        t2 = time.perf_counter()
        micro = p.micro_steps
        stream = StreamAhead(self, step, len(batches), micro)  # the next step, prepared once its rows are in
        stream.point(0)
        self.stage_memory.begin("update")
        if update_plan is not None:
            plan, tables = update_plan.result()
            self.runtime.start_stage(plan, loads_MLSE.numpy(), tables, name="update", tokens_M=_real_tokens(flat))
        updates = []
        for u, minibatch in enumerate(batches):
            if u:
                stream.point(u)
            updates.append(self.update(minibatch, first=u * micro, last_of_stage=u + 1 == len(batches)))
        if update_plan is not None:
            self.runtime.end_stage()
        self.stage_memory.end("update")
        t3 = time.perf_counter()
        self._ahead = stream.finish()  # after the update: the blocking fallback
        t4 = time.perf_counter()  # the step's end: the next step's rows collected and planned
        self.watchdog.phase(f"step {step + 1} statistics")

        stats = torch.tensor([
            float(rewards.sum()), float(exact.sum()), float(rewards.numel()),
            float((rollout.lengths_B - rollout.prompt_lens_B).sum()), float(rollout.lengths_B.sum()), batch.truncated,
            float(filtered.sum()) / rl.samples_per_prompt, float(overlong.sum()),
            *_positions(flat), float(p.nonzero_advantages),
        ], dtype=torch.float64)
        collectives.all_reduce(stats)
        gap = torch.tensor(recomputed.logp_max_abs_diff)
        collectives.all_reduce(gap, collectives.ReduceOp.MAX)
        recompute_mismatch = torch.tensor([recomputed.mismatched, recomputed.compared], dtype=torch.float64)
        collectives.all_reduce(recompute_mismatch)
        mem = torch.tensor([peak_memory_gib(self.device), *self.stage_memory.values()])  # rides one all-reduce
        collectives.all_reduce(mem, collectives.ReduceOp.MAX)
        stage_mem = self.stage_memory.metrics(mem[1:].tolist())
        mem = mem[:2].max()  # the process peak: the counter is reset per stage
        n = float(stats[2])
        if stats[10] == 0 and self.rank == 0:  # every group's rewards equal: no policy gradient, step after step
            logger.warning(zero_advantages_line(step, self.reward_fn.name, int(n)))
        out = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
        if "rollout_is/weight_sq_mean" in out:  # the spread of the importance weights over the step's tokens
            out["rollout_is/weight_std"] = max(out["rollout_is/weight_sq_mean"] - out["rollout_is/weight_mean"] ** 2,
                                               0.0) ** 0.5
        out.update({
            **stage_mem,
            "rl/reward_mean": float(stats[0]) / n,
            "rl/exact_match": float(stats[1]) / n,
            "rl/response_len": float(stats[3]) / n,
            "rl/bad_rewards": float(bad_rewards),
            "rl/nonzero_advantage_frac": float(stats[10]) / n,
            "rollout/logprob_gap": float(gap) if batch.has_logprobs else float("nan"),
            **getattr(self.source, "timings", {}),
            "rollouts/truncated": float(stats[5]),
            **({"rollout/live_routed_tokens": float(live_tokens)} if batch.holes_possible else {}),
            **({"rl/groups_filtered": float(stats[6])} if rl.filter_groups else {}),
            **(self._refill_metrics(batch.refill) if rl.filter_groups and rl.filter_groups_max_rounds > 0 else {}),
            **({"rl/overlong_filtered": float(stats[7])} if rl.overlong_filter else {}),
            "rl/recompute_route_mismatch": float(recompute_mismatch[0] / recompute_mismatch[1].clamp_min(1)),
            "foresight/step_static_max_over_mean": float(foresight_M.mean()),
            **p.schedule_metrics,
            "schedule/padding_fraction": 1.0 - float(stats[9]) / max(float(stats[8]), 1.0),
            "schedule/micro_steps": float(len(flat)),
            "schedule/recompute_micro_steps": float(recompute_micro_steps),
            **({"foresight/planned_ahead": float(p.ahead), "foresight/plan_wait_s": plan_wait_s,
                "foresight/plan_lead_s": p.planned.lead_s(t0),
                **{f"foresight/slot_overhead_tokens_{k}": float(v) for k, v in p.planned.slot_tokens.items()}}
               if p.planned is not None else {}),
            "lr": self.lr_schedulers.schedulers[0].get_last_lr()[0],
            "time/rollout_s": t1 - t0,
            **({"time/engine_sleep_wait_s": sleep_wait_s} if getattr(self.source, "sleeps", False) else {}),
            "time/recompute_s": t2 - t1,
            "time/update_s": t3 - t2,
            **({"time/collect_next_s": t4 - t3} if rl.max_staleness > 0 else {}), **stream.metrics(),
            "step_time_s": t4 - t0,
            "tokens_per_s": float(stats[4]) / (t4 - t0),
            "peak_memory_gib": float(mem),
            **(self.placement.relayout_metrics() if self.placement is not None else {}),
        })
        self.metric_logger.log({f"train/{k}" if "/" not in k else k: v for k, v in out.items()}, step)
        return out

    def _check_rewards(self, step: int) -> int:
        """This step's rewards that were not finite numbers, counted over all ranks (one 8-byte all-reduce):
        every rank stops naming the first (``[rl] bad_reward = "stop"``), or they were scored 0 and rank 0 says
        how many (``"zero"``). Returns the count."""
        count, first = self.reward_fn.take()
        total = torch.tensor(float(count), dtype=torch.float64)
        collectives.all_reduce(total)
        total = int(total)
        if total == 0:
            return 0
        first = next(f for f in collectives.all_gather_objects(first) if f)
        what = f"step {step + 1}: {first}" + (f" (and {total - 1} more bad rewards this step)" if total > 1 else "")
        if self.cfg.rl.bad_reward == "stop":
            raise RewardError(f"{what}: stopped before the update ({stop_hint(first)})")
        if self.rank == 0:
            logger.warning("%s: scored 0 ([rl] bad_reward = 'zero'), %d this step", what, total)
        return total

    def _refill_metrics(self, refill: dict | None) -> dict[str, float]:
        """DAPO refill over all ranks: rounds decoded (the same on every rank), groups refilled, groups left
        uniform (the rounds ran out; the trainer filters them)."""
        r = refill or {}
        t = torch.tensor([r.get("refilled", 0), r.get("unfilled", 0)], dtype=torch.float64)
        collectives.all_reduce(t)
        return {"rl/refill_rounds": float(r.get("rounds", 0)), "rl/groups_refilled": float(t[0]),
                "rl/groups_unfilled": float(t[1])}

    def _live_routed_tokens(self, rollout: Rollout, possible: bool) -> int:
        """Routed tokens of this step, over all ranks, with a layer the engine sent no route for.

        Only sources that can deliver holes (``possible``: the same on every rank) pay the one all-reduce;
        every rank then takes the same path (a recompute with no plan), so no collective is left waiting."""
        if not possible:
            return 0
        n = torch.tensor([float(rollout.routes.holes())], dtype=torch.float64)
        collectives.all_reduce(n)
        return int(n[0])

    def close(self) -> None:
        if hasattr(self.source, "close"):
            self.source.close()  # a launched engine stops with the job
        if self.placement is not None:
            self.placement.close()
        super().close()

    def _after_load(self) -> None:
        super()._after_load()
        if self.placement is not None:  # the weights loaded in logical order: re-lay them out as saved
            self.placement.layout.restore()
        if hasattr(self.source, "load_in_flight") and self.step < self.job_steps():  # asynchronous RL
            self.source.load_in_flight(self._in_flight_folder(self.step), self.step)

    def _in_flight_folder(self, step: int) -> str:
        return os.path.join(self.checkpointer.step_folder(step), "in_flight_rollouts")  # staging while saved

    def _save_side_state(self, step: int, last: int) -> None:
        """Asynchronous RL: the next step's rows, collected after this step's update, go with the checkpoint."""
        if hasattr(self.source, "save_in_flight") and self.checkpointer._should_save(step, last_step=step == last):
            self.source.save_in_flight(self._in_flight_folder(step))

    def _checkpoint_layout(self, step: int, last: int):
        """Experts in logical order while a checkpoint (or HF export) reads them, when one is written."""
        if self.placement is None or not self.checkpointer._should_save(step, last_step=step == last):
            return _nullcontext()
        return self.placement.layout.logical()

    def _host_group(self):
        """A gloo group over the EP ranks for the CPU-assisted path (the transfer group itself on CPU).

        ``twin_group`` is collective over the world, so it works with several EP groups."""
        if self.cfg.balance.transfer_path == "direct" or self.device.type == "cpu":
            return None
        return twin_group(self.ep_group, backend="gloo")


def zero_advantages_line(step: int, reward: str, sequences: int) -> str:
    """The warning of a step whose advantages are all 0: it trains on nothing but the KL and entropy terms."""
    return (f"step {step + 1}: all {sequences} advantages are 0 (every group's rewards are equal under reward "
            f"{reward!r}): this update has no policy gradient; check the reward function, or use [rl] "
            "filter_groups = true with filter_groups_max_rounds to refill such groups")


def _positions(batches: list[RLMicroBatch]) -> tuple[float, float]:
    """(positions the model computes, real input tokens) over ``batches``: recompute and update compute the same
    positions, so their ratio is the stages' padding."""
    return (float(sum(mb.computed_positions() for mb in batches)), float(sum(mb.real_tokens() for mb in batches)))


def _real_tokens(batches: list[RLMicroBatch]) -> np.ndarray:
    """Real (routed) tokens of each micro-batch, from its host mask: what the stage's plan must have been made for."""
    return np.array([mb.real_tokens() for mb in batches], dtype=np.int64)


def _segments(mb: RLMicroBatch, seq_BL: torch.Tensor | None) -> Segments | None:
    """The loss's sequences of a packed micro-batch (``seq_BL``: its host or device copy); padded: None."""
    return Segments(seq_BL, len(mb.sequences)) if mb.packed else None
