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


def nan(task, example, completion: str) -> float:
    if _due():
        return float("nan")
    return task.reward(example, completion)


def hang(task, example, completion: str) -> float:
    if _due():
        time.sleep(float(os.environ.get("FAULT_SLEEP", "60")))
    return task.reward(example, completion)
