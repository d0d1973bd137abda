"""One engine of the fleet as every trainer rank sees it: its slot, its HTTP client, its server process when this
rank launched it, the weights it serves and whether it is alive.

The vLLM and SGLang variants differ only in their server and client classes (``engines/vllm_server.py``,
``engines/sglang_server.py``); everything a source does with an engine (launch, restart, generate one prompt's
samples, reload a folder, probe) goes through this handle, so the sources and the fleet client never branch on
the engine kind.

Who does what: engine k's **owner** (``layout.launcher_rank(k)``; rank 0 for a disaggregated fleet, the engine's
node for a colocated one) launches, restarts and reloads it; every rank holds a client to every engine (they
send their own requests to the engines the deal names).

A launched engine that dies is restarted by its owner on a background thread (``restart_in_background``) on the
folder of the weights being served, so its start (20-80 s here, minutes for a 30B model) overlaps the rest of the
step and the trainer's stages; it rejoins the deal at the next weight sync (``Fleet.rejoin``), which refills it
with that sync's weights like every other engine. Not sooner: the deal of a step is fixed once, every rank
computes it from the same inputs, and a mid-step join would need one more agreement per step.

A hung engine (``hang.py``: alive, no progress for ``hang_timeout_s``) fails like a dead one; its owner kills
it (SIGKILL to its process group: a wedged engine may not honour SIGTERM) before that background restart. A
user-run one cannot be restarted: it is left out of the deal until it answers again (``reload`` first sends
it one 1-token request, answered within ``hang_timeout_s`` or the engine stays out).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from ..engines.errors import EngineError
from ..engines.sglang_server import SGLangClient, SGLangServer
from ..engines.vllm_server import LaunchSpec, VLLMClient, VLLMServer
from .hang import EngineHung, HangWatch
from .layout import EngineSlot

logger = logging.getLogger("titan_foremoe")


@dataclass
class EngineCounters:
    """What one engine did for this rank in the current step (the fleet client sums them over ranks)."""

    samples: int = 0
    tokens: int = 0  # generated tokens
    busy_s: float = 0.0  # wall time this rank had requests in flight on the engine


@dataclass
class Engine:
    """One fleet slot (module docstring). ``version``: the step whose starting weights it serves (-1: none yet);
    ``failures``: times it was found dead (the same on every rank: agreed by the fleet client)."""

    slot: EngineSlot
    cfg: object  # the engine's config section ([rollout_engine] / [sglang_engine])
    spec: object = None  # the policy's ModelSpec (SGLang shapes its routes by it)
    client: VLLMClient | None = None
    server: VLLMServer | None = None  # this rank launched it
    version: int = -1
    alive: bool = True
    failures: int = 0
    restarts: int = 0
    counters: EngineCounters = field(default_factory=EngineCounters)
    restarting: threading.Thread | None = None
    restart_error: str | None = None
    hung: str | None = None  # judged hung (``hang.py``): what was seen, until it is restarted or answers again
    busy: list = field(default_factory=list)  # [t0, t1] perf_counter spans this rank had requests on it (t1 inf: open)

    name = "vLLM"
    server_type = VLLMServer
    progress = True  # its /metrics token counters tell progress (``hang.py``; vLLM's names)

    @property
    def index(self) -> int:
        return self.slot.index

    @property
    def url(self) -> str:
        return self.client.url if self.client is not None else self.slot.url

    # -- lifetime (the owner rank) ------------------------------------------------------------------
    def make_server(self, spec: LaunchSpec) -> None:
        if self.server is None:
            self.server = self.server_type(spec)

    def launch(self, folder: str) -> str:
        """Start (or restart) this rank's server on ``folder``; returns its URL and connects to it."""
        url = self.server.start(folder)
        self.connect(url)
        self.alive = True
        return url

    def connect(self, url: str) -> None:
        c = self.cfg
        self.client = VLLMClient(url, timeout_s=c.request_timeout_s, retries=c.retries, concurrency=c.concurrency)

    def restartable(self) -> bool:
        """A launched engine of this rank, dead or hung, with restarts left (``max_restarts`` per engine, over the
        job)."""
        return (self.server is not None and (self.hung is not None or not self.server.alive())
                and self.restarts < self.cfg.max_restarts)

    def restart(self, folder: str, why: str) -> str:
        """Owner: the dead (or hung: killed first) launched engine started again on ``folder`` (the weights being
        served)."""
        self.restarts += 1
        logger.warning("%s engine %d at %s %s: restarting it on %s (%d of %d restarts; %s)", self.name,
                       self.index, self.url, "hung: killed it" if self.hung else "died", folder, self.restarts,
                       self.cfg.max_restarts, why)
        if self.hung is not None:
            self.kill()
        url = self.launch(folder)
        self.hung = None
        return url

    def kill(self) -> None:
        """Owner: SIGKILL the server's process group (a hung engine; ``close`` would wait 20 s on SIGTERM)."""
        proc = getattr(self.server, "proc", None)
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.server.close()

    def restart_in_background(self, folder: str, why: str) -> None:
        """Owner: ``restart`` on a thread (the fleet goes on with the survivors); ``join_restart`` collects it."""
        def run():
            try:
                self.restart(folder, why)
            except EngineError as e:
                self.restart_error = str(e)
        self.alive, self.restart_error = False, None
        self.restarting = threading.Thread(target=run, name=f"engine-{self.index}-restart", daemon=True)
        self.restarting.start()

    def join_restart(self) -> str | None:
        """Owner: wait for a background restart; its URL once healthy, None if none ran or it failed."""
        t, self.restarting = self.restarting, None
        if t is None:
            return None
        t.join()
        return None if self.restart_error else self.client.url

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    # -- calls -------------------------------------------------------------------------------
    def sample(self, job: dict):
        """One sample (``prompt_ids, max_tokens, temperature, top_p, seed``) as a ``Completion``."""
        return self.client._sample(**job)

    def prepare(self) -> None:
        """Before the sampling threads: the server's dialect, asked once."""
        self.client._before_threads()

    def watch(self) -> HangWatch | None:
        """A watch of this engine's progress (``hang.py``), None when ``hang_timeout_s`` is 0 or the engine's
        kind exports no counters we read."""
        timeout_s = getattr(self.cfg, "hang_timeout_s", 0.0)
        if not timeout_s or not self.progress:
            return None
        return HangWatch(f"{self.name} engine {self.index}", self.url, timeout_s)

    def answers_again(self) -> None:
        """After a hang verdict: one 1-token generate through the engine core within ``hang_timeout_s``, or an
        ``EngineHung`` (its counters cannot tell: an idle engine's stay still too, and its running / waiting
        gauges are the stopped core's last report)."""
        t = self.cfg.hang_timeout_s
        try:
            VLLMClient(self.url, timeout_s=t, retries=0)._sample(prompt_ids=[1, 2, 3], max_tokens=1, temperature=0.0,
                                                                 top_p=1.0, seed=0)
        except EngineError as e:
            raise EngineHung(f"{self.name} engine {self.index} at {self.url} is still hung: a 1-token request got no "
                             f"answer in {t:g} s ({e})") from None

    def reload(self, folder: str, version: int) -> None:
        """The engine reads ``folder`` in place and drops its prefix cache (blocks of the old weights). One judged
        hung must answer a 1-token request first: still hung, it stays out of the deal (an ``EngineHung``) instead
        of blocking the sync for ``request_timeout_s``."""
        if self.hung is not None and self.watch() is not None:
            self.answers_again()
            logger.warning("%s engine %d at %s answers again: reloading it and dealing it requests", self.name,
                           self.index, self.url)
            self.hung = None
        self.client.reload_weights(folder)
        self.client.reset_prefix_cache()
        self.version = version

    def probe(self, token_ids: list[int]):
        return self.client.prompt_logprobs(token_ids)


