"""Fault injection for the recovery tests, as ``[rl] reward_fn`` hooks (``tests.faults:NAME``).

Each counts its calls in this process (one per completion scored) and acts at call
``FAULT_CALL`` on rank ``FAULT_RANK`` (every rank when unset), in the first attempt
of a torchrun job only (``TORCHELASTIC_RESTART_COUNT == 0``), then scores like the task.
"""

from __future__ import annotations

import os
import signal
import time

_calls = 0


def _due() -> bool:
    global _calls
    _calls += 1
    rank = os.environ.get("FAULT_RANK")
    return (
        _calls == int(os.environ["FAULT_CALL"])
        and (rank is None or rank == os.environ.get("RANK"))
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    )


def kill(task, example, completion: str) -> float:
    if _due():
        os.kill(os.getpid(), signal.SIGKILL)
    return task.reward(example, completion)


def crash(task, example, completion: str) -> float:
    """Rank ``FAULT_RANK`` waits ``FAULT_DELAY`` s (a heartbeat of its phase is posted) and kills itself with
    ``FAULT_SIGNAL`` (SIGKILL: the out-of-memory killer); the other ranks sleep ``FAULT_SLEEP`` s at the same call,
    in Python (not in a collective), so that torchrun's SIGTERM stops them: the bystanders of issue 46."""
    global _calls
    _calls += 1
    if _calls == int(os.environ["FAULT_CALL"]) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        if os.environ.get("RANK") == os.environ["FAULT_RANK"]:
            time.sleep(float(os.environ.get("FAULT_DELAY", "0")))
            os.kill(os.getpid(), getattr(signal, os.environ.get("FAULT_SIGNAL", "SIGKILL")))
        time.sleep(float(os.environ.get("FAULT_SLEEP", "60")))
    return task.reward(example, completion)


def nan(task, example, completion: str) -> float:
    if _due():
        return float("nan")
    return task.reward(example, completion)


def hang(task, example, completion: str) -> float:
    if _due():
        time.sleep(float(os.environ.get("FAULT_SLEEP", "60")))
    return task.reward(example, completion)


def values(task, example, completion: str):
    """``FAULT_VALUES="9=nan,17=3e38,5=None,6='1.0'"``: call N returns that value (None, a quoted string, or a
    float) instead of the task's reward; first attempt only."""
    global _calls
    _calls += 1
    given = dict(item.split("=", 1) for item in os.environ["FAULT_VALUES"].split(","))
    value = given.get(str(_calls))
    if value is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return task.reward(example, completion)
    if value == "None":
        return None
    return value.strip("'") if value.startswith("'") else float(value)


def score(task, example, completion: str) -> float:
    """Scores like the task; importing this module armed ``FAULT_SAVE_STEP`` (below)."""
    return task.reward(example, completion)


def _crash_in_save() -> None:
    """``FAULT_SAVE_STEP=N``: SIGKILL the rank that writes DCP's ``.metadata`` (rank 0) of the save of step N, after
    every rank wrote its shards: the worst point of a save (first attempt only)."""
    step = os.environ.get("FAULT_SAVE_STEP")
    if not step or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.finish

    def finish(self, *args, **kwargs):
        if os.path.basename(str(self.path)).split(".")[0] == f"step-{step}":
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kwargs)

    FileSystemWriter.finish = finish


_crash_in_save()
