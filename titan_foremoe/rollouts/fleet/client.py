"""The fleet client: this rank's requests sent to the engines the deal names, a dead engine's requests re-dealt to
the survivors, every sample tagged with the engine and the weights that produced it.

One step (collective; every data-parallel rank calls ``generate`` with its own requests):

1. **deal**: every rank's per-request token estimates are all-gathered (``request_tokens``: G int64 in all) and
   every rank computes the same ``deal`` (LPT by outstanding tokens, a prompt's samples on one engine); this rank
   keeps its own slice.
2. **send**: one thread per engine this rank was dealt requests on, each keeping ``concurrency`` samples in
   flight (as one engine's client did before the fleet); a request counts as answered when all its samples are
   back. An engine error (refused, unreachable after ``retries``, ``request_timeout_s`` without an answer, or hung:
   no token progress for ``hang_timeout_s``, ``hang.py``, watched from the same thread) marks the engine failed for
   this rank and stops its remaining samples (a hung engine's running ones are left behind, not waited for).
3. **agree** (one flag all-reduce per round, as the single-engine source did): if any rank saw a failure, every
   rank's failed engines and the token estimates of its unanswered requests are all-gathered; the union of the
   failed engines is dead on every rank; the unanswered requests (all ranks') are re-dealt over the survivors on
   top of the tokens they were already dealt, and only their owners send them again. The engines a rank judged
   hung ride the same all-gather, so every rank (the owner too) knows to kill them before a restart. Partial
   samples of an unanswered request are dropped, so each prompt's samples come back exactly once, from one
   engine. A launched
   dead engine is restarted by its owner in the background (``engine.py``) and rejoins at the next sync. With no
   survivor, ``on_failure`` (the source: restart a launched engine synchronously on the current weights, as the
   one-engine source did) may bring one back, else the step fails with every rank's error in one line.
4. **metrics**: per engine, samples and generated tokens summed over ranks and busy seconds (the longest rank's)
   in one all-reduce: ``rollout/engine_<k>/samples``, ``tokens``, ``busy_s``, ``failures``.

Cost at R = 64 / 256 / 1024 ranks (Qwen3-30B-A3B, 2 prompts x 8 samples per rank, 4k responses): each rank's
fleet client sends its own 16 samples' requests (~3 KB of prompt ids each) and receives its own rows (per token 48
layers x 8 routes = 384 B + a log-prob, 65k tokens: ~25 MB, ~34 MB as base64 JSON, per rank per step whatever
R); the deal's all-gather is 2 x 8 B
per rank (1 / 4 / 16 KB in all), the metrics all-reduce 3K floats (K = R / 8 engines: 192 B - 3 KB), the failure
flag one int64. Failing over one engine costs the detection (``hang.detect_s``: <= 70 s at the default
``hang_timeout_s`` when it hangs, ``request_timeout_s`` x (retries + 1) with the watch off; a refused connection at
once: ~0.1 s), one all-gather of the unanswered requests' estimates, and the
re-dealt requests' generation from scratch on the survivors (at most the dead engine's share, 1 / K of the
step's tokens, added to the survivors' queues: ~1 / (K - 1) of the rollout time, 14% at K = 8).

Legend: G requests of the step (all ranks'), g this rank's, K engines.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
import functools
from concurrent.futures import FIRST_EXCEPTION, wait
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ...distributed import collectives
from ..engines.errors import EngineError
from .budgeted import sampler
from .dealing import deal, engine_tokens, request_tokens
from .engine import Engine, EngineCounters
from .hang import EngineHung, HangWatch, Pool

logger = logging.getLogger("titan_foremoe")


@dataclass
class Dealt:
    """One step's requests of this rank as the deal placed them, and what came back so far."""

    requests: list[dict]
    tokens_g: np.ndarray  # [g] estimated tokens of each
    engine_g: np.ndarray  # [g] the engine serving each (re-dealt ones updated)
    first_g: np.ndarray  # [g] the engine each was first dealt to
    load_K: np.ndarray  # [K] tokens the step dealt each engine (all ranks')
    groups: list  # [g] completions, None while unanswered
    failed: dict = field(default_factory=dict)  # engine -> error seen by this rank in the last send
    counters_K: list = field(default_factory=list)  # [K] EngineCounters of this generation (several may be in flight)
    rule: object = None
    """Partial rollouts (``rollouts/partial.py``): the step's ``StopRule``; once met, no sample starts and the
    running ones are aborted (they answer with what they have). None: every sample runs to its end."""


