"""A worker waiting for its peers at start-up says so (issue 46).

``init_process_group`` on ``env://`` waits, without a word, for ``WORLD_SIZE`` ranks to reach the store at
``MASTER_ADDR:MASTER_PORT`` ([comm] init_timeout_seconds, 300 s by default), then ends in ``DistStoreError ...
1/2 clients joined``. A worker started by hand with a ``WORLD_SIZE`` left in the environment waited those 300 s in
silence. ``announce_wait`` names the wait: at once for a worker started outside torchrun (whose rendezvous has
already gathered the ranks), after ``every_s`` under torchrun, and again every ``every_s`` until the group is up.

Cost: one thread per worker for the length of ``init_process_group``; nothing after.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager


def wait_line(env, waited_s: float, timeout_s: float) -> str:
    """What this rank waits for, in words (``env``: the process environment)."""
    world, rank = env.get("WORLD_SIZE", "?"), env.get("RANK", "?")
    where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    head = (f"rank {rank}: waiting for {world} ranks at {where}" if waited_s == 0 else
            f"rank {rank}: still waiting for {world} ranks at {where} after {waited_s:.0f} s")
    hint = "" if "TORCHELASTIC_RUN_ID" in env else (
        f"; started without torchrun: the other ranks must be started with the same MASTER_ADDR / MASTER_PORT "
        f"(a WORLD_SIZE={world} left in the environment? unset it, or launch with run_train.sh)")
    return f"{head} ([comm] init_timeout_seconds = {timeout_s:g}){hint}"


@contextmanager
def announce_wait(timeout_s: float, every_s: float = 30.0, env=None, log=None):
    """Around the start of the default process group: name the wait (``wait_line``) while it lasts."""
    env = os.environ if env is None else env
    if int(env.get("WORLD_SIZE", "1") or 1) <= 1:
        yield
        return
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    done = threading.Event()
    start = time.monotonic()

    def run() -> None:
        if "TORCHELASTIC_RUN_ID" not in env:
            log(wait_line(env, 0, timeout_s))
        while not done.wait(every_s):
            log(wait_line(env, time.monotonic() - start, timeout_s))

    thread = threading.Thread(target=run, daemon=True, name="foremoe-start-wait")
    thread.start()
    try:
        yield
    finally:
        done.set()
