"""Which rank is stuck, and where: a phase marker and a watchdog thread.

The trainer names what it is doing (``watchdog.phase("step 3 update micro-step 1")``);
a daemon thread reports, once per phase, a phase that has not changed for half of
``timeout_s`` (``[comm] train_timeout_seconds``: early enough to be printed before the
collective's own timeout ends the job), with the ``torch.distributed`` collective the
main thread is blocked in (read from its Python stack; gloo and NCCL release the GIL
while they wait). It only reports; ``describe(exc)`` names the phase and the
collective in the error that ends the job.

With a store (``attach``: the job's rendezvous store), the side thread posts this rank's heartbeat every
``beat_s``: its phase, how long it has been in it, the collective it waits in (or the line it runs), and the
wall time, its host and pid. A rank that times out in a collective reads the others' (``late_ranks``) and names
those that are not waiting with it: ``rank 1 stuck in 'step 2 rollout' (at faults.py:47 hang) for 60 s``, dead
(its process on this host is gone), or silent (its heartbeats stopped for longer than one period plus a margin
while the store still answers: dead on another host, frozen or stopped), instead of blaming itself. The store is
the rendezvous store itself (not the process group's prefix of it), so that the launcher can read a killed
worker's last phase (``distributed/worker_exits.py``).

Cost: one attribute write per phase change on the main thread, one wake-up per ``poll_s`` on the side thread;
one ~190-byte store ``set`` per rank per ``beat_s`` (5 s: 205 sets/s on the store host at 1024 ranks), none
per micro-step or phase change; on a failure, one ``multi_get`` of every rank's heartbeat (bounded to 10 s).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

_KEY = "titan_foremoe/heartbeat/"

_DIST_DIR = os.sep + os.path.join("torch", "distributed") + os.sep
# frames between a c10d call and the code that asked for it: decorators, and our metadata-collectives helper
_PASS_THROUGH = ("typing_extensions.py", "functools.py", os.path.join("distributed", "collectives.py"))


def collective_in(frame) -> str | None:
    """The ``torch.distributed`` collective a stack is blocked in (``all_reduce``...), with our caller."""
    found = caller = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.endswith("distributed_c10d.py"):
            found, caller = frame.f_code.co_name, None  # keep the outermost c10d frame
        elif found is not None and caller is None and _DIST_DIR not in path and not path.endswith(_PASS_THROUGH):
            caller = f"{os.path.basename(path)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    if found is None:
        return None
    return f"{found} (called from {caller})" if caller else found


def raised_in(exc: BaseException) -> str | None:
    """The collective an exception was raised in (its traceback's innermost frame, walked outwards)."""
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return collective_in(tb.tb_frame)


def innermost(frame) -> str | None:
    """The line a stack runs now (``file.py:12 function``), for a rank that is not in a collective; the frames of
    this module (a heartbeat posted from the main thread) are not the trainer's."""
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return None
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"


def silent_after(beat_s: float) -> float:
    """Heartbeats missing for longer than this mean a rank is gone: one period, plus a margin for the side thread's
    poll and a loaded host (the heartbeat of a live rank comes every ``beat_s``)."""
    return beat_s + max(1.0, 0.5 * beat_s)


def process_gone(beat: dict) -> bool:
    """The rank's process ran on this host and no longer exists (a rank on another host cannot be checked)."""
    if beat.get("host") != socket.gethostname() or not beat.get("pid"):
        return False
    try:
        os.kill(int(beat["pid"]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def late_lines(beats: dict[int, dict], now: float, beat_s: float, me: int) -> list[str]:
    """The ranks a rank that waits in a collective is waiting for, in words: those dead (process gone), silent
    (no heartbeat for ``silent_after``: dead elsewhere, frozen or stopped), and those alive in a phase that is
    not a collective (running something else)."""
    out = []
    for rank, b in sorted(beats.items()):
        if rank == me:
            continue
        age = now - b["wall"]
        in_phase = b["in_phase_s"] + age
        if process_gone(b):
            out.append(f"rank {rank} died (its process {b['pid']} on this host is gone; last heartbeat {age:.0f} s "
                       f"ago, in '{b['phase']}')")
        elif age > silent_after(beat_s):
            out.append(f"rank {rank} silent for {age:.0f} s (frozen, stopped or dead; last seen in "
                       f"'{b['phase']}' for {b['in_phase_s']:.0f} s)")
        elif not b.get("collective"):
            at = f" (at {b['at']})" if b.get("at") else ""
            out.append(f"rank {rank} stuck in '{b['phase']}'{at} for {in_phase:.0f} s")
    return out


class Watchdog:
    def __init__(self, rank: int, timeout_s: float, poll_s: float = 0.25, log=None) -> None:
        self.rank = rank
        self._store = None
        self._world = 1
        self.beat_s = 5.0
        self._beat_at = 0.0
        self.timeout_s = timeout_s
        self._phase = "start-up"
        self._since = time.monotonic()
        self._reported = False
        self._main = threading.main_thread().ident
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(poll_s,), name="foremoe-watchdog", daemon=True)
        self._thread.start()

    def phase(self, name: str) -> None:
        self._phase, self._since, self._reported = name, time.monotonic(), False

    def describe(self, exc: BaseException | None = None) -> str:
        """The phase, and the collective the main thread is in (or ``exc`` was raised in)."""
        where = self.collective() if exc is None else raised_in(exc)
        return f"phase '{self._phase}'" + (f", in collective {where}" if where else "")

    @staticmethod
    def raised_in_collective(exc: BaseException) -> bool:
        """``exc`` came out of a collective (a timeout, a peer gone), or says it timed out."""
        return raised_in(exc) is not None or "timed out" in str(exc).lower() or "timeout" in str(exc).lower()

    def collective(self) -> str | None:
        frame = sys._current_frames().get(self._main)
        return collective_in(frame) if frame is not None else None

    def attach(self, store, world_size: int) -> None:
        """Post heartbeats to ``store`` (every rank's; a process group's prefix store is unwrapped to the
        rendezvous store), and read them on a failure; the first one now."""
        while hasattr(store, "underlying_store") and store.underlying_store is not None:
            store = store.underlying_store
        self._store, self._world = store, world_size
        self.beat()

    def beat(self) -> None:
        """This rank's heartbeat (from the side thread; a store that went away is not this rank's failure)."""
        frame = sys._current_frames().get(self._main)
        collective = collective_in(frame) if frame is not None else None
        value = {"phase": self._phase, "in_phase_s": round(time.monotonic() - self._since, 1),
                 "wall": time.time(), "collective": collective, "at": None if collective else innermost(frame),
                 "host": socket.gethostname(), "pid": os.getpid()}
        try:
            self._store.set(f"{_KEY}{self.rank}", json.dumps(value))
        except Exception:
            pass
        self._beat_at = time.monotonic()

    def late_ranks(self, wait_s: float = 10.0) -> list[str]:
        """The ranks this one waits for (``late_lines``), read from the store; [] without one or when it does
        not answer within ``wait_s``."""
        if self._store is None or self._world <= 1:
            return []
        found: list = []

        def read() -> None:
            values = self._store.multi_get([f"{_KEY}{r}" for r in range(self._world)])
            found.append({r: json.loads(v) for r, v in enumerate(values)})

        reader = threading.Thread(target=read, daemon=True, name="foremoe-watchdog-read")
        reader.start()
        reader.join(wait_s)
        return late_lines(found[0], time.time(), self.interval(), self.rank) if found else []

    def interval(self) -> float:
        """Seconds between heartbeats: ``beat_s``, or a quarter of a shorter collective timeout."""
        return min(self.beat_s, self.timeout_s / 4)

    def _run(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            stalled = time.monotonic() - self._since
            if self._store is not None and time.monotonic() - self._beat_at >= self.interval():
                self.beat()
            if not self._reported and stalled > self.timeout_s / 2:
                self._reported = True
                late = self.late_ranks(wait_s=2.0) if self.collective() else []
                self._log(f"watchdog: rank {self.rank} has made no progress for {stalled:.1f} s "
                          f"(collective timeout {self.timeout_s:g} s): {self.describe()}"
                          + (f"; waiting for {'; '.join(late[:4])}" if late else ""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
