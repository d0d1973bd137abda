"""When each worker of this node exited, to the millisecond, its last phase and its stderr: what names a crash.

torchrun's ``ChildFailedError`` holds every failed worker with a timestamp in whole seconds (from its error file,
else the moment the agent read the exit). When one worker is SIGKILLed (the out-of-memory killer), its peers fail
in their next collective (an error file, exit 1) or are stopped by the agent's SIGTERM (exit 143), all within the
same second: the bystander could be named, and its 143 read as a scheduler's stop (issue 46). Here:

* ``ExitClock`` starts one thread per worker that waits for its exit (``Popen.wait``: the kernel wakes it when the
  worker dies; torchrun's ``poll`` still reads the exit code) and notes the wall time. With the moment a worker
  caught its own error (``failures.note_failure_time``) it orders the failures (``launch.root_failure``): the
  agent stops the others only after it has seen a failure, and a peer notices a dead worker only once it is gone.
* ``last_phase`` reads a worker's last heartbeat (``train/watchdog.py``: its trainer phase) from the workers'
  store (the agent's, shared with them; with ``MAX_RESTARTS`` their rank 0 hosts it, gone when rank 0 died), so
  that a worker killed without a word is named with its phase.
* ``keep_stderr`` copies the tail of every worker's stderr (torchrun's ``--tee`` files, kept in a temporary
  folder) to ``DUMP/worker_logs/rank-R.stderr``: the traceback of any rank, not only the one on the screen.

Cost: one thread per local worker (blocked in ``waitpid``), one store connection + ``check`` + ``get`` for the
failed worker, one copy of at most ``TAIL_BYTES`` per local worker when a worker fails; nothing per step.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field

TAIL_BYTES = 64 * 1024  # per worker: the last traceback and the lines before it
_HEARTBEAT = "titan_foremoe/heartbeat/"


@dataclass
class Worker:
    """One started worker: its global rank, its stderr file (torchrun's tee; "" when not kept) and its exit."""

    rank: int
    stderr: str = ""
    exitcode: int | None = None
    exited_at: float | None = None  # wall time, seconds (sub-millisecond)


@dataclass
class ExitClock:
    """Exit times of this node's workers (by pid), and the store they post their heartbeats to."""

    workers: dict[int, Worker] = field(default_factory=dict)
    store: tuple[str, int] | None = None  # the workers' store (MASTER_ADDR, MASTER_PORT): their heartbeats

    def install(self) -> "ExitClock":
        """Wrap torchrun's subprocess context: every worker started gets a waiting thread."""
        from torch.distributed.elastic.multiprocessing import api

        ctx = api.SubprocessContext
        start = ctx._start
        clock = self

        def _start(pcontext):
            start(pcontext)
            env = pcontext.envs.get(0, {})
            if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
                clock.store = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
            for local_rank, handler in pcontext.subprocess_handlers.items():
                clock.watch(handler.proc, int(pcontext.envs[local_rank].get("RANK", local_rank)),
                            str(pcontext.stderrs.get(local_rank) or ""))

        ctx._start = _start
        return self

    def watch(self, proc, rank: int, stderr: str = "") -> None:
        """Note ``proc``'s exit time from a thread that waits for it (torchrun's ``poll`` then reads the code)."""
        worker = self.workers[proc.pid] = Worker(rank, stderr)

        def wait() -> None:
            code = proc.wait()
            worker.exited_at, worker.exitcode = time.time(), code

        threading.Thread(target=wait, daemon=True, name=f"foremoe-exit-{rank}").start()

    def exited_at(self, pid: int) -> float | None:
        worker = self.workers.get(pid)
        return None if worker is None else worker.exited_at


def last_phase(endpoint: tuple[str, int] | None, rank: int, now: float | None = None,
               wait_s: float = 3.0) -> str | None:
    """The trainer phase of ``rank``'s last heartbeat in the workers' store (``endpoint``: their MASTER_ADDR and
    MASTER_PORT; ``train/watchdog.py`` posts there), in words; None when there is none (the store went with a dead
    rank 0, none posted yet)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    if endpoint is None:
        return None
    key = f"{_HEARTBEAT}{rank}"
    try:
        store = TCPStore(endpoint[0], endpoint[1], is_master=False, timeout=timedelta(seconds=wait_s),
                         wait_for_workers=False)
        if not store.check([key]):
            return None
        beat = json.loads(store.get(key))
        age = (now or time.time()) - float(beat["wall"])
        return f"in phase '{beat['phase']}' (its last heartbeat, {age:.1f} s before)"
    except Exception:  # the store went away, or a foreign value
        return None


def keep_stderr(clock: ExitClock, folder: str) -> dict[int, str]:
    """Copy the tail of every worker's stderr to ``folder/rank-R.stderr``; {rank: path} of those written (a worker
    without a tee file, or a folder that cannot be written, is left out)."""
    kept = {}
    for worker in clock.workers.values():
        if not worker.stderr or not os.path.isfile(worker.stderr):
            continue
        path = os.path.join(folder, f"rank-{worker.rank}.stderr")
        try:
            with open(worker.stderr, "rb") as src:
                src.seek(max(0, os.path.getsize(worker.stderr) - TAIL_BYTES))
                tail = src.read()
            os.makedirs(folder, exist_ok=True)
            with open(path, "wb") as dst:
                dst.write(tail)
            kept[worker.rank] = path
        except OSError:  # disk full, read-only: the line names torchrun's own file instead
            kept[worker.rank] = worker.stderr
    return kept
