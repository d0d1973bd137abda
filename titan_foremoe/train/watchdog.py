"""Which rank is stuck, and where: a phase marker and a watchdog thread.

The trainer names what it is doing (``watchdog.phase("step 3 update micro-step 1")``);
a daemon thread reports, once per phase, a phase that has not changed for half of
``timeout_s`` (``[comm] train_timeout_seconds``: early enough to be printed before the
collective's own timeout ends the job), with the ``torch.distributed`` collective the
main thread is blocked in (read from its Python stack; gloo and NCCL release the GIL
while they wait). It only reports; ``describe(exc)`` names the phase and the
collective in the error that ends the job.

Cost: one attribute write per phase change on the main thread, one wake-up per
``poll_s`` on the side thread; nothing crosses ranks.
"""

from __future__ import annotations

import os
import sys
import threading
import time

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


class Watchdog:
    def __init__(self, rank: int, timeout_s: float, poll_s: float = 0.25, log=None) -> None:
        self.rank = rank
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

    def collective(self) -> str | None:
        frame = sys._current_frames().get(self._main)
        return collective_in(frame) if frame is not None else None

    def _run(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            stalled = time.monotonic() - self._since
            if not self._reported and stalled > self.timeout_s / 2:
                self._reported = True
                self._log(f"watchdog: rank {self.rank} has made no progress for {stalled:.1f} s "
                          f"(collective timeout {self.timeout_s:g} s): {self.describe()}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
