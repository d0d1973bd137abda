"""Worker entry point: ``torchrun ... -m titan_foremoe.train --job.config_file FILE [--section.key=value ...]``."""

from __future__ import annotations

import logging
import os
import sys

import torchtitan_patches
from torch.distributed.elastic.multiprocessing.errors import record


def split_config_file(argv: list[str]) -> tuple[str | None, list[str]]:
    path, rest, i = None, [], 0
    while i < len(argv):
        if argv[i] == "--job.config_file":
            path = argv[i + 1] if i + 1 < len(argv) else None
            i += 2
            continue
        if argv[i].startswith("--job.config_file="):
            path = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return path, rest


def _rank() -> str:
    return os.environ.get("RANK", "?")


def _fail(line: str, show: bool = True) -> int:
    """Print a worker's one line (``show``), leave it for the launcher, exit 2."""
    from .failures import record_line

    if show:
        print(line, file=sys.stderr, flush=True)
    record_line(line)
    return 2


@record  # torchelastic writes this rank's exception to its error file: torchrun prints the root cause, any rank
def main(argv: list[str]) -> int:
    from ..distributed.parent_death import die_with_launcher
    from ..distributed.stop_signals import StopRequested, finish_step_on_stop, quiet_worker_exit

    die_with_launcher()  # torchrun's workers run in sessions of their own: a killed launcher would leave them
    quiet_worker_exit()  # SIGTERM / SIGINT: exit 128 + signal, no traceback (the launcher says it in one line)
    from ..distributed.environment import problem

    if env := problem():  # a torchrun launch without run_train.sh's pre-flight: the versions in one line
        print(env, file=sys.stderr)
        return 2
    torchtitan_patches.apply_all()
    from torchtitan.tools.logging import init_logger

    from ..config import ConfigError, load_config

    init_logger()
    logging.getLogger("titan_foremoe").setLevel(logging.INFO)
    path, overrides = split_config_file(argv)
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        return _fail(f"config error: {e}")
    if cfg.checkpoint.save_on_signal:
        finish_step_on_stop()  # a stop signal ends the step and saves it first

    from ..distributed.agreement import DisagreementError
    from .failures import describe, is_exit, note_failure_time
    from ..rl.reward_check import RewardError
    from .guards import NonFiniteError
    from .rl_trainer import RLTrainer
    from .trainer import Trainer

    try:
        trainer = RLTrainer(cfg) if cfg.rl.enable else Trainer(cfg)
    except ConfigError as e:
        return _fail(f"config error: {e}")
    except DisagreementError as e:  # every rank has the same line: each node's first local rank says it
        import torch.distributed as dist

        code = _fail(f"error: {e}", show=dist.get_rank() == 0 or os.environ.get("LOCAL_RANK") == "0")
        dist.destroy_process_group()
        return code
    except BaseException as e:  # CheckpointException is a BaseException: @record would not see it
        if is_exit(e):
            raise
        note_failure_time()  # before this rank's teardown fails its peers: the launcher names the first in time
        raise RuntimeError(f"rank {_rank()} failed at start-up: {describe(e)}") from e
    try:
        trainer.train()
    except ConfigError as e:
        return _fail(f"config error: {e}")
    except StopRequested as e:  # every rank saved the step; the launcher says it in one line
        return 128 + e.sig
    except (NonFiniteError, RewardError) as e:  # every rank stops at the same step, with the same line
        return _fail(f"error: {e}", show=trainer.rank == 0)
    except BaseException as e:  # CheckpointException is a BaseException: @record would not see it
        if is_exit(e):
            raise
        note_failure_time()  # before trainer.close() and the group's teardown fail this rank's peers
        where = trainer.watchdog.describe(e)
        late = trainer.watchdog.late_ranks() if trainer.watchdog.raised_in_collective(e) else []
        late = f"{'; '.join(late[:4])}{' ...' if len(late) > 4 else ''}, so: " if late else ""  # who was late first
        raise RuntimeError(f"{late}rank {trainer.rank} failed in {where}: {describe(e)}") from e
    finally:
        trainer.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from ..distributed.process_exit import run_and_exit

    run_and_exit(main, sys.argv[1:])  # a daemon thread inside a store call must not abort the exit (process_exit.py)