class FleetClient:
    """Generation over the fleet's ``engines`` (module docstring).

    ``deal`` (collective) then ``send`` (this rank's HTTP only: may run on a background thread, as asynchronous RL
    does while the trainer trains) then ``finish`` (collective: failures agreed and re-dealt, metrics); or
    ``generate``, all three."""

    def __init__(self, engines: list[Engine]):
        self.engines = engines

    @property
    def alive_K(self) -> np.ndarray:
        return np.array([e.alive for e in self.engines], dtype=bool)

    def generate(self, requests: list[dict], expected_response: float, on_failure=None) -> tuple[list, np.ndarray]:
        d = self.deal(requests, expected_response)
        self.send(d)
        return self.finish(d, on_failure)

    def deal(self, requests: list[dict], expected_response: float, eligible_K: np.ndarray | None = None) -> Dealt:
        """Collective: the step's requests of every rank dealt over the alive engines (``eligible_K``: of those, the
        ones serving recent enough weights; one all-gather of the estimates); this rank's share.
        ``expected_response`` and ``eligible_K`` must be the same on every rank."""
        for e in self.engines:
            e.hung = None if e.alive else e.hung  # alive again (agreed at the sync): not hung
        tokens_g = request_tokens([len(r["prompt_ids"]) for r in requests], [r["n"] for r in requests],
                                  expected_response)
        every = collectives.all_gather_objects(tokens_g)
        offset = sum(len(t) for t in every[: self._me()])
        tokens_G = np.concatenate(every)
        engine_G = deal(tokens_G, self.alive_K if eligible_K is None else self.alive_K & eligible_K)
        engine_g = engine_G[offset: offset + len(requests)].copy()
        return Dealt(requests, tokens_g, engine_g, engine_g.copy(), engine_tokens(tokens_G, engine_G, len(self.engines)),
                     [None] * len(requests), counters_K=[EngineCounters() for _ in self.engines])

    def send(self, d: Dealt) -> None:
        """This rank's unanswered requests to their engines, one thread per engine (no collective)."""
        d.failed = self._send(d.requests, [i for i, g in enumerate(d.groups) if g is None], d.engine_g, d.groups,
                              d.counters_K, d.rule)

    def finish(self, d: Dealt, on_failure: Callable[[list[int], str], None] | None = None) -> tuple[list, np.ndarray]:
        """Collective: until no rank saw a failure, the failed engines agreed dead and every rank's unanswered
        requests re-dealt to the survivors and sent; then the per-engine counters summed over ranks. Returns each
        request's completions and its engine (``[g]``). ``on_failure(dead, errors)`` runs on every rank once the
        dead are agreed (the source restarts launched ones); with no engine alive after it, the step fails with
        every rank's error in one line."""
        while collectives.any_true(bool(d.failed)):
            todo = [i for i, g in enumerate(d.groups) if g is None]
            d.load_K = self._fail_over(d.failed, d.tokens_g, todo, d.engine_g, d.load_K, on_failure)
            self.send(d)
        self._metrics_reduce(d.counters_K)
        assert all(g is not None for g in d.groups), "fleet: a request left unanswered with no failure reported"
        return d.groups, d.engine_g

    @staticmethod
    def _me() -> int:
        """This rank's index among the gathered lists (its rank; 0 without a process group)."""
        return dist.get_rank() if collectives.active() else 0

    def _send(self, requests: list[dict], todo: list[int], engine_g: np.ndarray, groups: list,
              counters_K: list, rule=None) -> dict[int, str]:
        """This rank's ``todo`` requests sent to their engines, concurrently; fills ``groups``; the engines that
        failed, with their error."""
        by_engine: dict[int, list[int]] = {}
        for i in todo:
            by_engine.setdefault(int(engine_g[i]), []).append(i)
        failed: dict[int, str] = {}
        threads = [threading.Thread(target=self._serve, args=(self.engines[k], [requests[i] for i in idx], idx,
                                                                groups, failed, counters_K[k], rule), daemon=True)
                   for k, idx in by_engine.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return failed

    def _serve(self, engine: Engine, reqs: list[dict], idx: list[int], groups: list, failed: dict,
               counters: EngineCounters, rule=None) -> None:
        """One engine's share of this rank's requests, ``concurrency`` samples in flight, watched for a hang
        (``hang.py``); a request's completions land in ``groups`` only when all its samples are back. With a
        ``rule`` (partial rollouts) each sample is sent under its ``request_id`` through ``budgeted.sampler``."""
        jobs = [(i, j, dict(prompt_ids=r["prompt_ids"], max_tokens=r["max_tokens"], temperature=r["temperature"],
                            top_p=r["top_p"], seed=r["seed"] + j, **({"request_id": f"{r['request_id']}-{j}"}
                                                                    if "request_id" in r else {})))
                for i, r in zip(idx, reqs) for j in range(r["n"])]
        got: dict[int, list] = {i: [None] * r["n"] for i, r in zip(idx, reqs)}
        lock, open_ = threading.Lock(), [True]  # no group lands once this send has ended (a re-deal owns it)

        def land(future, i: int, j: int) -> None:
            """(Lock held.) A sample is back: its request's group lands in ``groups`` as soon as all its samples
            are (a pool of finished groups, ``sources/first_finished.py``, takes them while the rest still run)."""
            if not open_[0] or not future.done() or future.cancelled() or future.exception() is not None:
                return
            got[i][j] = future.result()
            if all(c is not None for c in got[i]) and groups[i] is None:
                for c in got[i]:
                    c.engine, c.served_version = engine.index, engine.version
                groups[i] = got[i]
                counters.samples += len(got[i])
                counters.tokens += sum(len(c.token_ids) for c in got[i])

        def landed(future, i: int, j: int) -> None:  # the sample's worker thread, once its future is set
            with lock:
                land(future, i, j)
        t0 = time.perf_counter()
        span = [t0, float("inf")]  # the engine's idle fraction (``sources/in_flight.py``): open until it ends
        engine.busy.append(span)
        watch = engine.watch()
        send = (lambda item: engine.sample(item[1])) if rule is None else \
            sampler(engine, rule, {i: r for i, r in zip(idx, reqs)})  # both take (request index, job)
        pool = Pool(lambda call: call(), min(engine.cfg.concurrency, len(jobs)))
        futures: dict = {}
        hung = False
        try:
            bad, hung = _wait({pool.submit(engine.prepare): None}, watch, engine)  # asks /version once
            if bad is None:
                futures = {pool.submit(functools.partial(send, (i, job))): (i, j) for i, j, job in jobs}
                for f, (i, j) in futures.items():
                    f.add_done_callback(functools.partial(landed, i=i, j=j))
                bad, hung = _wait(futures, watch, engine)
            if bad is not None:
                raise bad
        except Exception as e:  # noqa: BLE001 - unreachable, refused, hung or a malformed answer: the engine failed
            failed[engine.index] = str(e) if isinstance(e, EngineError) else f"{type(e).__name__}: {e}"
        finally:
            pool.close(abandon=hung)  # a hung engine's requests are left to its restart (or its own end)
            span[1] = time.perf_counter()
            counters.busy_s += span[1] - t0
            with lock:  # a callback may still be on its way for a future ``_wait`` saw done: land them all now
                for f, (i, j) in futures.items():
                    land(f, i, j)
                open_[0] = False

    def _fail_over(self, failed: dict[int, str], tokens_g: np.ndarray, todo: list[int], engine_g: np.ndarray,
                   load_K: np.ndarray, on_failure) -> np.ndarray:
        """Collective: the failed engines (union over ranks) marked dead, every rank's unanswered requests
        re-dealt over the survivors on top of ``load_K``; this rank's new engines written into ``engine_g``.
        Returns the survivors' loads."""
        hung = {k: self.engines[k].hung for k in failed if self.engines[k].hung}  # judged hung by this rank
        gathered = collectives.all_gather_objects((failed, hung, tokens_g[todo]))
        every = [(f, t) for f, _, t in gathered]
        dead = sorted({k for f, _ in every for k in f})
        errors = "; ".join(f"rank {r}: {msg}" for r, (f, _) in enumerate(every) for msg in f.values())
        for k in dead:
            if self.engines[k].alive:
                self.engines[k].alive = False
                self.engines[k].failures += 1
        for _, h, _ in gathered:  # every rank knows it hung: its owner kills it before the restart
            for k, why in h.items():
                self.engines[k].hung = why
        logger.warning("engine fleet: engine(s) %s failed mid-step (%s); their unanswered requests go to %s",
                       dead, errors, np.flatnonzero(self.alive_K).tolist() or "no engine")
        if on_failure is not None:
            on_failure(dead, errors)
        if not self.alive_K.any():
            raise EngineError(f"engine fleet: every engine failed: {errors}")
        tokens_U = np.concatenate([t for _, t in every]).astype(np.int64)
        offset = sum(len(t) for _, t in every[: self._me()])
        load_K = np.where(self.alive_K, load_K, 0)
        new_U = deal(tokens_U, self.alive_K, load_K)
        engine_g[todo] = new_U[offset: offset + len(todo)]
        return load_K + engine_tokens(tokens_U, new_U, len(self.engines))

    def _metrics_reduce(self, counters_K: list[EngineCounters]) -> None:
        """Collective: per engine, one generation's samples and tokens summed over ranks, busy seconds the longest
        rank's (two all-reduces: K x 16 B and K x 8 B); they become the engines' ``counters`` (``metrics``)."""
        K = len(self.engines)
        for e, c in zip(self.engines, counters_K):
            e.counters = c
        sums = torch.tensor([[e.counters.samples, e.counters.tokens] for e in self.engines], dtype=torch.float64)
        busy = torch.tensor([e.counters.busy_s for e in self.engines], dtype=torch.float64)
        sums = collectives.all_reduce(sums.reshape(-1), collectives.ReduceOp.SUM).reshape(K, 2)
        busy = collectives.all_reduce(busy, collectives.ReduceOp.MAX)
        for k, e in enumerate(self.engines):
            e.counters.samples, e.counters.tokens, e.counters.busy_s = int(sums[k, 0]), int(sums[k, 1]), float(busy[k])

    def metrics(self) -> dict[str, float]:
        """``rollout/engine_<k>/...`` of the last step (every rank the same values)."""
        out = {}
        for e in self.engines:
            p = f"rollout/engine_{e.index}/"
            out.update({p + "samples": float(e.counters.samples), p + "tokens": float(e.counters.tokens),
                        p + "busy_s": e.counters.busy_s, p + "failures": float(e.failures)})
        out["rollout/engines_alive"] = float(self.alive_K.sum())
        return out


def _wait(futures: dict, watch: HangWatch | None, engine: Engine) -> tuple[BaseException | None, bool]:
    """Wait for ``futures`` (one engine's samples), checking ``watch`` every ``poll_s``: until all are done, or
    the first error (the queued ones then cancelled, the running ones still waited for, still watched), or a hang
    verdict (recorded on ``engine``; nothing more is waited for). Returns the error and whether it was a hang."""
    pending, bad = set(futures), None
    while pending:
        done, pending = wait(pending, timeout=None if watch is None else watch.poll_s, return_when=FIRST_EXCEPTION)
        if bad is None and (bad := next((f.exception() for f in done if not f.cancelled() and f.exception()),
                                        None)) is not None:
            for f in pending:
                f.cancel()  # the samples not started yet; the running ones end (or time out) first
        if pending and watch is not None and (why := watch.check(len(pending))) is not None:
            for f in pending:
                f.cancel()
            engine.hung = why
            return EngineHung(why), True
    return bad, False
