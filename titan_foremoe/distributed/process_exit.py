"""Leave a process without the interpreter's teardown: the abort at exit.

CPython 3.11 ends a daemon thread that takes the GIL back after finalization has begun with ``pthread_exit``.
Inside a pybind11 call that released the GIL (a ``TCPStore`` get or set: torchrun's rendezvous keep-alive, which
torchrun leaves running after a stop signal, or a rank's heartbeat) the forced unwind crosses a ``noexcept``
destructor and ``std::terminate`` aborts the process: "terminate called without an active exception", exit -6
instead of the code the process chose (a finished job, or a stop's 143, read as a crash; CI saw both). The
launcher and the workers have nothing left to tear down once their entry point has returned (process groups
destroyed, writers and checkpointer closed, the dump folder's lock released), so they flush what Python would
flush and end with ``os._exit`` while a daemon thread is alive; with none (``--help``, a config error before any
thread started) they exit as Python does, so a caller that runs them in its own interpreter (``runpy``) keeps it.

Cost: nothing per step; at exit one flush of the logging handlers and of stdout / stderr.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn


def exit_code(value) -> int:
    """``sys.exit``'s rule: None is 0, an int is itself, anything else is printed to stderr and is 1."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def exit_now(code: int) -> NoReturn:
    """Flush the logging handlers' streams, stdout and stderr, and end the process with ``code`` at once. The
    streams are flushed without the handlers' locks (``logging.shutdown`` takes each): a daemon thread left inside
    a log call may hold one for good."""
    for ref in list(getattr(logging, "_handlerList", ())):
        handler = ref() if callable(ref) else ref
        try:
            handler.stream.flush()
        except Exception:  # no stream, or one that is gone: nothing to keep
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe
            pass
    os._exit(code)


def daemon_threads() -> list[str]:
    """The names of this process's live daemon threads (those Python's teardown would leave inside a call)."""
    return [t.name for t in threading.enumerate() if t.daemon and t.is_alive()]


def run_and_exit(main: Callable[..., object], *args) -> NoReturn:
    """``sys.exit(main(*args))``, without the interpreter's teardown while a daemon thread is alive: an uncaught
    exception prints its traceback and exits 1, as Python would."""
    try:
        code = exit_code(main(*args))
    except SystemExit as e:
        code = exit_code(e.code)
    except BaseException:  # noqa: BLE001 - Python's own last resort, then the exit without teardown
        traceback.print_exc()
        code = 1
    if not daemon_threads():
        sys.exit(code)  # nothing to abort the teardown
    exit_now(code)