@dataclass
class SGLangEngine(Engine):
    """An SGLang server of the fleet (its client shapes the flat routes by the policy's layers and top-k)."""

    name = "SGLang"
    server_type = SGLangServer
    progress = False  # its counters need --enable-metrics and other names: no hang watch (request_timeout_s)

    def connect(self, url: str) -> None:
        c = self.cfg
        self.client = SGLangClient(url, layers=self.spec.num_layers, top_k=self.spec.top_k,
                                   timeout_s=c.request_timeout_s, retries=c.retries, concurrency=c.concurrency)


@dataclass
class VLLMEngine(Engine):
    """A vLLM server of the fleet (the base's calls as they are)."""


ENGINE_KINDS = {"vllm": VLLMEngine, "sglang": SGLangEngine}


def wait_all(fns: list, what: str) -> list[str | None]:
    """Run ``fns`` concurrently (one thread each: engines start, reload and answer in parallel); each one's error
    line or None, in order."""
    errs: list[str | None] = [None] * len(fns)

    def run(i, fn):
        try:
            fn()
        except (EngineError, OSError) as e:
            errs[i] = f"{what} {i}: {type(e).__name__}: {e}" if not isinstance(e, EngineError) else str(e)

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    logger.debug("%d %s calls in %.1f s", len(fns), what, time.perf_counter() - t0)
    return errs
