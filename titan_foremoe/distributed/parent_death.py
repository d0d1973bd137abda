"""Workers that die with their launcher (issue 31).

torchrun starts each worker in a session of its own, so when its agent (the launcher) is killed with SIGKILL
nothing reaches the workers: they trained on unsupervised, writing checkpoints beside a requeued job. Linux's
``PR_SET_PDEATHSIG`` has the kernel signal a process when its parent dies; the worker entry point asks for it
first thing, and checks that the launcher it was started by (``LAUNCHER_PID_ENV``, set by the launcher) did not
die before the request. Not Linux, or no libc: nothing is done (False).

Cost: one ``prctl`` call per process at start; nothing afterwards.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

LAUNCHER_PID_ENV = "TITAN_FOREMOE_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel for ``sig`` when the parent (the thread that started this process) dies."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_launcher(sig: int = signal.SIGKILL) -> bool:
    """In a worker: end with the launcher. SIGKILL by default: a worker blocked in a collective cannot run a
    handler, and a checkpoint cut short is never loaded (no ``.metadata``). Exits at once (code 1, one line)
    when the launcher is already gone."""
    armed = set_parent_death_signal(sig)
    expected = os.environ.get(LAUNCHER_PID_ENV)
    if armed and expected and expected.isdigit() and os.getppid() != int(expected):
        print(f"worker {os.getpid()}: its launcher (pid {expected}) is gone; stopping", file=sys.stderr, flush=True)
        os._exit(1)
    return armed


def dying_with_this_process(sig: int = signal.SIGTERM):
    """``preexec_fn`` for a ``Popen`` whose child must end with this process (the trainer's vLLM server: SIGTERM,
    its graceful shutdown, which stops its own engine processes). None off the main thread: the signal follows
    the thread that started the child, and a worker thread's exit would end it."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    return lambda: set_parent_death_signal(sig)
