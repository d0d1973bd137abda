"""A hung engine (``rollouts/fleet/hang.py``) against fake vLLM 0.28 HTTP engines (``fake_vllm.py``): found
within ~hang_timeout_s, its unanswered requests answered once by the other engine; a slow engine that still makes
tokens is not hung; a launched hung engine is killed and restarted, a user-run one stays out of the deal until it
moves again. A sample's tokens name its request and seed (``[prompt[0], seed]``), so a lost or repeated sample
shows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import fake_vllm
from distributed_helpers import end_rank
from fake_vllm import FakeVLLM
from titan_foremoe.rollouts.fleet.client import FleetClient
from titan_foremoe.rollouts.fleet.engine import VLLMEngine
from titan_foremoe.rollouts.fleet.hang import HangWatch, Look, look, parse_metrics
from titan_foremoe.rollouts.fleet.layout import engine_layout

HANG = 1.0  # hang_timeout_s of these tests


class Cfg:
    concurrency, max_restarts, request_timeout_s, retries, hang_timeout_s = 3, 1, 60.0, 0, HANG


def _fleet(urls: list[str]) -> FleetClient:
    layout = engine_layout(trainer_gpus=1, gpus_per_node=1, engines=0, gpus_per_engine=1, colocated=False, urls=urls)
    engines = [VLLMEngine(slot, Cfg(), version=3) for slot in layout.engines]
    for e in engines:
        e.connect(e.slot.url)
    return FleetClient(engines)


def _requests(k: int, n: int = 3):
    return [dict(prompt_ids=[i + 1] * 4, n=n, max_tokens=2, temperature=1.0, top_p=1.0, seed=100 * i)
            for i in range(k)]


def _ids(groups):
    return sorted((c.token_ids[0], c.token_ids[1]) for g in groups for c in g)


def _all(k: int, n: int = 3):
    return sorted((i + 1, 100 * i + j) for i in range(k) for j in range(n))


def _generate(fleet: FleetClient, k: int):
    d = fleet.deal(_requests(k), 2)
    first = d.first_g.copy()
    t0 = time.monotonic()
    fleet.send(d)
    groups, engine_g = fleet.finish(d)
    return groups, engine_g, first, time.monotonic() - t0


def test_an_engine_that_stops_answering_is_hung_within_its_timeout_and_the_other_answers_once(caplog):
    good, bad = FakeVLLM(), FakeVLLM(hang_after=2)  # bad answers 2 samples, then takes requests and stalls
    try:
        fleet = _fleet([good.url, bad.url])
        groups, engine_g, first, took = _generate(fleet, 8)
        assert (first == 1).sum() >= 2  # engine 1 was dealt requests it never finished
        assert took < HANG + 2.5, took  # not request_timeout_s (60 s here)
        assert _ids(groups) == _all(8)  # every sample of every prompt once
        assert all(len({c.engine for c in g}) == 1 for g in groups)
        assert set(engine_g[first == 1].tolist()) == {0}  # re-dealt to the other engine
        m = fleet.metrics()
        assert not fleet.engines[1].alive and m["rollout/engine_1/failures"] == 1 and m["rollout/engines_alive"] == 1
        assert m["rollout/engine_0/samples"] + m["rollout/engine_1/samples"] == 24  # partial samples not counted
        line = next(r.getMessage() for r in caplog.records if "failed mid-step" in r.getMessage())
        assert f"vLLM engine 1 at {bad.url} hung: no progress for" in line and "stuck at" in line, line
        assert "\n" not in line
        _, engine_g, _, _ = _generate(fleet, 3)  # the next step deals it nothing
        assert 1 not in engine_g.tolist()
    finally:
        good.close()
        bad.close()


def test_a_slow_engine_that_still_makes_tokens_is_not_hung():
    slow = FakeVLLM(delay_s=2.5 * HANG, tick_s=0.1)  # each answer takes 2.5 hang_timeout_s, tokens move meanwhile
    try:
        fleet = _fleet([slow.url])
        groups, engine_g, _, took = _generate(fleet, 1)
        assert took > 2.5 * HANG and _ids(groups) == _all(1) and fleet.engines[0].alive
        assert fleet.metrics()["rollout/engine_0/failures"] == 0
    finally:
        slow.close()


def test_without_the_watch_the_same_engine_holds_the_step_until_the_request_timeout():
    """The test above can fail: with ``hang_timeout_s = 0`` the stalled engine is waited for to the end."""
    good, bad = FakeVLLM(), FakeVLLM(hang_after=0)
    try:
        fleet = _fleet([good.url, bad.url])
        for e in fleet.engines:
            e.cfg.hang_timeout_s, e.cfg.request_timeout_s = 0.0, 2 * HANG + 1
            e.connect(e.url)
        groups, _, _, took = _generate(fleet, 2)
        assert took >= 2 * HANG + 1 and _ids(groups) == _all(2)
    finally:
        good.close()
        bad.close()


def _two_ranks(rank, world, urls, out):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    fleet = _fleet(urls)
    # LPT over [rank 0: one small request; rank 1: two big ones]: big -> 0, big -> 1, small -> 0: rank 1 alone
    # has requests on engine 1, which takes them and never answers
    reqs = ([dict(prompt_ids=[1] * 2, n=2, max_tokens=2, temperature=1.0, top_p=1.0, seed=0)] if rank == 0 else
            [dict(prompt_ids=[10 + i] * 9, n=2, max_tokens=2, temperature=1.0, top_p=1.0, seed=1000 * i)
             for i in range(2)])
    d = fleet.deal(reqs, 2)
    fleet.send(d)
    saw = sorted(d.failed)
    groups, engine_g = fleet.finish(d)
    end_rank(out, rank, {"saw": saw, "first": d.first_g.tolist(), "engine": engine_g.tolist(), "ids": _ids(groups),
                         "hung": fleet.engines[1].hung, "alive": fleet.alive_K.tolist()})


def test_two_ranks_agree_on_the_hung_engine_and_both_know_it_hung(tmp_path):
    """Only rank 1 waits on the hung engine; rank 0 (a launched engine's owner in a disaggregated fleet: the one
    that kills and restarts it) learns it hung from the failure agreement, and rank 1's requests are answered once
    by engine 0."""
    from distributed_helpers import rank_results, run_ranks

    good, bad = FakeVLLM(), FakeVLLM(hang_after=0)
    try:
        run_ranks(_two_ranks, 2, [good.url, bad.url], str(tmp_path), apply_patches=False)
    finally:
        good.close()
        bad.close()
    r0, r1 = rank_results(tmp_path, 2)
    assert r0["first"] == [0] and r1["first"] == [0, 1] and r0["saw"] == [] and r1["saw"] == [1]
    assert r1["engine"] == [0, 0] and [tuple(x) for x in r1["ids"]] == [(10, 0), (10, 1), (11, 1000), (11, 1001)]
    for r in (r0, r1):
        assert r["alive"] == [True, False] and "vLLM engine 1" in r["hung"] and "hung: no progress" in r["hung"]


def test_a_stopped_server_process_is_hung_too():
    """SIGSTOP the whole fake server (its API process too): ``/metrics`` does not answer, the verdict says so."""
    good = FakeVLLM()
    proc = subprocess.Popen([sys.executable, fake_vllm.__file__], stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        fleet = _fleet([good.url, url])
        os.kill(proc.pid, signal.SIGSTOP)
        groups, engine_g, first, took = _generate(fleet, 6)
        assert (first == 1).any() and set(engine_g.tolist()) == {0} and _ids(groups) == _all(6)
        assert took < HANG + 3.5, took
        assert "/metrics did not answer" in fleet.engines[1].hung and "timed out" in fleet.engines[1].hung
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        good.close()


def test_the_watch_reads_vllm_counters_and_judges_by_them():
    text = ("# HELP vllm:generation_tokens_total x\n# TYPE vllm:generation_tokens_total counter\n"
            'vllm:generation_tokens_total{engine="0",model_name="m"} 40.0\n'
            'vllm:generation_tokens_total{engine="1",model_name="m"} 2.0\n'
            'vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n')
    assert parse_metrics(text).tokens == 42.0
    assert parse_metrics("other_total 5\n").tokens is None
    looks = iter([Look(True, 5.0), Look(True, 6.0), Look(True, 6.0), Look(True, 6.0), Look(False, error="refused")])
    now = [0.0]
    w = HangWatch("vLLM engine 0", "http://x", 4.0, looker=lambda url, t: next(looks), clock=lambda: now[0])
    verdicts = []
    for t in (1.0, 2.0, 5.0, 5.9, 7.0):
        now[0] = t
        verdicts.append(w.check(outstanding=3))
    assert verdicts[:4] == [None] * 4 and "no progress for 5.0 s" in verdicts[4]  # last progress at t = 2
    assert "did not answer" in verdicts[4] and "3 of this rank's samples" in verdicts[4]
    assert not look("http://127.0.0.1:9", 1.0).answered  # nothing listens there


def test_a_launched_hung_engine_is_killed_and_restarted_and_a_user_run_one_waits_until_it_moves(tmp_path):
    """Through the vLLM source: two launched (fake) engines; engine 1 hangs mid-step, its requests go to 0, its
    owner kills it and starts it again in the background, and at the next sync it serves again. Then user-run:
    a hung one stays out of the deal at the next sync (instead of blocking it) and rejoins once it moves."""
    from titan_foremoe.config.job_config import JobConfig
    from titan_foremoe.rollouts.sources.vllm import VLLMSource

    fakes: list[FakeVLLM] = []

    class Server:  # a launched engine: its start serves a fake; engine 1's first one hangs after 1 sample
        plan = {0: [None, None], 1: [1, None]}

        def __init__(self, spec):
            self.k = int(os.path.basename(spec.log_path).split("_")[1].split(".")[0])
            self.starts, self.fake, self.closed = 0, None, 0

        def start(self, folder):
            self.close()
            self.fake = FakeVLLM(hang_after=self.plan[self.k][self.starts])
            fakes.append(self.fake)
            self.starts += 1
            return self.fake.url

        def alive(self):
            return self.fake is not None

        def close(self):
            if self.fake is not None:
                self.closed += 1
                self.fake.close()
                self.fake = None

    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    e = cfg.rollout_engine
    e.engines, e.max_restarts, e.hang_timeout_s, e.request_timeout_s, e.concurrency = 2, 1, HANG, 60.0, 3
    src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None, export=lambda f: None,
                     policy_logprobs=None, rank=0, dp_rank=0)
    try:
        for engine in src.engines:
            engine.server_type = Server
        src.sync_weights()
        t0 = time.monotonic()
        groups = src._generate(_requests(8))
        assert time.monotonic() - t0 < HANG + 2.5 and _ids(groups) == _all(8)
        one = src.engines[1]
        assert one.failures == 1 and one.restarting is not None  # restarting in the background
        one.restarting.join()
        assert one.restarts == 1 and one.server.closed == 1 and one.server.starts == 2  # killed, started again
        src.version = 1
        src.sync_weights()  # the background restart joined, the fresh engine reloaded: it serves again
        assert one.alive and one.hung is None and one.version == 1
        groups = src._generate(_requests(8))
        assert {c.engine for g in groups for c in g} == {0, 1} and _ids(groups) == _all(8)
    finally:
        src.close()

    user = [FakeVLLM(), FakeVLLM(hang_after=1)]
    fakes += user
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path / "user")
    e = cfg.rollout_engine
    e.urls, e.launch, e.hang_timeout_s, e.request_timeout_s, e.concurrency = [f.url for f in user], False, HANG, 60.0, 3
    src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None, export=lambda f: None,
                     policy_logprobs=None, rank=0, dp_rank=0)
    try:
        src.sync_weights()
        groups = src._generate(_requests(6))
        assert _ids(groups) == _all(6) and not src.engines[1].alive and src.engines[1].hung
        src.version = 1
        t0 = time.monotonic()
        src.sync_weights()  # still hung: left out after one watch, not request_timeout_s
        assert not src.engines[1].alive and time.monotonic() - t0 < HANG + 2.0
        user[1].hang_after = None
        user[1].release.set()  # it moves again: answers what it held, its counters advance
        src.version = 2
        src.sync_weights()
        assert src.engines[1].alive and src.engines[1].hung is None
        groups = src._generate(_requests(6))
        assert {c.engine for g in groups for c in g} == {0, 1} and _ids(groups) == _all(6)
    finally:
        for f in fakes:
            f.close()



def test_hang_timeout_s_is_checked_in_one_line():
    from titan_foremoe.config.job_config import JobConfig
    from titan_foremoe.config.validate import ConfigError, _check_engine_keys

    cfg = JobConfig()
    e = cfg.rollout_engine
    _check_engine_keys(cfg, e, "[rollout_engine]", "vllm")  # the default (60 s below 300 s) passes
    for value, want in ((-1.0, "must be >= 0 (0: off), got -1.0"), (300.0, "300 is not below request_timeout_s 300")):
        e.hang_timeout_s = value
        with pytest.raises(ConfigError, match=r"^\[rollout_engine\] hang_timeout_s: ") as err:
            _check_engine_keys(cfg, e, "[rollout_engine]", "vllm")
        assert want in str(err.value) and "\n" not in str(err.value)
    e.hang_timeout_s = 0.0  # off
    _check_engine_keys(cfg, e, "[rollout_engine]", "vllm")
