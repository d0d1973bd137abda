"""torchtitan components (optimizer, LR schedule, checkpointer, TensorBoard) from our config."""

from __future__ import annotations

import functools
import os
from datetime import datetime

import torch
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.metrics import BaseLogger, TensorBoardLogger
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

from ..config.job_config import JobConfig
from ..metrics.guarded import GuardedLogger
from .checkpoints import AtomicCheckpointManager


def build_optimizers(cfg: JobConfig, model: torch.nn.Module) -> OptimizersContainer:
    o = cfg.optimizer
    return OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=r".*",
                optimizer_name=o.name,
                optimizer_kwargs={
                    "lr": o.lr,
                    "betas": (o.beta1, o.beta2),
                    "eps": o.eps,
                    "weight_decay": o.weight_decay,
                },
            )
        ]
    ).build(model_parts=[model])


def _clamped(schedule, last: int, step: int) -> float:
    return schedule(min(step, last))


def lr_schedule(cfg: JobConfig, steps: int):
    """torchtitan's warmup / stable / decay factor over ``steps`` optimizer steps, held at its final value after.

    (torchtitan's lambda is not defined past its length: linear decay goes negative, cosine climbs back.)
    """
    s = cfg.lr_scheduler
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # the container needs an optimizer
    container = LRSchedulersContainer.Config(
        warmup_steps=min(s.warmup_steps, steps),
        decay_ratio=s.decay_ratio,
        decay_type=s.decay_type,
        min_lr_factor=s.min_lr_factor,
    ).build(optimizers=[probe], training_steps=steps)
    return functools.partial(_clamped, container.schedulers[0].lr_lambdas[0], steps)


def build_lr_schedulers(cfg: JobConfig, optimizers: OptimizersContainer, steps: int) -> LRSchedulersContainer:
    return LRSchedulersContainer(optimizers, lr_schedule(cfg, steps))


def set_schedule_length(cfg: JobConfig, lr_schedulers: LRSchedulersContainer, steps: int) -> None:
    """Give a built (and loaded) container the schedule of ``steps`` steps, the optimizers' LR included."""
    schedule = lr_schedule(cfg, steps)
    for scheduler in lr_schedulers.schedulers:
        scheduler.lr_lambdas = [schedule] * len(scheduler.lr_lambdas)
        scheduler._last_lr = [base * schedule(scheduler.last_epoch) for base in scheduler.base_lrs]
        for group, lr in zip(scheduler.optimizer.param_groups, scheduler._last_lr):
            group["lr"] = lr


def build_checkpointer(cfg: JobConfig, model, optimizers, lr_schedulers, states: dict,
                       sd_adapter=None, rank: int = 0) -> AtomicCheckpointManager:
    """torchtitan's DCP checkpointer; ``states``: our ``Stateful``s beside model / optimizer / LR schedule;
    ``sd_adapter`` maps our names to HF's for ``initial_load_in_hf`` / ``last_save_in_hf``; saves are atomic
    (``checkpoints.py``)."""
    c = cfg.checkpoint
    initial = c.initial_load_path
    if initial and not os.path.isabs(initial):
        initial = os.path.abspath(initial)  # torchtitan wants an absolute path
    config = CheckpointManager.Config(
        enable=c.enable,
        folder=c.folder,
        interval=c.interval,
        keep_latest_k=c.keep_latest_k,
        last_save_model_only=c.last_save_model_only,
        initial_load_path=initial or None,
        initial_load_model_only=True,
        initial_load_in_hf=c.initial_load_in_hf,
        last_save_in_hf=c.last_save_in_hf,
        export_dtype=c.export_dtype,
    )
    return AtomicCheckpointManager(
        config,
        rank=rank,
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states=states,
        sd_adapter=sd_adapter,
        base_folder=cfg.job.dump_folder,
    )


def build_metric_logger(cfg: JobConfig, rank: int, enable: bool = True) -> tuple[BaseLogger, str | None]:
    """torchtitan's TensorBoard logger on rank 0, in ``dump_folder/tb/<timestamp>``."""
    if not cfg.metrics.enable_tensorboard or rank != 0 or not enable:
        return BaseLogger(), None
    log_dir = os.path.join(
        cfg.job.dump_folder, cfg.metrics.save_tb_folder, datetime.now().strftime("%Y%m%d-%H%M%S")
    )
    return GuardedLogger(TensorBoardLogger(log_dir), log_dir), log_dir
