"""The fleet client against fake engines: the deal followed, a dead engine's requests re-dealt to the survivors,
every prompt's samples exactly once (on one process and on 2 gloo ranks that must agree), per-engine metrics.

The fake engine answers a sample with tokens that name the request and sample (``[prompt[0], seed]``), so a lost or
duplicated sample shows in the ids; it can be told to fail after some samples (a dead engine mid-step)."""

from __future__ import annotations

import datetime
import os
import threading

import numpy as np
import pytest

from distributed_helpers import end_rank, rank_results, run_ranks
from titan_foremoe.rollouts.engines.errors import EngineError
from titan_foremoe.rollouts.engines.vllm_api import Completion
from titan_foremoe.rollouts.fleet.client import FleetClient
from titan_foremoe.rollouts.fleet.dealing import deal, request_tokens
from titan_foremoe.rollouts.fleet.engine import VLLMEngine
from titan_foremoe.rollouts.fleet.layout import engine_layout


class Cfg:
    concurrency, max_restarts, request_timeout_s, retries = 3, 1, 5.0, 0


class FakeClient:
    def __init__(self, url: str, fail_after: int | None = None):
        self.url, self.fail_after, self.served, self.lock = url, fail_after, 0, threading.Lock()

    def _before_threads(self):
        pass

    def _sample(self, prompt_ids, max_tokens, temperature, top_p, seed):
        with self.lock:
            if self.fail_after is not None and self.served >= self.fail_after:
                raise EngineError(f"fake engine at {self.url}/generate unreachable after 1 attempts: refused")
            self.served += 1
        gen = [prompt_ids[0], seed]
        return Completion(list(prompt_ids), gen, [0.0, 0.0], np.zeros((len(prompt_ids) + 1, 1, 1)), "length")


def _fleet(K: int, fail: dict | None = None, world: int = 1) -> FleetClient:
    layout = engine_layout(trainer_gpus=world, gpus_per_node=world, engines=K, gpus_per_engine=1, colocated=False)
    engines = [VLLMEngine(slot, Cfg(), client=FakeClient(f"http://e{k}", (fail or {}).get(k)), version=7)
               for k, slot in enumerate(layout.engines)]
    return FleetClient(engines)


def _requests(lengths, n=4, base=0):
    return [dict(prompt_ids=[base + i] * L, n=n, max_tokens=8, temperature=1.0, top_p=1.0, seed=100 * (base + i))
            for i, L in enumerate(lengths)]


def _ids(groups):
    return sorted((c.token_ids[0], c.token_ids[1]) for g in groups for c in g)


def test_requests_go_where_the_deal_says_and_metrics_count_them():
    reqs = _requests([5, 30, 12, 2, 40, 7])
    fleet = _fleet(3)
    groups, engine_g = fleet.generate(reqs, expected_response=8)
    want = deal(request_tokens([len(r["prompt_ids"]) for r in reqs], 4, 8), np.ones(3, bool))
    assert (engine_g == want).all() and len(set(want.tolist())) == 3
    for g, k in zip(groups, engine_g):
        assert len(g) == 4 and {c.engine for c in g} == {int(k)} and {c.served_version for c in g} == {7}
    assert _ids(groups) == sorted((i, 100 * i + j) for i in range(6) for j in range(4))
    m = fleet.metrics()
    for k in range(3):
        assert m[f"rollout/engine_{k}/samples"] == 4 * (want == k).sum()
        assert m[f"rollout/engine_{k}/tokens"] == 2 * 4 * (want == k).sum() and m[f"rollout/engine_{k}/failures"] == 0
        assert m[f"rollout/engine_{k}/busy_s"] > 0


def test_a_dead_engine_s_requests_are_redealt_and_every_sample_comes_once():
    reqs = _requests([9, 8, 7, 6, 5, 4, 3, 2])
    fleet = _fleet(3, fail={1: 5})  # engine 1 answers 5 samples, then is gone
    d = fleet.deal(reqs, 8)
    first = d.first_g.copy()
    fleet.send(d)
    groups, engine_g = fleet.finish(d)
    assert _ids(groups) == sorted((i, 100 * i + j) for i in range(8) for j in range(4))  # none lost or twice
    assert all(len({c.engine for c in g}) == 1 for g in groups)  # a prompt's samples from one engine
    moved = [i for i in range(8) if first[i] == 1 and engine_g[i] != 1]
    assert moved and all(engine_g[i] in (0, 2) for i in moved)
    assert fleet.engines[1].client.served == 5 and not fleet.engines[1].alive
    m = fleet.metrics()
    assert m["rollout/engine_1/failures"] == 1 and m["rollout/engines_alive"] == 2
    assert sum(m[f"rollout/engine_{k}/samples"] for k in range(3)) == 32  # partial samples are not counted
    # the next step deals nothing to the dead engine
    _, engine_g = fleet.generate(_requests([3, 3, 3]), expected_response=8)
    assert 1 not in engine_g.tolist()


