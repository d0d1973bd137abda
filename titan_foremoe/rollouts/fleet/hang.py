"""A hung engine found within seconds: the process alive, its port open, no progress (a wedged GPU, a deadlocked
scheduler, SIGSTOP). Without this, only ``request_timeout_s`` (1,800 s at 30B) ends such a step.

Why progress and not ``/health``: vLLM 0.28's ``/health`` (``entrypoints/serve/instrumentator/health.py``) awaits
``AsyncLLM.check_health``, which only reads a flag set once the engine-core process has *died*
(``engine_core.resources.engine_dead``); the API process answers 200 while the core is wedged (measured: the core
SIGSTOPped, ``/health`` still 200, ``tests/test_vllm_fleet.py``). A 1-token heartbeat generate (slime's
``/health_generate`` on SGLang) queues behind the engine's own requests under load and reads as a hang. What does
move exactly when the engine works is its token counters: ``vllm:generation_tokens_total`` and
``vllm:prompt_tokens_total`` (``v1/metrics/loggers.py``), incremented from every engine-core output batch, i.e.
every scheduler step that produced a token (a long chunked prefill counts when its first token comes: seconds).
So the watch asks ``GET /metrics?name[]=...`` (prometheus_client's name filter: ~1 KB instead of the ~60 KB page)
and calls the engine hung when neither counter moved for ``hang_timeout_s`` while this rank had samples
outstanding on it, or when ``/metrics`` did not answer that long (a stopped API process). A slow engine that
still produces tokens is never hung. An engine that exports no counters (a user-run one started with
``--disable-log-stats``) is judged by whether ``/metrics`` answers at all (said once in the log).

Who polls: each rank, only the engines it has samples outstanding on, from the thread that already waits on them
(``client._serve``), every ``poll_s = min(5 s, hang_timeout_s / 4)``; no thread, collective or host sync is added
(a hung engine is a failure like a refused one: the step's existing failure flag all-reduce carries it). At R =
64 / 256 / 1024 ranks and K = 8 / 32 / 128 engines with 2 prompts per rank, each rank waits on 1-2 engines and each
engine is waited on by its G / K = 16 requests' ranks (at most 16): <= 16 / poll_s = 3.2 small GETs per second
per engine at ``hang_timeout_s`` >= 20 s, against its 16 x ``concurrency`` generate requests in flight; per rank
<= 2 / poll_s. Detection: ``detect_s`` = ``hang_timeout_s`` + 2 polls (70 s at the default 60 s).

Legend: none (no tensors).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from ..engines.engine_probe import reach_reason
from ..engines.errors import EngineError

VLLM_COUNTERS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total")
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def poll_s(hang_timeout_s: float) -> float:
    """Seconds between two looks at an engine a rank waits on."""
    return min(5.0, hang_timeout_s / 4)


def detect_s(hang_timeout_s: float) -> float:
    """Worst seconds from an engine's last progress to the verdict: the hang can start just after a look that saw
    progress, the verdict comes at the first look ``hang_timeout_s`` after the one that saw it (a silent server adds
    one look's own timeout, ``max(poll_s, 1 s)``)."""
    return hang_timeout_s + 2 * poll_s(hang_timeout_s)


class EngineHung(EngineError):
    """No progress for ``hang_timeout_s`` with requests outstanding (the message says what was seen)."""


@dataclass(frozen=True)
class Look:
    """One ``GET /metrics`` of an engine: whether it answered, its token counters' sum (None: not exported) and
    its running / waiting requests."""

    answered: bool
    tokens: float | None = None
    running: float | None = None
    waiting: float | None = None
    error: str = ""

    def says(self, timeout_s: float) -> str:
        if not self.answered:
            return f"/metrics did not answer in {timeout_s:.1f} s: {self.error}"
        if self.tokens is None:
            return "/metrics answered without token counters (--disable-log-stats?)"
        queued = "" if self.running is None else f", {self.running:.0f} running, {self.waiting or 0:.0f} waiting"
        return (f"/metrics answered, generated + prompt tokens stuck at {self.tokens:.0f}{queued} (the engine core "
                "makes no progress; /health may still answer)")

    @property
    def idle(self) -> bool:
        return self.running == 0 and not self.waiting


def parse_metrics(text: str, counters=VLLM_COUNTERS, gauges=VLLM_GAUGES) -> Look:
    """Prometheus text: the counters summed over their labels (None if absent), the gauges summed likewise."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in counters or name in gauges:
            try:
                sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[-1])
            except ValueError:
                continue
    tokens = sum(sums[n] for n in counters if n in sums) if any(n in sums for n in counters) else None
    running, waiting = (sums.get(n) for n in gauges)
    return Look(True, tokens, running, waiting)


def look(url: str, timeout_s: float, counters=VLLM_COUNTERS, gauges=VLLM_GAUGES) -> Look:
    """``GET url/metrics`` filtered to the names we read; an answer with an error status still answered."""
    query = urllib.parse.urlencode([("name[]", n) for n in (*counters, *gauges)])
    try:
        with urllib.request.urlopen(f"{url}/metrics?{query}", timeout=timeout_s) as r:
            return parse_metrics(r.read().decode(errors="replace"), counters, gauges)
    except urllib.error.HTTPError as e:
        return Look(True, error=f"HTTP {e.code}")
    except (OSError, urllib.error.URLError) as e:
        return Look(False, error=reach_reason(e))


class HangWatch:
    """One engine's progress as one rank sees it while it waits on the engine (module docstring); ``name``: the
    engine in words ("vLLM engine 1"). ``check`` is called every ``poll_s``; it returns the verdict line once
    nothing moved for ``hang_timeout_s``."""

    def __init__(self, name: str, url: str, hang_timeout_s: float, looker: Callable[[str, float], Look] = look,
                 clock: Callable[[], float] = time.monotonic):
        self.name, self.url, self.hang_timeout_s, self.looker, self.clock = name, url, hang_timeout_s, looker, clock
        self.poll_s = poll_s(hang_timeout_s)
        self.look_timeout_s = max(self.poll_s, 1.0)
        self.since = clock()  # the last progress (or the watch's start)
        self.last: Look | None = None  # the last answered look with counters
        self.seen = Look(False, error="not looked at yet")  # the last look

    def progressed(self) -> bool:
        """One look: True if the engine moved since the last one (or it exports no counters and answered)."""
        now = self.looker(self.url, self.look_timeout_s)
        prev, moved = self.last, False
        if now.answered and now.tokens is None:
            moved = True  # nothing finer to judge by: answering is all we can see
        elif now.answered:
            moved = prev is not None and now.tokens != prev.tokens
            self.last = now
        self.seen = now
        return moved

    def check(self, outstanding: int) -> str | None:
        """None while the engine progresses; the verdict (one line) once it was silent ``hang_timeout_s``."""
        if self.progressed():
            self.since = self.clock()
            return None
        silent = self.clock() - self.since
        if silent < self.hang_timeout_s:
            return None
        return (f"{self.name} at {self.url} hung: no progress for {silent:.1f} s (hang_timeout_s "
                f"{self.hang_timeout_s:g}) with {outstanding} of this rank's samples outstanding; "
                f"{self.seen.says(self.look_timeout_s)}")

    def answers_again(self) -> str | None:
        """After a verdict: None once the engine moves (or sits idle and answers) within ``hang_timeout_s``;
        else why it is still hung (one line)."""
        deadline = self.clock() + self.hang_timeout_s
        while True:
            if self.progressed() or (self.seen.answered and self.seen.idle):
                return None
            if self.clock() >= deadline:
                return (f"{self.name} at {self.url} is still hung ({self.hang_timeout_s:g} s watched): "
                        f"{self.seen.says(self.look_timeout_s)}")
            time.sleep(self.poll_s)


class Pool:
    """``workers`` daemon threads running ``fn(job)`` for queued jobs, each job's ``concurrent.futures.Future``.
    Unlike ``ThreadPoolExecutor`` it can be left behind: a worker blocked in a hung engine's request does not hold
    up the step (``abandon``) nor the interpreter's exit (daemon threads); its result is never read."""

    def __init__(self, fn, workers: int):
        import queue
        from concurrent.futures import Future

        self.fn, self.jobs, self.stop, self.Future = fn, queue.SimpleQueue(), threading.Event(), Future
        self.threads = [threading.Thread(target=self._work, daemon=True, name="fleet-sample")
                        for _ in range(max(1, workers))]
        for t in self.threads:
            t.start()

    def submit(self, job):
        f = self.Future()
        self.jobs.put((f, job))
        return f

    def _work(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None or self.stop.is_set():
                if item is not None:
                    item[0].cancel()
                    continue
                return
            f, job = item
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(self.fn(job))
            except BaseException as e:  # noqa: BLE001 - the caller reads it from the future
                f.set_exception(e)

    def close(self, abandon: bool = False) -> None:
        """No new job starts; ``abandon``: queued ones are cancelled and running ones left to end on their own."""
        if abandon:
            self.stop.set()
        for _ in self.threads:
            self.jobs.put(None)
