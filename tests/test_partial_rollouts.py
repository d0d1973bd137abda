"""Partial rollouts (``[rl] rollout_token_budget``) without an engine (the live run is in test_vllm_fleet.py).

- ``extend``: a response generated in chunks under several weights keeps, per token, the version and log-prob it
  was sampled with, and per fed position the route recorded when that position was first fed (a brute-force
  replay of the chunks is the oracle);
- ``split``: which groups train, are carried or dropped, against a brute-force age rule;
- a ``VLLMSource`` over two fake engines that generate token by token and honour ``abort`` by id: every step
  stops at the budget, trains finished groups only, continues the rest under later weights (each token's
  log-prob is the fake model's under that token's version, its route the one of the chunk that first fed it),
  drops responses older than ``partial_max_staleness``, and a checkpoint's carry resumes exactly;
- the config errors.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from titan_foremoe.config import ConfigError
from titan_foremoe.config.job_config import JobConfig
from titan_foremoe.config.validate import validate
from titan_foremoe.rollouts.engines.vllm_api import Completion
from titan_foremoe.rollouts.partial import Group, Partial, StopRule, continuation, extend, split
from titan_foremoe.rollouts.sample import ModelSpec

X, K, E, P = 2, 2, 8, 3  # MoE layers, top-k, experts, prompt tokens


def route(t: int, version: int) -> np.ndarray:
    """The fake model's experts of fed position t under the weights of ``version`` ``[X, K]``."""
    return np.array([[(t + version + x) % E, (t + 2 * version + x + 1) % E] for x in range(X)], np.uint8)


def logprob(t: int, version: int) -> float:
    """The fake model's log-prob of the token at position t under the weights of ``version``."""
    return -(version + 0.001 * t)


def answer(prompt_ids: list[int], new: int, version: int, finish: str) -> Completion:
    """What an engine on ``version``'s weights answers to ``prompt_ids`` with ``new`` tokens: every fed position's
    route recomputed under ``version`` (prefix included), the new tokens' log-probs."""
    n = len(prompt_ids)
    toks = [10 + n + i for i in range(new)]
    routes = np.stack([route(t, version) for t in range(n + new - 1)]) if new else None
    return Completion(list(prompt_ids), toks, [logprob(n + i, version) for i in range(new)], routes, finish)


def test_extend_keeps_each_tokens_version_logprob_and_first_route():
    rng = random.Random(0)
    for _ in range(50):
        p = Partial(list(range(P)))
        chunks = [(rng.randint(0, 5), v) for v in range(rng.randint(1, 5))]
        first_fed: dict[int, int] = {}  # brute force: position -> the version of the first answer that routed it
        for new, v in chunks:
            prompt, _ = continuation(p, 100)
            c = answer(prompt, new, v, "abort")
            for t in range(len(prompt) + new - 1 if new else 0):  # no token back: no routes back either
                first_fed.setdefault(t, v)
            extend(p, c.token_ids, c.logprobs, c.routes_RXK if new else None, "abort", v)
        want_v = [v for new, v in chunks for _ in range(new)]
        assert p.versions == want_v
        assert p.logprobs == [logprob(P + i, v) for i, v in enumerate(want_v)]
        assert p.token_ids == [10 + P + i for i in range(len(want_v))]
        if want_v:
            assert p.routes_RXK.shape == (P + len(want_v) - 1, X, K)
            assert all((p.routes_RXK[t] == route(t, first_fed[t])).all() for t in range(len(p.routes_RXK)))
    with pytest.raises(ValueError, match="route rows"):
        extend(Partial([1, 2]), [5, 6], [0.0, 0.0], np.zeros((2, X, K), np.uint8), "stop", 0)


def _group(uid, versions_per_sample, finished):
    return Group(uid, None, [1, 2, 3], 0, [Partial([1, 2, 3], [9] * len(vs), [0.0] * len(vs), list(vs), None,
                                                   "stop" if f else "abort")
                                           for vs, f in zip(versions_per_sample, finished)])


def test_split_trains_finished_groups_carries_the_rest_and_drops_the_stale():
    rng = random.Random(1)
    for _ in range(300):
        step, bound = rng.randint(0, 6), rng.randint(1, 3)
        vs = [[rng.randint(max(0, step - 4), step) for _ in range(rng.randint(0, 3))] for _ in range(2)]
        fin = [rng.random() < 0.6 and bool(v) for v in vs]
        g = _group(0, vs, fin)
        train, carry, drop = split([g], step, bound)
        ages = [step - v for s in vs for v in s]
        oldest = max(ages, default=-1)
        if all(fin):
            want = "train" if oldest <= bound else "drop"
        else:
            want = "carry" if oldest + 1 <= bound else "drop"
        got = "train" if train else "carry" if carry else "drop"
        assert got == want, (step, bound, vs, fin)


