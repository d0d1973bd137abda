"""torchtitan components (optimizer, LR schedule, checkpointer, TensorBoard) from our config."""

from __future__ import annotations

import os
from datetime import datetime

import torch
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.metrics import BaseLogger, TensorBoardLogger
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

from ..config.job_config import JobConfig


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


def build_lr_schedulers(cfg: JobConfig, optimizers: OptimizersContainer, steps: int) -> LRSchedulersContainer:
    s = cfg.lr_scheduler
    return LRSchedulersContainer.Config(
        warmup_steps=min(s.warmup_steps, steps),
        decay_ratio=s.decay_ratio,
        decay_type=s.decay_type,
        min_lr_factor=s.min_lr_factor,
    ).build(optimizers=optimizers, training_steps=steps)


def build_checkpointer(cfg: JobConfig, model, optimizers, lr_schedulers, train_state,
                       extra_states: dict | None = None, sd_adapter=None) -> CheckpointManager:
    """torchtitan's checkpointer; ``extra_states`` (e.g. the dataset position) are saved and restored
    with the train state; ``sd_adapter`` maps our names to HF's for ``initial_load_in_hf`` / ``last_save_in_hf``."""
    c = cfg.checkpoint
    initial = c.initial_load_path
    if initial and not os.path.isabs(initial):
        initial = os.path.abspath(initial)  # torchtitan wants an absolute path
    return CheckpointManager.Config(
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
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state, **(extra_states or {})},
        sd_adapter=sd_adapter,
        base_folder=cfg.job.dump_folder,
    )


def build_metric_logger(cfg: JobConfig, rank: int) -> tuple[BaseLogger, str | None]:
    """torchtitan's TensorBoard logger on rank 0, in ``dump_folder/tb/<timestamp>``."""
    if not cfg.metrics.enable_tensorboard or rank != 0:
        return BaseLogger(), None
    log_dir = os.path.join(
        cfg.job.dump_folder, cfg.metrics.save_tb_folder, datetime.now().strftime("%Y%m%d-%H%M%S")
    )
    return TensorBoardLogger(log_dir), log_dir
