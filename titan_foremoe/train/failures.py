"""One line naming the root cause of a worker failure (issue 23).

torchelastic's ``@record`` records only ``Exception``s, and DCP's ``CheckpointException`` derives from
``BaseException`` and nests every rank's error under ~200 lines of traces, so a deleted shard, a full
disk or a read-only folder ended with ``error_file: <N/A>``. ``describe`` turns such an error into one
line that names the file or folder; the entry point re-raises it as a ``RuntimeError`` that ``@record``
writes to the error file torchrun prints.
"""

from __future__ import annotations

import errno
import json
import os
import time

_HINTS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOENT: "missing file",
}


def describe_os_error(e: OSError) -> str:
    """``OSError`` with its file and, for disk full / permission errors, the folder to fix."""
    path = e.filename or ""
    what = _HINTS.get(e.errno or -1, e.strerror or type(e).__name__)
    if not path:
        return f"{type(e).__name__}: {what} ({e})"
    folder = os.path.dirname(os.path.abspath(path))
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{type(e).__name__}: {what} writing {path} (free space in / make writable the folder {folder})"
    return f"{type(e).__name__}: {what}: {path}"


def describe(e: BaseException) -> str:
    """One line for any error, the innermost checkpoint-rank failure first."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        ranks = sorted(e.failures)
        inner, _ = e.failures[ranks[0]]
        return f"checkpoint read/write failed on ranks {ranks}: rank {ranks[0]}: {describe(inner)}"
    if isinstance(e, OSError):
        return describe_os_error(e)
    if isinstance(e, EOFError):
        return f"EOFError: a file ended early (truncated checkpoint shard or data file?) {e}".rstrip()
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def is_exit(e: BaseException) -> bool:
    """Exits and interrupts are not failures to record."""
    return isinstance(e, (SystemExit, KeyboardInterrupt, GeneratorExit))


def note_failure_time() -> None:
    """Beside torchelastic's error file, the moment this worker caught its failure (sub-second wall time): the
    launcher names the first failure in time (``launch.root_failure``), and torchrun's own timestamps are whole
    seconds, taken when the error file is written (after this rank's teardown, which already fails its peers).
    The first call wins; nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path + ".at"):
        return
    try:
        with open(path + ".at", "w") as f:
            f.write(repr(time.time()))
    except OSError:  # the launcher falls back to the exit time
        pass


def failure_time(error_file: str) -> float | None:
    """What ``note_failure_time`` left beside ``error_file``; None when nothing (or something unreadable)."""
    try:
        with open(error_file + ".at") as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def record_line(line: str) -> None:
    """Leave a worker's one line (it exits 2 without an exception) in torchelastic's error file, where the launcher
    reads the failing worker's message (``launch.failure_line``); nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    note_failure_time()
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:  # the worker printed the line itself
        pass
