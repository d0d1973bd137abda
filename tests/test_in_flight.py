"""k steps in flight (``rollouts/sources/in_flight.py``) without an engine: the queue rules brute-forced, and the
live source's step loop over two fake engines, one held busy across a step start (the live run is in
test_vllm_fleet.py).

- over every pattern of busy engines (K = 2, 6 steps, k = 1..3), a simulation of the fleet under the module's
  rules (idle engines reload, each step's requests go to the engines recent enough for it) never trains a row
  older than k steps, never holds more than k steps, and starts every step at the latest at its own start;
- the source itself: an engine still answering step 2's requests at step 1's start is not reloaded, step 3's
  requests go only to the reloaded engine, step 2's rows keep the weights they started with, and every engine
  is reloaded again once idle; a checkpoint between steps waits for the generations in flight and a resume holds
  every started step's rows.
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from titan_foremoe.config.job_config import JobConfig
from titan_foremoe.rollouts.engines.vllm_api import Completion
from titan_foremoe.rollouts.sources.in_flight import busy_seconds, eligible_K, steps_to_start, token_staleness
from titan_foremoe.rollouts.sources.vllm import VLLMSource


def _simulate(k: int, busy_pattern: tuple[tuple[bool, ...], ...], last: int) -> list[tuple[int, list[int]]]:
    """The fleet under the rules; ``busy_pattern[n][e]``: engine e still runs requests at step n's start (only
    possible when it has requests of a step > n). Returns per step its rows' versions."""
    K = len(busy_pattern[0])
    versions = [-1] * K
    started, queue, out = -1, {}, []  # queue: step -> engines that got its requests, with their versions
    for n in range(last):
        rows = queue.pop(n, None)
        has_work = [any(e in q for s, q in queue.items()) for e in range(K)]
        busy = [busy_pattern[n][e] and has_work[e] for e in range(K)]
        if rows is None:  # a synchronous step: every engine drained and reloaded
            busy = [False] * K
        for e in range(K):
            if not busy[e]:
                versions[e] = n
        if rows is None:
            rows = {e: n for e in range(K)}
        out.append((n, list(rows.values())))
        for s in steps_to_start(n, started, k, last):
            ok = eligible_K(s, np.array(versions), k)
            if not ok.any():
                break
            queue[s] = {e: versions[e] for e in np.flatnonzero(ok)}
            started = s
        assert len(queue) <= k
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_rules_keep_every_row_within_k_steps_for_every_busy_pattern(k):
    last, K = 6, 2
    patterns = list(itertools.product([False, True], repeat=K))
    stale_seen = set()
    for busy in itertools.product(patterns, repeat=last):
        for step, versions in _simulate(k, busy, last):
            assert all(step - k <= v <= step for v in versions), (busy, step, versions)
            stale_seen.add(max(step - v for v in versions))
    assert stale_seen == set(range(k + 1))  # every staleness up to k happens: the bound is tight


def test_pure_rules():
    assert list(steps_to_start(0, -1, 2, 10)) == [1, 2] and list(steps_to_start(3, 4, 2, 10)) == [5]
    assert list(steps_to_start(8, 8, 2, 10)) == [9] and list(steps_to_start(3, -1, 0, 10)) == []
    assert eligible_K(5, np.array([3, 2, -1, 5]), 2).tolist() == [True, False, False, True]
    mean, worst = token_staleness(5, np.array([5, 3]), np.array([3, 1]))
    assert (mean, worst) == (0.5, 2.0)
    assert busy_seconds([(0, 2), (1, 3), (5, 9)], 1, 6) == 3.0 and busy_seconds([[4, float("inf")]], 1, 6) == 2.0


class _Gate:
    """Fake engines: every sample answers at once, except engine 1's samples of the steps in ``held``, which wait
    for ``release``."""

    def __init__(self):
        self.held, self.release, self.reloads = set(), threading.Event(), []


def _source(tmp_path, gate: _Gate, k: int = 2, steps: int = 6) -> VLLMSource:
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.training.steps, cfg.rl.sft_warmup_steps = steps, 0
    cfg.rl.max_staleness, cfg.rl.samples_per_prompt = k, 2
    cfg.rollout_engine.urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None,
                     export=lambda folder: None, policy_logprobs=None, rank=0, dp_rank=0)
    src.prompts = type("P", (), {"prompts": lambda self, step: ([f"ex{step}"] * 2, [[step, 1], [step, 2]])})()
    src.probe = lambda ids: 0.0
    for e in src.engines:
        e.connect = lambda url, e=e: setattr(e, "client", type("C", (), {"url": url})())
        e.prepare = lambda: None

        def reload(folder, version, e=e):
            gate.reloads.append((e.index, version))
            e.version = version
        e.reload = reload

        def sample(job, e=e):
            step = job["prompt_ids"][0]
            if e.index == 1 and step in gate.held:
                assert gate.release.wait(10)
            return Completion(job["prompt_ids"], [7, 8], [-1.0, -1.0], None, "stop")
        e.sample = sample

    def build(f):
        f.versions_B = np.array([c.served_version for g in f.groups for c in g])
        f.version = int(f.versions_B.min())
        f.batch = ("batch", f.step, [[(c.engine, c.served_version) for c in g] for g in f.groups])
        return f.batch
    src._build = build
    return src


def test_a_busy_engine_keeps_generating_on_its_weights_while_the_idle_one_reloads(tmp_path):
    gate = _Gate()
    gate.held = {2}
    src = _source(tmp_path, gate)
    assert {v for g in src.next_batch(0)[2] for _, v in g} == {0}  # a synchronous step
    assert sorted(src.queue) == [1, 2] and gate.reloads == [(0, 0), (1, 0)]
    src.poll(1)
    while src.queue[2].busy_K(2)[0]:  # engine 0's share of step 2 answered (engine 1's is held)
        time.sleep(0.01)
    b1 = src.next_batch(1)  # engine 1 still answers step 2: only engine 0 is reloaded
    assert gate.reloads[2:] == [(0, 1)], gate.reloads
    assert {v for g in b1[2] for _, v in g} == {0}
    assert src.queue[3].dealt.engine_g.tolist() == [0, 0]  # step 3 needs weights >= 1: engine 0 only
    gate.release.set()
    src.poll(2)
    src.queue[3].thread.join()  # engine 0's answers of step 3 back: idle at step 2's start
    b2 = src.next_batch(2)
    assert {v for g in b2[2] for _, v in g} == {0}  # started with weights 0, two steps old: within k = 2
    assert sorted(gate.reloads[3:]) == [(0, 2), (1, 2)]  # idle again: both reloaded
    src.poll(3)
    src.queue[4].thread.join()
    b3 = src.next_batch(3)
    assert {(e, v) for g in b3[2] for e, v in g} == {(0, 1)}
    assert src.timings["rollout/in_flight"] == 2.0 and 0.0 <= src.timings["rollout/engine_idle_frac"] <= 1.0

    # a checkpoint after step 3 waits for steps 4 and 5 and saves both; a resume holds both, built again
    src.save_in_flight(str(tmp_path / "ck"))
    again = _source(tmp_path, _Gate())
    assert again.load_in_flight(str(tmp_path / "ck"), 4)
    assert sorted(again.queue) == [4, 5] and again.started == 5
    assert [again.queue[s].batch for s in (4, 5)] == [src.queue[s].batch for s in (4, 5)]
    assert again.expected_response == src.expected_response