def test_every_engine_dead_is_one_line_unless_one_comes_back():
    fleet = _fleet(2, fail={0: 0, 1: 1})
    with pytest.raises(EngineError, match=r"^engine fleet: every engine failed: rank 0: .*e\d.*rank 0: .*e\d") as e:
        fleet.generate(_requests([4, 4, 4]), expected_response=8)
    assert "\n" not in str(e.value)

    fleet = _fleet(2, fail={0: 0, 1: 0})

    def revive(dead, errors):  # what the source does: restart a launched engine on the current weights
        assert dead == [0, 1] and "e0" in errors
        fleet.engines[0].client.fail_after, fleet.engines[0].alive = None, True

    groups, engine_g = fleet.generate(_requests([4, 4, 4]), expected_response=8, on_failure=revive)
    assert _ids(groups) == sorted((i, 100 * i + j) for i in range(3) for j in range(4)) and set(engine_g) == {0}


def _two_ranks(rank, world, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    fleet = _fleet(3, fail={2: 2} if rank == 1 else None, world=world)  # only rank 1 sees engine 2 die
    reqs = _requests([4 + rank, 9, 2, 6 - rank], base=10 * rank)
    d = fleet.deal(reqs, 8)
    fleet.send(d)
    groups, engine_g = fleet.finish(d)
    end_rank(out, rank, {"ids": _ids(groups), "engine": engine_g.tolist(), "first": d.first_g.tolist(),
                         "alive": fleet.alive_K.tolist(), "metrics": fleet.metrics()})


def test_two_ranks_agree_on_the_dead_engine_and_redeal_together(tmp_path):
    run_ranks(_two_ranks, 2, str(tmp_path), apply_patches=False)
    r0, r1 = rank_results(tmp_path, 2)
    for r, res in enumerate((r0, r1)):
        assert [tuple(x) for x in res["ids"]] == sorted((10 * r + i, 100 * (10 * r + i) + j)
                                                        for i in range(4) for j in range(4))
        assert res["alive"] == [True, True, False]  # rank 0 never saw it fail, yet agrees
    assert r0["metrics"] == r1["metrics"] and r0["metrics"]["rollout/engine_2/failures"] == 1
    assert sum(r0["metrics"][f"rollout/engine_{k}/samples"] for k in range(3)) == 32
    # the first deal is the one both ranks computed from the gathered estimates (LPT over all 8 requests)
    both = request_tokens([4, 9, 2, 6, 5, 9, 2, 5], 4, 8)
    assert r0["first"] + r1["first"] == deal(both, np.ones(3, bool)).tolist()
    assert 2 not in r1["engine"] and 2 in r1["first"]


class FakeServer:
    """A launched engine's server: ``start`` records its spec's log and the folder, answers on a new port."""

    ports = iter(range(1000, 2000))

    def __init__(self, spec):
        self.spec, self.folders, self.up, self.starts = spec, [], False, 0

    def start(self, folder):
        self.folders.append(folder)
        self.up, self.starts, self.port = True, self.starts + 1, next(self.ports)
        return f"http://127.0.0.1:{self.port}"

    def alive(self):
        return self.up

    def close(self):
        self.up = False


class ReloadClient(FakeClient):
    def __init__(self, url):
        super().__init__(url)
        self.reloaded = []

    def reload_weights(self, folder):
        if self.fail_after == 0:
            raise EngineError(f"fake engine at {self.url}/collective_rpc unreachable after 1 attempts: refused")
        self.reloaded.append(folder)

    def reset_prefix_cache(self):
        pass


def test_launched_engines_start_and_reload_together_and_a_dead_one_is_restarted_at_the_sync(tmp_path, monkeypatch):
    """``engines = 2`` launched (rank 0 owns both on one machine): the first sync starts both on the first folder,
    each with its own log; the next reloads both from the new one; an engine found dead is restarted on that
    folder (within ``max_restarts``) and serves again; past the budget it stays out of the deal and the job goes
    on with the other."""
    from titan_foremoe.config.job_config import JobConfig
    from titan_foremoe.rollouts.fleet import engine as engine_mod
    from titan_foremoe.rollouts.sources.vllm import VLLMSource

    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.rollout_engine.engines, cfg.rollout_engine.max_restarts = 2, 1
    exported = []
    src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None,
                     export=exported.append, policy_logprobs=None, rank=0, dp_rank=0)
    for e in src.engines:
        e.server_type = FakeServer
    monkeypatch.setattr(engine_mod.Engine, "connect", lambda self, url: setattr(self, "client", ReloadClient(url)))
    src.sync_weights()
    w = tmp_path / "engine_weights"
    assert [e.server.folders for e in src.engines] == [[str(w / "policy_0")]] * 2
    assert [os.path.basename(e.server.spec.log_path) for e in src.engines] == ["engine_0.log", "engine_1.log"]
    assert len({e.url for e in src.engines}) == 2 and all(e.alive and e.version == -1 for e in src.engines)
    src.version = 1
    src.sync_weights()
    assert [e.client.reloaded for e in src.engines] == [[str(w / "policy_1")]] * 2
    assert [e.version for e in src.engines] == [1, 1]

    src.engines[1].server.up = False  # died between steps: restarted on the new folder (its refill)
    src.version = 2
    src.sync_weights()
    assert src.engines[1].server.folders[-1] == str(w / "policy_0") and src.engines[1].restarts == 1
    assert src.engines[0].client.reloaded[-1] == str(w / "policy_0") and src.engines[1].alive

    src.engines[1].server.up = False  # again: no restarts left, the fleet goes on with engine 0
    src.version = 3
    src.sync_weights()
    assert not src.engines[1].alive and src.engines[0].alive and src.engines[1].failures == 1
    groups = src._generate(_requests([3, 4, 5]))
    assert {c.engine for g in groups for c in g} == {0}
