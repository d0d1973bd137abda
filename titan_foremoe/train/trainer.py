"""The trainer: a step is a list of named ``MicroStep``s, then one optimizer step.

Gradient accumulation is explicit: the trainer knows a step's whole micro-step
schedule before running it. The RL stages (recompute, policy update) and the
balancer plug in at the micro-step: each one carries its own batch (and, later,
its routing log and placement plan).

Loss normalisation is global: every micro-step's summed token loss is divided
by the number of loss tokens of the whole step over all data-parallel ranks, and
FSDP sums (not averages) gradients, so N ranks x M micro-steps give exactly the
gradient of one process running the whole global batch.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
import logging
import os
import resource
import signal
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.distributed import utils as dist_utils

from ..distributed import device as dev
from ..distributed.uploads import upload
from ..config import preflight
from ..config.check import check_data_resume, load_tokenizer
from ..config.job_config import JobConfig
from ..config.loader import ConfigError
from ..config.validate import Resolved, model_args, token_budget, validate
from ..data.sft import IGNORE_INDEX, MicroBatch, sft_micro_batch
from ..data.tasks import build_task
from ..data.tokenizer import CharTokenizer
from ..distributed import agreement, collectives, group_order, parallelize
from ..metrics.balance import group_tokens_per_expert, micro_step_balance_metrics, take_tokens_per_expert
from . import components
from .guards import NonFiniteError, job_identity, non_finite, non_finite_tensors
from .state import JobState
from .summary import complete_finished_job, summary_record, write_summary
from .watchdog import Watchdog

logger = logging.getLogger("titan_foremoe")

warnings.filterwarnings("ignore", message=".*CPU autocast.*|.*In CPU autocast.*")
warnings.filterwarnings("ignore", message=".*DTensor random operators may not have complete support.*")


@dataclass
class MicroStep:
    """One gradient-accumulation micro-step of one data-parallel rank."""

    step: int
    index: int
    batch: MicroBatch



def token_loss_sum(logits_BLV: torch.Tensor, labels_BL: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits_BLV.flatten(0, 1).float(), labels_BL.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Trainer(Stateful):
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        world_size = parallelize.init_distributed(cfg)
        self.rank = dist.get_rank()
        # nodes started with other overrides or another checkout would train diverged replicas silently
        agreement.check_same("config and code", job_identity(cfg))
        self.resolved: Resolved = validate(cfg, world_size, scan_rollout_rows=False)  # the pre-flight scanned them
        self.device = parallelize.local_device()
        # streams, events and host reads go through distributed/device.py: torch's on CUDA, checked on request
        self.device_backend = dev.for_device(self.device, cfg.debug.check_streams)
        dev.set_backend(self.device_backend)
        if cfg.debug.check_streams:
            self.device_backend.__enter__()  # from here on every op runs on the emulated streams
        self.parallel_dims = parallelize.build_parallel_dims(cfg, world_size)
        pd = self.parallel_dims
        self.dp_rank = pd.get_mesh("batch").get_local_rank() if pd.dp_enabled else 0
        self.ep_group = pd.get_mesh("ep").get_group() if pd.ep_enabled else None

        torch.manual_seed(cfg.job.seed)
        if cfg.job.deterministic:
            torch.use_deterministic_algorithms(True)
        self.hf_path = cfg.model.hf_assets_path
        self.tokenizer = load_tokenizer(cfg) if self.hf_path else CharTokenizer()
        self.task = build_task(cfg.data)
        self.dataset = self._build_dataset()
        if self.dataset is not None:
            self.task = self.dataset  # rewards get the dataset as their ``task``
        self.model_args = model_args(cfg, vocab_size=self.tokenizer.vocab_size)
        self.model = parallelize.build_model(cfg, self.model_args, pd, self.device)
        group_order.check_same_order()  # the mesh's and FSDP's groups made in one order on every rank
        self.optimizers = components.build_optimizers(cfg, self.model)
        self.lr_schedule_steps = self.optimizer_steps()  # a resume keeps the saved length (see _after_load)
        self.lr_schedulers = components.build_lr_schedulers(cfg, self.optimizers, self.lr_schedule_steps)
        self.step = 0
        self.micro_steps_done = 0
        self.skipped_updates = 0
        self.skips_in_a_row = 0  # [training] nonfinite_max_skips (not saved: a resume starts counting again)
        self.job_state = JobState()  # RL state, data position...: parts register before train() loads
        if self.dataset is not None:
            self.job_state.register("dataset", self.dataset)  # the prompt file's position
        sd_adapter = None
        if self.hf_path:
            from ..models.build import build_model_config
            from ..models.hf import HFAdapter

            sd_adapter = HFAdapter(build_model_config(self.model_args, expert_dtype=cfg.model.expert_dtype),
                                   self.hf_path)
        self.checkpointer = components.build_checkpointer(
            cfg, self.model, self.optimizers, self.lr_schedulers, {"train_state": self, "job_state": self.job_state},
            sd_adapter=sd_adapter, rank=self.rank,
        )
        self.watchdog = Watchdog(self.rank, cfg.comm.init_timeout_seconds)
        if world_size > 1 and cfg.comm.mode == "default":  # heartbeats in the rendezvous store: a timed-out rank
            self.watchdog.attach(dist.distributed_c10d._get_default_store(), world_size)  # names the late ones
        self.folder_lock = None  # rank 0 under a direct torchrun launch: this job's hold on dump_folder
        self.finished = self._check_resume()  # "job already finished" (outputs left alone), or None
        self.metric_logger, self.tb_dir = components.build_metric_logger(cfg, self.rank, enable=self.finished is None)
        if self.hf_path and not (cfg.checkpoint.enable and cfg.checkpoint.initial_load_in_hf) and self.rank == 0:
            logger.warning("[model] hf_assets_path is set without [checkpoint] enable + initial_load_in_hf: "
                           "the shape and tokenizer come from %s, the weights are random", self.hf_path)
        self.history: dict[str, list] = {"max_over_mean": []}
        n_params = sum(p.numel() for p in self.model.parameters())
        if self.rank == 0:
            budget = token_budget(cfg)
            micro = (f"micro-steps formed each step by a {budget}-token budget per rank ([training] "
                     "max_tokens_per_micro_step)" if budget else
                     f"{self.resolved.micro_steps} micro-steps of {cfg.training.local_batch_size} sequences per rank")
            logger.info(
                "model %s: %d layers, %d experts, top-%d, %s local params/rank; world %d, dp_shard %d, ep %d, %s",
                self.hf_path or cfg.model.flavor, self.model_args.n_layers, self.model_args.num_experts, self.model_args.top_k,
                f"{n_params:,}", world_size, self.resolved.dp_shard, self.resolved.ep, micro,
            )

    def _build_dataset(self):
        """``[data] path`` as a ``PromptDataset`` (None: the embedded task), read as the pre-flight reads it."""
        from ..config.check import load_dataset

        ds = load_dataset(self.cfg, self.tokenizer)
        if ds is not None and self.rank == 0:
            logger.info("dataset %s: %d rows, %d bad rows skipped", self.cfg.data.path, len(ds), ds.skipped)
        return ds

    def optimizer_steps(self) -> int:
        """Optimizer steps of the whole job (the LR schedule's length)."""
        return self.cfg.training.steps

    def job_steps(self) -> int:
        """Steps of the whole job (supervised warm-up + RL steps): the pre-flight's definition."""
        return preflight.job_steps(self.cfg)

    # -- Stateful (checkpointed with the model and optimizer) -----------------
    def state_dict(self) -> dict:
        return {
            "step": torch.tensor(self.step),
            "micro_steps_done": torch.tensor(self.micro_steps_done),  # the TensorBoard micro-step axis
            "lr_schedule_steps": torch.tensor(self.lr_schedule_steps),
            "skipped_updates": torch.tensor(self.skipped_updates),
            "history": json.dumps(self.history),  # summary.json covers every step across resumes
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = int(state_dict["step"])
        self.micro_steps_done = int(state_dict["micro_steps_done"])
        self.lr_schedule_steps = int(state_dict["lr_schedule_steps"])
        self.skipped_updates = int(state_dict["skipped_updates"])
        self.history = json.loads(state_dict["history"])

    def _check_resume(self) -> str | None:
        """What run_train.sh checked, for a direct torchrun launch: rank 0 reads the checkpoint's metadata.

        Returns the "already finished" line, or None; raises the same ``ConfigError`` on every rank.
        """
        from ..distributed.folder_lock import FolderBusy, hold_unless_launched

        verdict = [None]
        if self.rank == 0:
            try:
                self.folder_lock = hold_unless_launched(self.cfg.job.dump_folder)  # a direct torchrun launch
                check_data_resume(self.cfg, self.dataset, preflight.check_resume(self.cfg))
            except (ConfigError, FolderBusy, preflight.JobFinished) as e:
                verdict = [(type(e) is not preflight.JobFinished, str(e))]
                if self.folder_lock is not None and verdict[0][0]:  # the job stops here: leave the folder free
                    self.folder_lock.release()
        verdict = [collectives.broadcast_object(verdict[0], src=0)]
        if verdict[0] is None:
            return None
        is_error, message = verdict[0]
        if is_error:
            raise ConfigError(message)
        return message

    def _load_checkpoint(self) -> bool:
        """torchtitan's load of the step the pre-flight chose. A load that fails names the file that does not match
        its checksum and the newest step that verifies (every rank: a ``ConfigError``). After a load from an older
        step (``load_step``), rank 0 sets the newer steps aside before the first save (``checkpoints.py``)."""
        from .checkpoints import abandon_newer

        step = preflight.effective_load_step(self.cfg)
        error = None
        try:
            loaded = self.checkpointer.load(step=step)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, (SystemExit, KeyboardInterrupt)):
                raise
            error, loaded = e, False
        if collectives.any_true(error is not None):
            line = self._load_failure(step, error) if self.rank == 0 else None
            line = collectives.broadcast_object(line, src=0)
            if line is None:  # not one of our checkpoints (an initial_load_path): its own error
                raise error if error is not None else RuntimeError("checkpoint load failed on another rank")
            raise ConfigError(line) from error
        if loaded and step >= 0 and self.rank == 0:
            folder = preflight.checkpoint_folder(self.cfg)
            aside = abandon_newer(folder, step)
            if aside:
                logger.warning("checkpoint: resumed from step-%d (--checkpoint.load_step): the newer steps of the "
                               "abandoned history are set aside as %s; a plain rerun now resumes this branch", step,
                               ", ".join(os.path.basename(p) for p in aside))
        return loaded

    def _load_failure(self, step: int, error: BaseException | None) -> str | None:
        """The one line for a failed checkpoint load (rank 0), None when it was not a ``step-N`` of ours."""
        from ..config import checksums
        from .failures import describe

        folder = preflight.checkpoint_folder(self.cfg)
        step = step if step >= 0 else preflight.latest_complete_step(folder)
        if step < 0:
            return None
        path = os.path.join(folder, f"step-{step}")
        why = checksums.first_mismatch(path, full=True)
        cause = why or (describe(error) if error is not None else "it failed on another rank")
        return f"[checkpoint] folder: cannot load {path}: {cause}; {preflight.older_step_hint(folder, step)}"

    def _check_loaded_weights(self) -> None:
        """Loaded weights (HF folder or checkpoint) are finite, else every rank stops naming the tensors and the
        source: a ``ConfigError`` before any step. Cost: one pass over this rank's shards, once per load."""
        bad = non_finite_tensors(self.model.named_parameters())
        if not collectives.any_true(bool(bad)):
            return
        names = sorted({n for names in collectives.all_gather_objects(bad) for n in names})
        step = preflight.effective_load_step(self.cfg)
        step = step if step >= 0 else preflight.latest_complete_step(preflight.checkpoint_folder(self.cfg))
        source = (f"[checkpoint] folder: {preflight.checkpoint_folder(self.cfg)}/step-{step}" if step >= 0
                  else f"[model] hf_assets_path: {self.hf_path}")
        more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
        raise ConfigError(f"{source}: the loaded weights hold NaN or inf values: {', '.join(names[:3])}{more}")

    def _after_load(self) -> None:
        """Keep the saved LR schedule when ``training.steps`` was extended (see README, Checkpointing)."""
        if self.lr_schedule_steps != self.optimizer_steps():
            components.set_schedule_length(self.cfg, self.lr_schedulers, self.lr_schedule_steps)
            if self.rank == 0:
                logger.info(
                    "resumed at step %d with %d optimizer steps planned (was %d): the LR schedule keeps its saved "
                    "length %d, steps past its end run at its final LR", self.step, self.optimizer_steps(),
                    self.lr_schedule_steps, self.lr_schedule_steps,
                )

    # -- the schedule ----------------------------------------------------------
    def build_step(self, step: int) -> list[MicroStep]:
        """The whole micro-step schedule of ``step`` for this rank, known before it runs."""
        t = self.cfg.training
        if self.dataset is not None:
            n = t.local_batch_size * self.resolved.dp_degree
            return [
                MicroStep(step=step, index=m, batch=self.dataset.sft_batch(
                    self.dataset.take(n, self.dp_rank, self.resolved.dp_degree), self.tokenizer.pad_id, t.seq_len))
                for m in range(self.resolved.micro_steps)
            ]
        return [
            MicroStep(
                step=step,
                index=m,
                batch=_host_batch(
                    self.task, self.tokenizer, seed=self.cfg.job.seed, step=step, micro_step=m,
                    dp_rank=self.dp_rank, batch_size=t.local_batch_size, seq_len=t.seq_len,
                ),
            )
            for m in range(self.resolved.micro_steps)
        ]

    def run_micro_step(self, micro: MicroStep, loss_denominator: float) -> torch.Tensor:
        """Forward + backward of one micro-step; returns its summed token loss (detached)."""
        d = upload({"inputs": micro.batch.inputs_BL, "labels": micro.batch.labels_BL}, self.device)
        inputs, labels = d["inputs"], d["labels"]
        loss_sum = token_loss_sum(self.model(inputs), labels)
        (loss_sum / loss_denominator).backward()
        return loss_sum.detach()

    def log_micro_step_balance(self) -> float:
        """Measured EP balance of the micro-step that just ran (TensorBoard); returns max/mean."""
        return self.log_micro_step_balances([take_tokens_per_expert(self.model)])[0]

    def log_micro_step_balances(self, tokens_NLE: list[torch.Tensor]) -> list[float]:
        """Measured EP balance of micro-steps run before (``take_tokens_per_expert`` of each, on the device):
        one all-reduce and one read for all of them (TensorBoard); returns each max/mean."""
        every = dev.to_host(group_tokens_per_expert(torch.stack(tokens_NLE), self.ep_group))
        out = []
        for tokens_LE in every:
            metrics = micro_step_balance_metrics(tokens_LE, self.resolved.ep,
                                                 per_expert=self.cfg.metrics.tokens_per_expert)
            self.metric_logger.log(metrics, self.micro_steps_done)
            self.micro_steps_done += 1
            out.append(metrics["balance/max_over_mean"])
        return out

    def optimizer_step(self, loss: float) -> float:
        """Clip, step the optimizer and the LR schedule; returns the grad norm.

        ``loss`` is the step's global loss. A non-finite loss or grad norm stops the job
        before the weights change, or skips this update (``[training] nonfinite``).
        """
        self.watchdog.phase(f"step {self.step + 1} optimizer step")
        grad_norm = dist_utils.clip_grad_norm_(
            [p for p in self.model.parameters()], self.cfg.training.max_norm,
            foreach=True, ep_enabled=self.parallel_dims.ep_enabled,
        )
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        problem = non_finite(self.step + 1, loss=loss, grad_norm=grad_norm)
        if problem is not None:
            if self.cfg.training.nonfinite == "stop":
                raise NonFiniteError(
                    f"{problem}: stopped before the optimizer step, nothing saved "
                    "([training] nonfinite = 'skip' drops such updates instead)"
                )
            self.optimizers.zero_grad()
            self.skipped_updates += 1
            self.skips_in_a_row += 1
            bound = self.cfg.training.nonfinite_max_skips
            if bound and self.skips_in_a_row >= bound:
                raise NonFiniteError(
                    f"{problem}: {self.skips_in_a_row} updates in a row skipped, the model has stopped training: "
                    f"stopped ([training] nonfinite_max_skips = {bound}); the latest checkpoint is the last state"
                )
            if self.rank == 0:
                logger.warning("%s: update skipped ([training] nonfinite = 'skip'; %d in a row)", problem,
                               self.skips_in_a_row)
            return grad_norm
        self.skips_in_a_row = 0
        self.optimizers.step()
        self.lr_schedulers.step()
        return grad_norm

    def train_step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        schedule = self.build_step(step)
        local_tokens = torch.tensor(float(sum(m.batch.num_label_tokens for m in schedule)))
        collectives.all_reduce(local_tokens)
        denominator = max(float(local_tokens), 1.0)

        self.optimizers.zero_grad()
        loss_sum = torch.zeros(())
        balance_rows = []
        for micro in schedule:
            self.watchdog.phase(f"step {step + 1} micro-step {micro.index}")
            loss_sum += self.run_micro_step(micro, denominator).cpu()
            balance_rows.append(self.log_micro_step_balance())
        collectives.all_reduce(loss_sum)
        grad_norm = self.optimizer_step(float(loss_sum) / denominator)

        step_time = time.perf_counter() - start
        input_tokens = torch.tensor(float(sum(int((m.batch.inputs_BL != self.tokenizer.pad_id).sum()) for m in schedule)))
        collectives.all_reduce(input_tokens)
        mem = torch.tensor(peak_memory_gib(self.device))
        collectives.all_reduce(mem, collectives.ReduceOp.MAX)
        out = {
            "loss": float(loss_sum) / denominator,
            "grad_norm": grad_norm,
            "lr": self.lr_schedulers.schedulers[0].get_last_lr()[0],
            "step_time_s": step_time,
            "tokens_per_s": float(input_tokens) / step_time,
            "peak_memory_gib": float(mem),
            "balance/step_mean_max_over_mean": sum(balance_rows) / len(balance_rows),
        }
        self.metric_logger.log({f"train/{k}" if "/" not in k else k: v for k, v in out.items()}, step)
        return out

    def run_job_step(self, step: int) -> dict[str, float]:
        return self.train_step(step)

    def log_step(self, out: dict[str, float]) -> None:
        logger.info(
            "step %3d  loss %.4f  grad_norm %.3f  lr %.2e  %.0f tok/s  step %.2fs  EP max/mean %.3f  peak mem %.2f GiB",
            self.step, out["loss"], out["grad_norm"], out["lr"], out["tokens_per_s"],
            out["step_time_s"], out["balance/step_mean_max_over_mean"], out["peak_memory_gib"],
        )

    def train(self) -> dict | None:
        """Run (or resume) the job; None when the checkpoint says it already finished."""
        self.watchdog.phase("checkpoint load")
        if self.finished is not None:
            if self.rank == 0:
                logger.info("%s", self.finished)
                done = complete_finished_job(self.cfg, self.resolved)  # killed before it wrote summary.json
                if done:
                    logger.info("%s", done)
            return None
        if self._load_checkpoint():
            self._check_loaded_weights()
            self._after_load()
        cfg, last = self.cfg, self.job_steps()
        first = self.step
        while self.step < last:
            self.watchdog.phase(f"step {self.step + 1}")
            out = self.run_job_step(self.step)
            self.step += 1
            if self.step == first + 1:
                self.watchdog.timeout_s = cfg.comm.train_timeout_seconds
                if self.parallel_dims.world_size > 1:
                    parallelize.set_train_timeouts(cfg, self.parallel_dims)
            for k, v in out.items():
                self.history.setdefault(k, []).append(v)
            self.history["max_over_mean"].append(out["balance/step_mean_max_over_mean"])
            if self.rank == 0 and (self.step % cfg.metrics.log_freq == 0 or self.step in (1, last)):
                self.log_step(out)
            self.watchdog.phase(f"step {self.step} checkpoint save")
            self._save_checkpoint(last)
            if cfg.checkpoint.save_on_signal and self.step < last:
                self._stop_if_signalled(last)
        self.watchdog.phase("summary")
        return self.summary()

    def _stop_if_signalled(self, last: int) -> None:
        """``[checkpoint] save_on_signal``: when any rank got a stop signal, every rank saves the step just
        finished (if the interval did not) and stops (``StopRequested``). One 8-byte all-reduce per step."""
        from ..distributed.stop_signals import StopRequested, requested

        if not collectives.any_true(requested() is not None):
            return
        self.watchdog.phase(f"step {self.step} checkpoint save (stop signal)")
        if not self.checkpointer._should_save(self.step):
            interval, self.checkpointer.interval = self.checkpointer.interval, 1  # torchtitan has no forced save
            try:
                self._save_checkpoint(last, hf_files=False)
            finally:
                self.checkpointer.interval = interval
        self.checkpointer.maybe_wait_for_saving()
        raise StopRequested(requested() or signal.SIGTERM)

    def _save_checkpoint(self, last: int, hf_files: bool = True) -> None:
        """Save ``self.step`` when the interval (or the last step) says so: through ``step-N.saving``, renamed to
        ``step-N`` once every rank's files and checksums are written (``checkpoints.py``)."""
        step = self.step
        if not self.checkpointer._should_save(step, last_step=step == last):
            return
        self.checkpointer.begin(step)
        try:
            with self._checkpoint_layout(step, last):
                self._save_model_facts(step, last)
                self._save_side_state(step, last)
                self.checkpointer.save(step, last_step=step == last)
                if hf_files:
                    self._hf_side_files(step, last)
        except BaseException:
            self.checkpointer.abort()
            raise
        self.checkpointer.commit(step)

    def _checkpoint_layout(self, step: int, last: int):
        """The context in which a checkpoint reads the model (RL: experts back in logical order)."""
        return nullcontext()

    def _save_model_facts(self, step: int, last: int) -> None:
        """Rank 0 writes ``step-N/model_facts.json`` (top_k, head counts...: what DCP's ``.metadata`` lacks) before
        a step is saved, so the pre-flight of a resume can compare them (``preflight.facts_problem``)."""
        if self.rank != 0 or not self.checkpointer._should_save(step, last_step=step == last):
            return
        folder = self.checkpointer.step_folder(step)
        preflight.write_model_facts(folder, preflight.model_facts(self.model_args),
                                    preflight.dataset_facts(self.dataset) if self.dataset is not None else None)

    def _save_side_state(self, step: int, last: int) -> None:
        """Per-rank state a checkpoint keeps beside DCP's (``RLTrainer``: the next step's rollout rows)."""

    def _hf_side_files(self, step: int, last: int) -> None:
        """With ``last_save_in_hf``: complete the final HF folder; interval checkpoints get an ``hf/`` copy."""
        c = self.cfg.checkpoint
        if not (c.enable and c.last_save_in_hf):
            return
        from torchtitan.config import TORCH_DTYPE_MAP

        from .hf_export import copy_side_files, export_hf

        folder = self.checkpointer.step_folder(step)
        if step == last:
            copy_side_files(self.hf_path, folder)
        elif step % c.interval == 0:
            export_hf(self.checkpointer, os.path.join(folder, "hf"), self.hf_path, TORCH_DTYPE_MAP[c.export_dtype])

    def summary(self) -> dict:
        summary = summary_record(self.cfg, self.resolved, step=self.step, tb_dir=self.tb_dir,
                                 skipped=self.skipped_updates, history=self.history)
        if self.rank == 0:
            write_summary(self.cfg, summary)
        return summary

    def close(self) -> None:
        if self.cfg.debug.check_streams and dev.backend() is self.device_backend:
            self.device_backend.__exit__(None, None, None)
            dev.set_backend(dev.Plain())
            if self.rank == 0:
                logger.info("check_streams: finished; host syncs and findings outside strict regions, by kind: %s",
                            self.device_backend.summary())
                logger.info("check_streams: %s", self.device_backend.issue_order.describe())
                mixed = {f"{kind} @ {site}": n for (kind, site), n in self.device_backend.counts.items()
                         if kind.startswith("host tensor")}
                if mixed:  # on CUDA each raises unless that tensor is made on the device there
                    logger.warning("check_streams: host tensors in device ops: %s", mixed)
        self.watchdog.close()
        self.metric_logger.close()
        self.checkpointer.close()
        if self.folder_lock is not None:
            self.folder_lock.release()


def _host_batch(*args, **kwargs):
    """A supervised micro-batch, built on the host (uploaded by ``run_micro_step``)."""
    with dev.host_code():
        return sft_micro_batch(*args, **kwargs)
