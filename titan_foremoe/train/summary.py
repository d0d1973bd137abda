"""``DUMP/summary.json``: the job's history in one file, written at the end, and on a rerun that finds it missing.

A job killed after its final checkpoint and before ``summary.json`` was "already finished" on every rerun and never
wrote it (issue 31). The summary is built from what the final checkpoint holds (``train_state``: step, skipped
updates, the per-step history), so the pre-flight (or rank 0 of a direct ``torchrun``) that finds the job finished
writes it from the checkpoint alone, the same fields the finished job would have written.

Cost: at the end, one JSON file; on such a rerun, one read of the checkpoint's small ``train_state`` entries.
"""

from __future__ import annotations

import json
import logging
import os
import warnings

logger = logging.getLogger("titan_foremoe")
SUMMARY_FILE = "summary.json"


def summary_record(cfg, resolved, *, step: int, tb_dir: str | None, skipped: int, history: dict) -> dict:
    all_times = history.get("step_time_s", [])
    times = all_times[1:] or all_times
    return {
        "job": cfg.job.name,
        "steps": step,
        "world_size": resolved.world_size,
        "ep": resolved.ep,
        "micro_steps": resolved.micro_steps,
        "tb_dir": tb_dir,
        "median_step_time_s_after_first": sorted(times)[len(times) // 2] if times else None,
        "peak_memory_gib_max_rank": max(history.get("peak_memory_gib", [0.0])),
        "nonfinite_skipped_updates": skipped,
        **history,
    }


def write_summary(cfg, summary: dict) -> str | None:
    """Write it (atomically); a full or read-only disk must not fail a finished job. Returns the path, or None."""
    path = os.path.join(cfg.job.dump_folder, SUMMARY_FILE)
    try:
        os.makedirs(cfg.job.dump_folder, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(path + ".tmp", path)
        return path
    except OSError as e:
        from .failures import describe_os_error

        logger.error("summary: cannot write %s: %s; the job itself finished", path, describe_os_error(e))
        return None


def _newest_tb_dir(cfg) -> str | None:
    folder = os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder)
    runs = sorted(os.listdir(folder)) if cfg.metrics.enable_tensorboard and os.path.isdir(folder) else []
    return os.path.join(folder, runs[-1]) if runs else None


def summary_from_checkpoint(cfg, resolved, path: str) -> dict:
    """The summary a job would have written, from its checkpoint ``path`` (``train_state``) in this process."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load

    state = {"train_state": {"step": torch.tensor(0), "skipped_updates": torch.tensor(0), "history": ""}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore")
        load(state, storage_reader=FileSystemReader(path))
    t = state["train_state"]
    return summary_record(cfg, resolved, step=int(t["step"]), tb_dir=_newest_tb_dir(cfg),
                          skipped=int(t["skipped_updates"]), history=json.loads(t["history"]))


def complete_finished_job(cfg, resolved) -> str | None:
    """For a job found finished: write its missing ``summary.json`` from the final checkpoint. Returns a line
    saying so, or None (the summary is there, or the final checkpoint is a model-only export)."""
    from ..config.preflight import checkpoint_folder, checkpoint_keys, latest_complete_step

    if os.path.exists(os.path.join(cfg.job.dump_folder, SUMMARY_FILE)):
        return None
    step = latest_complete_step(checkpoint_folder(cfg))
    path = os.path.join(checkpoint_folder(cfg), f"step-{step}")
    if step < 0 or "train_state.history" not in checkpoint_keys(path):
        return None
    try:
        summary = summary_from_checkpoint(cfg, resolved, path)
    except Exception as e:  # the job is finished all the same: say why there is no summary, do not fail
        return f"summary: {cfg.job.dump_folder}/{SUMMARY_FILE} is missing and cannot be rebuilt from {path} ({e})"
    written = write_summary(cfg, summary)
    return f"summary: {written} was missing; written from {path}" if written else None