def test_stop_rule_counts_finished_groups_and_tokens():
    gs = [Group(u, None, [1], 0, [Partial([1]) for _ in range(2)]) for u in range(4)]
    rule = StopRule(0.5, gs)
    fired = []
    rule.on_stop = lambda: fired.append(1)
    rule.answered(0, 3, True)
    rule.answered(1, 3, True)
    assert not rule.stop.is_set()  # one group of four finished
    rule.answered(0, 4, True)
    assert not rule.stop.is_set() and rule.done_groups == 1
    rule.answered(1, 1, False)
    rule.answered(1, 1, True)
    assert rule.stop.is_set() and fired == [1]
    rule = StopRule(10, gs)  # tokens of finished groups
    rule.answered(2, 6, True)
    rule.answered(2, 3, True)
    assert not rule.stop.is_set()
    rule.answered(3, 1, True)
    rule.answered(3, 0, True)
    assert rule.stop.is_set() and rule.done_tokens == 10


# -- the source over fake engines -----------------------------------------------------------------------------
class _FakeEngineClient:
    """Generates a response token by token (``TICK`` s each) on the weights of ``version``; its total length is
    the prompt's first id; ``abort`` by id answers the running request with what it has."""

    TICK = 0.004

    def __init__(self, url, state):
        self.url, self.state = url, state
        self.aborted: set[str] = set()
        self.lock = threading.Lock()

    def _before_threads(self):
        pass

    def abort(self, ids):
        with self.lock:
            self.aborted |= set(ids)
            self.state["aborts"] += len(ids)

    def _sample(self, prompt_ids, max_tokens, temperature, top_p, seed, request_id=None):
        version = self.state["version"]
        total = prompt_ids[0]
        done = len(prompt_ids) - P
        want = min(total - done, max_tokens)
        new = 0
        while new < want:
            with self.lock:
                if request_id in self.aborted:
                    return answer(prompt_ids, new, version, "abort")
            time.sleep(self.TICK)
            new += 1
        return answer(prompt_ids, new, version, "stop" if done + new == total else "length")


@dataclass
class _Ex:
    prompt: str
    answer: str = ""


class _Tok:
    pad_id, eos_ids = 0, (1,)

    def decode(self, ids):
        return " ".join(map(str, ids))


class _Prompts:
    def prompts(self, step):
        rng = random.Random(step)
        lengths = [rng.choice([4, 6, 40, 80]) for _ in range(4)]
        return [_Ex(f"s{step}p{i}") for i in range(4)], [[n, 7, step] for n in lengths]


def _fake_source(tmp_path, state, **rl):
    from titan_foremoe.rollouts.sources.vllm import VLLMSource

    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.training.steps = 20
    cfg.rollout_engine.urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    cfg.rollout_engine.concurrency = 2
    cfg.rl.samples_per_prompt, cfg.rl.max_new_tokens = 2, 100
    cfg.rl.rollout_token_budget, cfg.rl.rollout_is = 0.5, "token"
    for k, v in rl.items():
        setattr(cfg.rl, k, v)
    src = VLLMSource(cfg, prompts=_Prompts(), tokenizer=_Tok(), task=None, reward_fn=lambda task, ex, c: 1.0,
                     spec=ModelSpec(X, K, E, 1000), export=None, policy_logprobs=None, rank=0, dp_rank=0)
    for e in src.engines:
        e.connect = lambda url, e=e: setattr(e, "client", _FakeEngineClient(url, state))
        e.connect(e.slot.url)
    src.sync_weights = lambda only=None: state.update(version=src.version)
    src.probe = lambda ids: 0.0
    return src


