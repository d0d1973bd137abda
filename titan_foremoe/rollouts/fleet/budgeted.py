"""Sending under a partial-rollout ``StopRule`` (``rollouts/partial.py``): each sample goes under its own
``request_id``; once the rule is met no further sample starts (it answers "unstarted", no token) and every
sample still running on an engine is aborted by id (vLLM's ``/abort_requests``, 0.28's dev route and 0.30+'s
``/inference/v1/abort_requests``: the aborted request's pending HTTP call then answers with the tokens,
log-probs and routes it has, ``finish_reason = "abort"``). An abort can reach the engine before the request it
names (still in transit): the abort is repeated every ``REPEAT_S`` until every aborted sample has answered.

Cost: one HTTP call per engine holding this rank's running samples per repeat (ids only, ~40 B each), none when
the rule is never met; no collective.
"""

from __future__ import annotations

import logging
import threading
import time

from ..engines.errors import EngineError
from ..engines.vllm_api import Completion
from ..partial import FINISHED

logger = logging.getLogger("titan_foremoe")
REPEAT_S = 0.5


def arm(rule) -> None:
    """``rule.on_stop``: abort this rank's running samples, again until they have all answered."""
    running = rule.running

    def loop():
        while True:
            with rule.lock:
                by_engine: dict = {}
                for rid, engine in running.items():
                    by_engine.setdefault(engine.index, (engine, []))[1].append(rid)
            if not by_engine:
                return
            for engine, ids in by_engine.values():
                try:
                    engine.client.abort(ids)
                except EngineError as e:  # a dead engine: its samples fail over as usual
                    logger.warning("abort on engine %d: %s", engine.index, e)
            time.sleep(REPEAT_S)

    rule.on_stop = lambda: threading.Thread(target=loop, name="partial-abort", daemon=True).start()


def sampler(engine, rule, requests: dict):
    """``(i, job) -> Completion`` for one engine's thread pool: ``job`` sent unless the rule is met; its answer
    counted by the rule (group ``requests[i]["group"]``)."""
    running = rule.running

    def sample(item) -> Completion:
        i, job = item
        uid = requests[i]["group"]
        with rule.lock:
            if rule.stop.is_set():
                return Completion(list(job["prompt_ids"]), [], [], None, "unstarted")
            running[job["request_id"]] = engine
        t0 = time.perf_counter()
        try:
            c = engine.sample(job)
        finally:
            with rule.lock:
                running.pop(job["request_id"], None)
                rule.spans.append((engine.index, t0, time.perf_counter()))
        rule.answered(uid, len(c.token_ids), c.finish_reason in FINISHED)
        return c

    return sample
