"""The split search (simulator/best_split.py): the tabulated engine model against rollout.py's, partial rollouts
against a decode-step-by-decode-step brute force, the k-in-flight step against an event simulation of the loop,
and ``--best-split`` end to end at a small size."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from titan_foremoe.simulator.best_split import async_step_ms
from titan_foremoe.simulator.calibration import DEFAULT_CALIBRATION, load_calibration
from titan_foremoe.simulator.decode_table import EngineModel
from titan_foremoe.simulator.models import get_model
from titan_foremoe.simulator.partial_rollout import Budget, partial_steps
from titan_foremoe.simulator.rollout import engine_rollout_ms
from titan_foremoe.simulator.simulate import device_costs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def qwen():
    cal = load_calibration(DEFAULT_CALIBRATION)
    return get_model("qwen3_30b_a3b"), cal, device_costs(cal, 8)


def test_engine_model_matches_rollout_py(qwen):
    """Per engine, the table charges what engine_rollout_ms charges at the same context (interpolated batch)."""
    model, cal, link = qwen
    hbm = cal.hbm_GBps * 1e9
    eng = EngineModel(model, cal, link, 8, hbm, 128, 1024, 0.7)
    rng = np.random.default_rng(1)
    lens = np.clip(np.rint(rng.lognormal(np.log(1500), 1.0, 600)), 1, 8192)
    engine_S = rng.integers(0, 3, 600)
    r = eng.fleet_ms(engine_S, lens, 3, prefill_tokens_K=np.bincount(engine_S, minlength=3) * 128.0,
                     prefill_pairs_K=np.bincount(engine_S, minlength=3) * 128 * 129 / 2)
    for e in range(3):
        mine = lens[engine_S == e]
        ctx = 128 + (mine * (mine - 1) / 2).sum() / mine.sum()  # the token-weighted context the table charges
        want = engine_rollout_ms(model, cal, link, mine, len(mine), 8, 128, 1024, hbm, 0.7, context=ctx)
        assert r["decode_steps_K"][e] == want["decode_steps"]
        assert r["ms_K"][e] == pytest.approx(want["rollout_ms"], rel=0.02)
    assert r["rollout_ms"] == pytest.approx(r["ms_K"].max())


def _brute_partial(lens_by_step, budget: Budget, lag: int, max_staleness):
    """Decode step by decode step: every sequence in flight emits one token per step until the budget stops the
    step (enough responses finished, or the finished ones hold enough tokens); finished responses train, too old
    ones are dropped; each token's age recorded one by one."""
    flight = []  # [remaining, list of steps its tokens came from, step born]
    ages, tokens, trained, dropped = {}, [], [], []
    for s, lens in enumerate(lens_by_step):
        flight += [[int(x), [], s] for x in lens]
        need = max(int(np.ceil(budget.fraction * len(flight))), 1) if budget.fraction else None
        finished, finished_tokens = 0, 0
        while any(f[0] for f in flight):
            if need is not None and finished >= need:
                break
            if budget.tokens and finished_tokens >= budget.tokens:
                break
            for f in flight:
                if f[0]:
                    f[0] -= 1
                    f[1].append(s)
                    if f[0] == 0:
                        finished += 1
                        finished_tokens += len(f[1])
        tokens.append(sum(f[1].count(s) for f in flight))
        done = [f for f in flight if f[0] == 0]
        trained.append(len(done))
        for f in done:
            for j in f[1]:
                ages[s - j + lag] = ages.get(s - j + lag, 0) + 1
        too_old = [f for f in flight if f[0] and max_staleness is not None and s + 1 + lag - f[2] > max_staleness]
        dropped.append(len(too_old))
        flight = [f for f in flight if f[0] and f not in too_old]
    return tokens, trained, ages, dropped


@pytest.mark.parametrize("budget,lag,stale", [(Budget(fraction=0.5), 0, None), (Budget(fraction=0.8), 1, None),
                                              (Budget(tokens=90), 0, None), (Budget(fraction=0.5), 0, 1),
                                              (Budget(tokens=60), 0, 2)])
def test_partial_rollout_matches_brute_force(qwen, budget, lag, stale):
    model, cal, link = qwen
    eng = EngineModel(model, cal, link, 8, cal.hbm_GBps * 1e9, 16, 1024)
    rng = np.random.default_rng(3)
    steps = [rng.integers(1, 30, 12) for _ in range(6)]
    got = partial_steps(eng, steps, 2, budget, 1, 30, lag, warmup=0, max_staleness=stale)
    tokens, trained, ages, dropped = _brute_partial(steps, budget, lag, stale)
    assert got["tokens_S"].tolist() == tokens
    assert got["trained_S"].tolist() == trained
    assert got["dropped_S"].tolist() == dropped
    assert (sum(dropped) > 0) == (stale is not None)
    A = got["staleness_A"]
    assert {a: int(v) for a, v in enumerate(A) if v} == ages
    assert got["staleness_mean"] == pytest.approx(sum(a * v for a, v in ages.items()) / sum(ages.values()))
    assert got["trained_tokens_S"].sum() == sum(ages.values())
    if stale is not None:
        assert got["staleness_max"] <= stale