@pytest.mark.parametrize("chunk", [0, 8])  # one request per response (abort only), or chunks of 8 tokens
def test_source_trains_finished_groups_and_continues_the_rest_per_token(tmp_path, chunk):
    state = {"version": -1, "aborts": 0}
    src = _fake_source(tmp_path, state, partial_max_staleness=2, rollout_chunk_tokens=chunk)
    seen_multi, trained, metrics = False, 0, []
    for step in range(6):
        batch = src.next_batch(step)
        m = {k: v for k, v in src.timings.items() if k.startswith("rollout/")}
        metrics.append(m)
        B = len(batch.rollout.lengths_B)
        assert B % 2 == 0 and B >= 2  # whole groups, at least the budget's
        for b in range(B):
            p, n = int(batch.rollout.prompt_lens_B[b]), int(batch.rollout.lengths_B[b])
            toks = batch.rollout.tokens_BT[b, :n].tolist()
            vs = batch.versions_BT[b, p:n].tolist()
            assert n - p == toks[0], "only finished responses train (full length)"
            assert vs == sorted(vs) and step - 2 <= vs[0] and vs[-1] <= step
            assert np.allclose(batch.rollout.logprobs_BT[b, p:n].numpy(),
                               [logprob(t, v) for t, v in zip(range(p, n), vs)])
            routes = batch.rollout.routes.routes_at(torch.full((n - 1,), b), torch.arange(n - 1)).numpy()
            for t in range(n - 1):  # the route of the chunk that first fed t: the version of the token after it
                want = route(t, vs[0] if t < p else vs[t - p + 1]).astype(np.int64)
                assert (np.sort(routes[t], -1) == np.sort(want, -1)).all(), (step, b, t)
            seen_multi |= len(set(vs)) > 1
            trained += 1
        assert all(not g.finished for g in src.carry.groups)
    assert seen_multi, "no response spanned two weight versions"
    assert state["aborts"] > 0 or chunk
    assert max(m["rollout/partial_fraction"] for m in metrics) > 0
    assert max(m["rollout/versions_per_response_max"] for m in metrics) >= 2
    assert all(0 <= m["rollout/engine_idle_fraction"] <= 1 for m in metrics)


def test_stale_responses_are_dropped_and_counted(tmp_path):
    state = {"version": -1, "aborts": 0}
    src = _fake_source(tmp_path, state, partial_max_staleness=1, rollout_token_budget=0.25)
    for step in range(10):  # which responses outlive a version depends on the fake engines' timing: run until one
        # has (4 steps were not always enough under CI's load)
        batch = src.next_batch(step)
        for b in range(len(batch.rollout.lengths_B)):
            p, n = int(batch.rollout.prompt_lens_B[b]), int(batch.rollout.lengths_B[b])
            assert step - 1 <= min(batch.versions_BT[b, p:n].tolist())
        if step >= 3 and src.carry.dropped_stale:
            break
    assert src.carry.dropped_stale > 0 and src.timings["rollout/dropped_stale_total"] == src.carry.dropped_stale


def test_a_checkpoints_unfinished_responses_resume_exactly(tmp_path):
    import pickle

    state = {"version": -1, "aborts": 0}
    src = _fake_source(tmp_path / "a", state, partial_max_staleness=3)
    for step in range(2):
        src.next_batch(step)
    assert src.carry.groups, "nothing unfinished to save"
    src.save_in_flight(str(tmp_path / "ck"))
    saved = pickle.dumps(src.carry.state_dict())
    back = _fake_source(tmp_path / "b", state, partial_max_staleness=3)
    assert not back.load_in_flight(str(tmp_path / "ck"), 2)  # no in-flight rows (synchronous), the carry only
    assert pickle.dumps(back.carry.state_dict()) == saved
    prefixes = {g.uid: [(s.token_ids, s.versions, s.logprobs) for s in g.samples] for g in back.carry.groups}
    batch = back.next_batch(2)
    assert back.carry.next_uid == src.carry.next_uid + 4  # uids go on from the saved ones
    continued = 0
    for b in range(len(batch.rollout.lengths_B)):  # a carried group trained now starts with its saved tokens
        p, n = int(batch.rollout.prompt_lens_B[b]), int(batch.rollout.lengths_B[b])
        toks, vs = batch.rollout.tokens_BT[b, p:n].tolist(), batch.versions_BT[b, p:n].tolist()
        for samples in prefixes.values():
            for t, v, lp in samples:
                if t and toks[: len(t)] == t and vs[: len(v)] == v and batch.rollout.prompt_lens_B[b] == P:
                    assert np.allclose(batch.rollout.logprobs_BT[b, p: p + len(lp)].numpy(), lp)
                    continued += 1
    assert continued > 0


def test_config_errors():
    from pathlib import Path

    from titan_foremoe.config import load_config

    def error(*overrides):
        with pytest.raises(ConfigError) as e:
            validate(load_config(Path(__file__).resolve().parents[1] / "train_configs/debug_tiny_rl.toml",
                                 list(overrides)), 4)
        return str(e.value)

    assert "[rl] rollout_token_budget: must be >= 0" in error("--rl.rollout_token_budget=-1")
    assert "needs rollout_source = 'vllm'" in error("--rl.rollout_token_budget=0.5")  # the embedded source
    vllm = ("--rl.rollout_source=vllm", "--rl.rollout_is=token")
    assert "needs max_staleness = 0" in error("--rl.rollout_token_budget=0.5", "--rl.max_staleness=1", *vllm)
    assert "rollout_token_budget: continued responses" in error("--rl.rollout_token_budget=0.5",
                                                                 "--rl.rollout_source=vllm")
    assert "[rl] partial_max_staleness: must be >= 1" in error("--rl.partial_max_staleness=0")
