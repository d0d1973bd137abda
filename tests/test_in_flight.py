"""k steps in flight (``rollouts/sources/in_flight.py``) without an engine: the queue rules brute-forced, and the
live source's step loop over two fake engines, one held busy across a step start (the live run is in
test_vllm_fleet.py).

- over every pattern of busy engines (K = 2, 6 steps, k = 1..3), a simulation of the fleet under the module's
  rules (idle engines reload, each step's requests go to the engines recent enough for it) never trains a row
  older than k steps, never holds more than k steps, and starts every step at the latest at its own start;
- the source itself: an engine still answering step 2's requests at step 1's start is not reloaded, step 3's
  requests go only to the reloaded engine, step 2's rows keep the weights they started with, and every engine
  is reloaded again once idle; a checkpoint between steps waits for the generations in flight and a resume holds
  every started step's rows;
- taking the first finished groups (``first_finished.py``): ``select`` against its definition over random small
  pools; every pattern of answer lags (4 steps x 2 groups, lags 0 / 1 / 3 steps) simulated under the rule: G groups
  per step, none twice, none older than k, later steps' groups taken (k >= 2), a dry pool regenerated (it happens);
  the source on fake engines (a held group: a later step's group taken, the held one dropped when stale, a
  checkpoint of the pool resumed exactly), and on two gloo ranks (a step leaves both ranks' queues at once).
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from distributed_helpers import end_rank, rank_results, run_ranks

from titan_foremoe.config.job_config import JobConfig
from titan_foremoe.rollouts.engines.vllm_api import Completion
from titan_foremoe.rollouts.sources.first_finished import select
from titan_foremoe.rollouts.sources.in_flight import StaleRollout, busy_seconds, eligible_K, steps_to_start, token_staleness
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

    def __init__(self, engine: int | None = 1, release_at: int | None = None):
        self.held, self.release, self.reloads = set(), threading.Event(), []
        self.engine, self.release_at = engine, release_at  # engine None: every engine; release_at: a step asked

    def holds(self, engine: int, step: int) -> bool:
        if self.release_at is not None and step >= self.release_at:
            self.release.set()
        return step in self.held and self.engine in (None, engine)


def _source(tmp_path, gate: _Gate, k: int = 2, steps: int = 6, first_finished: bool = False, rank: int = 0,
            groups: int = 2) -> VLLMSource:
    cfg = JobConfig()
    cfg.rl.take_first_finished = first_finished
    cfg.job.dump_folder = str(tmp_path)
    cfg.training.steps, cfg.rl.sft_warmup_steps = steps, 0
    cfg.rl.max_staleness, cfg.rl.samples_per_prompt = k, 2
    cfg.rollout_engine.urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None,
                     export=lambda folder: None, policy_logprobs=None, rank=rank, dp_rank=rank)
    src.prompts = type("P", (), {"prompts": lambda self, step: ([f"ex{step}"] * groups,
                                                                [[step, 1 + i + 10 * rank] for i in range(groups)])})()
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
            if gate.holds(e.index, step):
                assert gate.release.wait(10)
            return Completion(job["prompt_ids"], [7, 8], [-1.0, -1.0], None, "stop")
        e.sample = sample

    def build(f):
        f.versions_B = np.array([c.served_version for g in f.groups for c in g])
        f.version = int(f.versions_B.min())
        f.extra = {}
        f.batch = ("batch", f.step, [[(c.engine, c.served_version) for c in g] for g in f.groups],
                   [tuple(p) for p in f.prompts])
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


# -- taking the first finished groups (``sources/first_finished.py``) ------------------------------------------

def _keys(steps, index, chosen):
    return [(int(steps[p]), int(index[p])) for p in chosen]


def test_select_takes_the_oldest_finished_fresh_groups_for_every_small_pool():
    """Every pool of 5 free groups (steps N-1..N+2, finished or not, versions N-3..N): ``select`` takes G
    groups, all finished and within k, none of the eligible left out older than one taken, in (step,
    index) order; None exactly when fewer than G are eligible; it drops exactly the finished stale ones."""
    N, k, G = 3, 2, 2
    cells = list(itertools.product([N - 1, N, N + 1, N + 2], [True, False], range(N - 3, N + 1)))
    rng = np.random.default_rng(0)
    for _ in range(20000):
        pick = [cells[c] for c in rng.integers(len(cells), size=5)]
        steps = np.array([c[0] for c in pick])
        index = np.arange(5)
        fin, versions = (np.array([c[j] for c in pick]) for j in (1, 2))
        chosen, dropped = select(N, k, G, steps, index, fin, versions)
        eligible = [p for p in range(5) if fin[p] and N - versions[p] <= k]
        assert sorted(dropped.tolist()) == [p for p in range(5) if fin[p] and N - versions[p] > k]
        if len(eligible) < G:
            assert chosen is None
            continue
        keys = _keys(steps, index, chosen)
        assert len(chosen) == G and set(chosen.tolist()) <= set(eligible) and keys == sorted(keys)
        left = [(steps[p], index[p]) for p in eligible if p not in chosen]
        assert all(l > max(keys) for l in left), (pick, keys, left)


def _simulate_first_finished(k: int, G: int, last: int, lag: dict) -> list[list[tuple[int, int, int]]]:
    """The pool over time: group (s, i) is requested at step max(s - k, 0)'s start from that step's weights and
    answered ``lag[s, i]`` steps later; step N takes (after step N - 1's update, time N - 0.5, or later when too few
    are finished: the time then advances by halves) under ``select``; when every started group is finished and too
    few are fresh, the most recently dropped prompts are generated again from the newest weights (``_regenerate``).
    Per step its taken (step, index, version, generated again)."""
    groups = [(s, i) for s in range(1, last) for i in range(G)]
    used = set()
    out = [[(0, i, 0, False) for i in range(G)]]  # step 0: synchronous
    dropped_keys, regen = [], []
    for n in range(1, last):
        t = n - 0.5
        while True:
            pool = [g for g in groups if g not in used and max(g[0] - k, 0) <= n - 1 + 0.5]  # started by now
            steps = np.array([g[0] for g in pool], np.int64)
            index = np.array([g[1] for g in pool], np.int64)
            version = np.array([max(g[0] - k, 0) for g in pool], np.int64)
            fin = np.array([max(g[0] - k, 0) + lag[g] <= t for g in pool], bool)
            chosen, dropped = select(n, k, G, steps, index, fin, version)
            used |= {pool[p] for p in dropped}
            dropped_keys += [pool[p] for p in dropped]
            if chosen is not None:
                break
            if fin.all():  # every started group finished, too few fresh: dropped prompts generated again
                fresh = [p for p in np.lexsort((index, steps)) if fin[p] and n - version[p] <= k]
                regen = [(*dropped_keys.pop(), n - 1, True) for _ in range(G - len(fresh))]  # the newest weights
                chosen = np.array(fresh, np.int64)
                break
            t += 0.5
        used |= {pool[p] for p in chosen}
        out.append([(int(steps[p]), int(index[p]), int(version[p]), False) for p in chosen] + regen)
        regen = []
    return out


@pytest.mark.parametrize("k", [1, 2])
def test_first_finished_rule_over_every_lag_pattern(k):
    """Every pattern of answer lags (0, 1 or 3 steps) of 4 steps x 2 groups: each step trains G groups, none
    twice (a dropped group's prompt generated again at most once, when the pool runs dry), none older than k; steps train later steps' groups (only with k >= 2: with k = 1 no later step is in flight at the
    take; ``select``'s test checks they come after every older finished one); with
    every group answered at once it trains exactly its own groups (the synchronous order)."""
    G, last = 2, 5
    keys = [(s, i) for s in range(1, last) for i in range(G)]
    later_seen = regenerated = False
    for lags in itertools.product([0, 1, 3], repeat=len(keys)):
        lag = dict(zip(keys, lags))
        taken = _simulate_first_finished(k, G, last, lag)
        flat = [(s, i) for rows in taken[1:] for s, i, _, again in rows if not again]
        again = [(s, i) for rows in taken[1:] for s, i, _, a in rows if a]
        assert len(flat) == len(set(flat)) and len(again) == len(set(again)) and not set(flat) & set(again), taken
        regenerated |= bool(again)
        for n, rows in enumerate(taken):
            assert len(rows) == G and all(n - v <= k for _, _, v, _ in rows), (n, rows)
            later_seen |= any(s > n for s, _, _, _ in rows)
    assert regenerated == (k >= 2)  # after drops the last steps may run dry (k = 1 drops nothing): the fallback
    assert later_seen == (k >= 2)  # k = 1: at step N's take only step N's own groups are in flight
    prompt = _simulate_first_finished(k, G, last, dict.fromkeys(keys, 0))
    assert [[(s, i) for s, i, _, _ in rows] for rows in prompt] == [[(n, i) for i in range(G)] for n in range(last)]


def _settle(src, gate: _Gate, timeout_s: float = 10.0) -> None:
    """Wait until every started step's groups have landed but the held ones: the fake engines answer at once, but
    each step on its own thread, so on a loaded machine a later step's groups can land first and the first-finished
    take would then (rightly) pick them; the tests below fix the order to check the rule, not the thread race."""
    deadline = time.monotonic() + timeout_s

    def pending() -> int:
        n = 0
        for step, f in list(src.queue.items()):
            d = f.dealt
            if f.groups is not None or d is None:
                continue
            for i, g in enumerate(list(d.groups)):
                held = step in gate.held and gate.engine in (None, int(d.engine_g[i])) and not gate.release.is_set()
                n += g is None and not held
        return n

    while pending() and time.monotonic() < deadline:
        time.sleep(0.005)


def test_first_finished_source_takes_later_groups_drops_stale_and_resumes_exactly(tmp_path):
    """The source on two fake engines, k = 2, ``take_first_finished``: engine 1 holds step 1's second group, so
    step 1 trains its first group and step 2's first (metric ``rollout/taken_from_later_steps``), step 2 trains
    step 2's and 3's next ones; released at step 3's take, step 1's held group (weights 0, three steps old) is
    dropped and counted; every trained row is within k. A checkpoint then holds the pool and the taken step; a
    resume trains on exactly the saved rows and takes the next step from the saved pool in (step, index) order."""
    gate = _Gate()
    gate.held = {1}
    src = _source(tmp_path, gate, first_finished=True)

    def prompts(batch):
        return [p[0] * 10 + p[1] for p in batch[3]]  # step * 10 + index + 1

    assert prompts(src.next_batch(0)) == [1, 2]
    _settle(src, gate)
    b1 = src.poll(1)
    assert prompts(b1) == [11, 21] and src.next_batch(1) is b1
    assert src.timings["rollout/taken_from_later_steps"] == 1.0
    assert gate.reloads[2:] == [(0, 1)]  # engine 1 still answers step 1: not reloaded
    _settle(src, gate)
    assert prompts(src.poll(2)) == [22, 31]  # step 2's second group, then step 3's first
    assert src.next_batch(2)[1] == 2
    gate.release.set()
    src.queue[1].thread.join()
    _settle(src, gate)
    b3 = src.poll(3)
    assert prompts(b3) == [32, 41] and src.dropped_stale == 2  # step 1's held group: weights 0, 3 steps old
    for b, n in ((b1, 1), (b3, 3)):
        assert all(n - 2 <= v <= n for g in b[2] for _, v in g), (n, b)
    src.save_in_flight(str(tmp_path / "ck"))
    with pytest.raises(StaleRollout, match="with \\[rl\\] take_first_finished: resume it with the same setting"):
        _source(tmp_path, _Gate()).load_in_flight(str(tmp_path / "ck"), 3)
    again = _source(tmp_path, _Gate(), first_finished=True)
    assert again.load_in_flight(str(tmp_path / "ck"), 3)
    assert again.next_batch(3) == src.next_batch(3) == b3
    _settle(again, _Gate())
    _settle(src, gate)
    assert prompts(again.poll(4)) == prompts(src.poll(4)) == [42, 51]
    assert again.timings["rollout/dropped_stale"] == 0.0 and src.timings["rollout/dropped_stale"] == 2.0


def _two_ranks_pool(rank: int, world: int, tmp: str, out: str) -> None:
    import datetime
    import json

    import torch.distributed as dist

    from titan_foremoe.distributed import collectives

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    gate = _Gate(engine=None, release_at=3)
    gate.held = {1} if rank == 0 else set()
    src = _source(f"{tmp}/r{rank}", gate, first_finished=True, rank=rank, groups=1, steps=5)
    taken, queues = [], []

    def agreed(what):
        queues.append(collectives.all_gather_objects((what, sorted(src.queue))))

    taken.append(src.next_batch(0)[3])
    agreed("step 0")
    for n in range(1, 5):
        if n == 2 and rank == 0:
            src.queue[1].thread.join()  # released by step 3's request at step 1's start
        _settle(src, gate)
        batch = src.poll(n)
        agreed(f"poll {n}")
        assert src.next_batch(n) is batch
        agreed(f"step {n}")
        taken.append(batch[3])
    end_rank(out, rank, {"taken": [[list(p) for p in t] for t in taken], "queues": queues,
                         "dropped": src.dropped_stale})


def test_two_ranks_take_different_steps_groups_and_keep_the_same_steps_in_flight(tmp_path):
    """Two gloo ranks, one group per step each, k = 2: rank 0's step-1 group is held until step 3 is requested, so
    at step 1 rank 0 trains its step-2 group while rank 1 trains its own; a step leaves both ranks' queues at once
    (their collectives would pair other steps otherwise: a hang), and step 2 trains the held group."""
    run_ranks(_two_ranks_pool, 2, str(tmp_path), str(tmp_path), apply_patches=False)
    r0, r1 = rank_results(tmp_path, 2)
    assert r0["taken"] == [[[0, 1]], [[2, 1]], [[1, 1]], [[3, 1]], [[4, 1]]], r0["taken"]
    assert r1["taken"] == [[[n, 11]] for n in range(5)], r1["taken"]
    for every in r0["queues"]:
        (what, q0), (_, q1) = every
        assert q0 == q1, (what, q0, q1)
    assert r0["dropped"] == r1["dropped"] == 0