def test_partial_rollout_fills_the_slots(qwen):
    """On long-tailed lengths the partial step decodes far fewer steps at a far larger batch than the full one."""
    model, cal, link = qwen
    eng = EngineModel(model, cal, link, 8, cal.hbm_GBps * 1e9, 128, 1024)
    steps = [np.clip(np.rint(np.random.default_rng(s).lognormal(np.log(1500), 1, 512)), 1, 8192).astype(int)
             for s in range(12)]
    full = eng.fleet_ms(np.repeat(np.arange(2), 256), steps[-1], 2)
    part = partial_steps(eng, steps, 2, Budget(fraction=0.5), 1, 8192, 0, warmup=6)
    assert part["decode_steps_S"].mean() < full["decode_steps_K"].max() / 3
    assert part["rollout_ms_S"].mean() < full["rollout_ms"] / 2
    assert part["trained_S"].mean() == pytest.approx(512, rel=0.15)  # steady state: a batch finishes per step


def _event_loop(R: float, t: float, s: float, k: int, steps: int = 60, dt: float = 0.01) -> float:
    """The runtime's loop with k steps in flight, in time steps of dt: step n's start syncs (both sides busy s, the
    engines pause their in-flight requests), submits step n + k's requests (each needs R of engine time), then
    trains step n (t) once rollout n is done. Returns the mean step over the second half."""
    work = {m: R for m in range(k)}  # steps 0..k-1 submitted before the loop starts
    now, starts, n = 0.0, [], 0
    phase, left = "wait", 0.0  # the trainer's: wait for rollout n | sync | train
    while n < steps:
        syncing = phase == "sync"
        if phase == "wait" and work.get(n, 0.0) <= 1e-9:
            starts.append(now)
            phase, left = "sync", s
            continue
        now += dt
        if not syncing:
            for m in work:
                work[m] = max(work[m] - dt, 0.0)
        if phase in ("sync", "train"):
            left -= dt
            if left <= 1e-9:
                if phase == "sync":
                    work[n + k] = R
                    phase, left = "train", t
                else:
                    phase, n = "wait", n + 1
    half = len(starts) // 2
    return (starts[-1] - starts[half]) / (len(starts) - 1 - half)


@pytest.mark.parametrize("R,t,s,k", [(10, 1, 0.5, 1), (10, 1, 0.5, 2), (10, 1, 0.5, 4), (10, 4, 0.5, 4),
                                     (3, 4, 0.5, 1), (10, 2, 1.0, 8)])
def test_async_step_matches_event_loop(R, t, s, k):
    assert async_step_ms(t, s, R, k) == pytest.approx(_event_loop(R, t, s, k), rel=0.03, abs=0.05)


def test_best_split_end_to_end(tmp_path):
    out = tmp_path / "bs"
    cmd = [sys.executable, str(ROOT / "scripts/simulate_cluster.py"), "--synthetic", "--model", "qwen3_30b_a3b",
           "--gpus", "32", "--ep", "8", "--balancers", "off", "--plan-ms", "2", "--global-batch", "64",
           "--responses-per-microstep", "8", "--response-lengths", "lognormal:1500:1.0:8192", "--best-split",
           "--rollout-token-budget", "0.5,2048", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads((out / "best_split.json").read_text())
    assert "best split of 32 GPUs" in r.stdout
    for mode in ("sync_colocated", "async", "partial"):
        row = d["off"][mode]
        assert {"engine_gpus", "trainer_gpus", "k", "step_s", "tokens_per_s_per_gpu"} <= set(row)
        full = d["setting"]["tokens_per_step"] / row["step_s"] / 32  # a whole step's responses trained
        if mode == "partial":  # it trains what finished, less what partial_max_staleness dropped
            assert row["tokens_per_s_per_gpu"] <= full * 1.05 and 0 <= row["wasted_token_share"] < 1
        else:
            assert row["tokens_per_s_per_gpu"] == pytest.approx(full)
    sc = d["off"]["sync_colocated"]
    assert sc["step_s"] == pytest.approx(sc["rollout_s"] + sc["train_s"] + sc["sync_s"] + sc["sleep_wake_s"])
    a = d["off"]["async"]
    assert a["k"] in (1, 2, 4, 8) and a["engine_gpus"] + a["trainer_gpus"] == 32 and a["engine_gpus"] % 8 == 0
    from titan_foremoe.simulator.fleet import fleet_layout  # the engines the runtime would launch on that split

    assert a["engines"] == fleet_layout(a["trainer_gpus"], 8, a["engine_gpus"], 8).count == a["engine_gpus"] // 8
    assert sc["engines"] == fleet_layout(32, 8, 0, 8).count == 4
    assert a["step_s"] == pytest.approx(a["sync_s"] + max(a["train_s"], a["rollout_s"]))
    # every candidate's step is charged; the best has the most tokens/s/GPU among the async ones
    steps = [c[3] for c in d["off"]["curves"]["async"]]
    assert len(steps) == a["candidates"] and min(steps) == pytest.approx(a["step_s"], abs=1e-3)
    bad = subprocess.run(cmd[:-4] + ["--rollout-token-budget", "2.5", "--out", str(out)], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "rollout_token_budget '2.5'" in bad.stderr.strip().splitlines()[-1]
