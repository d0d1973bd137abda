"""Preemption ends in one line (issue 31): SIGTERM / SIGINT to the launcher or to a worker.

What Slurm sends before a kill (SIGTERM), or Ctrl-C (SIGINT) at the terminal, used to end in 12-60 lines: the
agent's warnings, its ``SignalException`` traceback, and a ``KeyboardInterrupt`` traceback from every worker
that torchrun forwarded the signal to. Now:

* a worker exits at once, silently, with ``128 + signal`` (``quiet_worker_exit``): a checkpoint cut short has no
  ``.metadata`` and is never loaded, so nothing is lost that a clean exit would keep; with ``[checkpoint]
  save_on_signal`` it first finishes the current step and saves it (``finish_step_on_stop``, ``StopRequested``);
* the launcher keeps torchrun's shutdown warnings and traceback out of the terminal, in ``DUMP/launch.log``
  (``ShutdownLog``), and prints one line (``stopped_line``): the signal, the last complete checkpoint and the
  command that resumes from it (``RESUME_ENV``, set by ``run_train.sh``), then exits with ``128 + signal``.

A worker's exit by a stop signal is a stop only when it is the first failure in time and the worker noted no
failure of its own (``launch.root_failure``, issue 46): torchrun's agent SIGTERMs every other worker once one has
crashed, and those bystanders' 143 must not turn a crash into a "resume with".

Cost: two signal handlers per worker, a logging filter in the launcher; nothing per step.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import traceback

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
RESUME_ENV = "TITAN_FOREMOE_RESUME_COMMAND"


def quiet_worker_exit() -> None:
    """In a worker of torchrun (main thread): SIGTERM / SIGINT end the process at once with ``128 + signal``, no
    traceback. Elsewhere (the entry point called in a test's process) nothing changes."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return

    def stop(signum, frame):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed pipe: nothing to keep
                pass
        os._exit(128 + signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


_requested: list[int] = []


def finish_step_on_stop() -> None:
    """In a worker of torchrun, with ``[checkpoint] save_on_signal``: a stop signal is only remembered
    (``requested``), so that the trainer ends the step, saves it and stops; later ones are ignored (a scheduler
    and torchrun's agent may both send one). torchrun's SIGKILL after its shutdown timeout stays the hard stop."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return

    def remember(signum, frame):
        if not _requested:
            _requested.append(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, remember)


def requested() -> int | None:
    """The stop signal this process received under ``finish_step_on_stop``, or None."""
    return _requested[0] if _requested else None


class StopRequested(Exception):
    """Every rank saved the step it finished after a stop signal; the entry point exits with ``128 + signal``."""

    def __init__(self, sig: int):
        super().__init__(signal.Signals(sig).name)
        self.sig = sig


def stop_signal(exitcode: int | None) -> int | None:
    """The stop signal a worker's exit code stands for (``128 + s`` from ``quiet_worker_exit``, ``-s`` when killed
    by it), else None."""
    if exitcode is None:
        return None
    for sig in STOP_SIGNALS:
        if exitcode in (128 + sig, -sig):
            return int(sig)
    return None


_STOP_EXITS = tuple(f"exitcode: {code})" for sig in STOP_SIGNALS for code in (128 + sig, -sig))


# the agent's notices about a failed worker: the launcher's last line names it (launch.failure_line)
# (its "failed (exitcode: N) local_rank: R" stays on the screen: under MAX_RESTARTS it says what was restarted)
_FAILURE_NOTICES = ("no error file defined for parent", "has a new message format", "skipping error code override",
                    "FAILED with no error file")


class ShutdownLog(logging.Filter):
    """On the terminal's torch log handlers: once the agent reports a death signal, its records (the shutdown's
    warnings) go to ``path`` instead of the screen; so do, always, its "closing signal" notices (one per worker
    it stops), its report of a worker that exited by a stop signal, and its notices about a failed worker (``_FAILURE_NOTICES``)."""

    def __init__(self, path: str):
        super().__init__()
        self.path, self.stopping = path, False

    def install(self) -> "ShutdownLog":
        for name in ("", "torch", "torch.distributed"):
            for handler in logging.getLogger(name).handlers:
                handler.addFilter(self)
        return self

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "death signal" in message:
            self.stopping = True
        shutdown = (self.stopping or "closing signal" in message or any(e in message for e in _STOP_EXITS)
                    or any(notice in message for notice in _FAILURE_NOTICES))
        if not shutdown or not record.name.startswith("torch.distributed"):
            return True
        self.write(f"{record.levelname} {record.name}: {message}\n")
        return False

    def write(self, text: str) -> None:
        """Append ``text``; a dump folder that cannot take it (disk full, read-only) moves the log to the temporary
        folder, so that the line never names an empty or missing file."""
        for attempt in range(2):
            try:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                with open(self.path, "a") as f:
                    f.write(text)
                return
            except OSError:
                fallback = os.path.join(tempfile.gettempdir(), f"titan_foremoe-launch-{os.getpid()}.log")
                if attempt or self.path == fallback:
                    return  # the log is a courtesy: the line on the screen stands alone
                self.path = fallback

    def keep_traceback(self, e: BaseException) -> None:
        self.write("".join(traceback.format_exception(e)))


def stopped_line(sig: int, who: str, checkpoint_folder: str | None, log_path: str) -> str:
    """The one line: the signal, the last complete checkpoint, the command that resumes from it."""
    from ..config.preflight import latest_complete_step

    name = signal.Signals(sig).name
    if checkpoint_folder is None:
        saved = "no checkpoint is kept ([checkpoint] enable = false): a rerun starts from step 0"
    else:
        step = latest_complete_step(checkpoint_folder)
        saved = (f"last complete checkpoint {os.path.join(checkpoint_folder, f'step-{step}')}" if step >= 0 else
                 f"no complete checkpoint in {checkpoint_folder} yet: a rerun starts from step 0")
    command = os.environ.get(RESUME_ENV, "").strip() or "the same command"
    return (f"launch: stopped by {name} ({who}); {saved}; resume with: {command} "
            f"(torchrun's shutdown messages: {log_path})")
