"""One job per dump folder: an exclusive lock file held for the job's life (issue 31).

Two jobs started on one ``dump_folder`` both ran to the end, writing the same ``step-N`` checkpoints over each
other and two event files into one TensorBoard run. The launcher (node_rank 0; rank 0 of the workers under a
direct ``torchrun``) creates ``DUMP/.titan_foremoe.lock`` with ``O_EXCL`` before any worker starts, holding its
host, pid and the pid's start time, and removes it at exit. A lock left by a process that is gone (same host,
pid not running or running another program since) is stale and taken over; one from another host cannot be
checked from here, so it is refused with the file to delete. No ``flock``: it is not reliable on the network file
systems dump folders live on, and it would not name the holder.

Cost: one file created, read back and removed per job; nothing per step.
"""

from __future__ import annotations

import json
import os
import socket
import time

LOCK_NAME = ".titan_foremoe.lock"
LOCK_ENV = "TITAN_FOREMOE_FOLDER_LOCK"  # the lock file the launcher holds for its workers


class FolderBusy(Exception):
    """Another job holds the dump folder; the message names the folder and the holder."""


def lock_path(folder: str) -> str:
    return os.path.join(os.path.abspath(os.path.expanduser(folder)), LOCK_NAME)


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells a reused pid apart); None when it is not running."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else fields[19]
    except (OSError, IndexError):
        try:  # no /proc: liveness only
            os.kill(pid, 0)
            return ""
        except ProcessLookupError:
            return None
        except PermissionError:
            return ""


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def read_holder(path: str) -> dict | None:
    """The lock's holder, None when there is no lock file; ``{}`` when it cannot be read."""
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else {}
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        return {}


def is_stale(holder: dict) -> bool:
    """Held by a process of this host that is gone (or whose pid now runs something else)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    start = _start_time(holder["pid"])
    return start is None or (bool(start) and bool(holder.get("start")) and start != holder["start"])


def describe_holder(folder: str, holder: dict) -> str:
    path = lock_path(folder)
    if not holder:
        return (f"[job] dump_folder: {folder} is locked by {path}, which cannot be read; delete it if no job runs "
                "there")
    where = f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since', '?')}"
    if holder.get("host") == socket.gethostname():
        return (f"[job] dump_folder: {folder} is in use by another job ({where}; lock {path}): wait for it to "
                "end or stop it, or choose another dump_folder")
    return (f"[job] dump_folder: {folder} is in use by another job ({where}; lock {path}): that host cannot be "
            "checked from here; if that job is gone, delete the lock file, else choose another dump_folder")


def check_free(folder: str, own: str | None = None) -> None:
    """Raise ``FolderBusy`` when a live job holds ``folder`` (``own``: the lock file our launcher holds)."""
    path = lock_path(folder)
    if own == path:
        return
    holder = read_holder(path)
    if holder is not None and not is_stale(holder):
        raise FolderBusy(describe_holder(folder, holder))


class FolderLock:
    """The held lock; ``release`` removes the file if it is still ours. ``took_over``: the stale holder replaced."""

    def __init__(self, path: str, took_over: dict | None):
        self.path, self.took_over, self.pid = path, took_over, os.getpid()

    def release(self) -> None:
        holder = read_holder(self.path)
        if holder and holder.get("pid") == self.pid and holder.get("host") == socket.gethostname():
            try:
                os.remove(self.path)
            except OSError:
                pass


def acquire(folder: str) -> FolderLock:
    """Create the lock (and the folder); ``FolderBusy`` naming the holder when a live job has it."""
    path = lock_path(folder)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    took_over = None
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = read_holder(path)
            if holder is None:
                continue  # released meanwhile
            mine = holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()
            if not (mine or is_stale(holder)):
                raise FolderBusy(describe_holder(folder, holder)) from None
            took_over = None if mine else holder
            aside = f"{path}.stale.{os.getpid()}"  # rename, not remove: of two takers, one wins the O_EXCL
            try:
                os.replace(path, aside)
                if read_holder(aside) != holder:  # another taker's fresh lock: put it back
                    os.link(aside, path)
                os.remove(aside)
            except (FileNotFoundError, FileExistsError):
                pass
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(_me(), f)
        return FolderLock(path, took_over)
    raise FolderBusy(describe_holder(folder, read_holder(path) or {}))


def hold_unless_launched(folder: str) -> FolderLock | None:
    """For rank 0 of the workers: the lock, unless the launcher that started them holds it (None then)."""
    if os.environ.get(LOCK_ENV) == lock_path(folder):
        return None
    return acquire(folder)
