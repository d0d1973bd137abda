"""``--best-split``: for a total GPU count, the engine / trainer split and k with the most tokens per second per GPU,
per balancer and per step mode, on the engine layout the runtime launches.

Modes (every rollout charged by ``decode_table.EngineModel``: ``rollout.py``'s engine model on ``fleet_layout``'s
engines of ``engine_gpus`` GPUs, requests dealt by the runtime's ``dealing.deal``):
* ``sync_colocated`` (``[rl] max_staleness = 0``, engines on the trainer's GPUs): rollout + sleep/wake + the
  colocated IPC sync + train, in turn; every engine waits for its longest response.
* ``async`` (``max_staleness = k``, engines on E GPUs of their own, the trainer on T = N - E): step n's start
  syncs the weights and submits step n + k's requests, so up to k steps' requests share the engines' batch slots
  (the tail of one step decodes beside the head of the next) and a step's rollout has k steps to finish. Steady
  state, both sides paying the sync (the trainer sends, the engines pause to load: ``fleet_sync_ms``, the
  runtime's one transfer group): ``step = sync + max(train, E_k / k)``, ``E_k`` the engines' time for k steps'
  requests dealt and generated together. k = 1 is ``rl_step.py``'s one-step off-policy step;
  ``tests/test_best_split.py`` checks the formula on an event simulation of the loop.
* ``partial`` (``[rl] rollout_token_budget``, ``partial_rollout.py``): generation stops at the budget, the
  unfinished responses continue next step (re-prefilled) unless ``[rl] partial_max_staleness`` drops them; a
  synchronous step as the runtime runs it (k = 0: rollout + sleep/wake + sync + train in turn), colocated or on
  engine GPUs of their own; the budgets searched are the CLI's list.

Assumptions (stated, not measured): the trainer's stages scale as ``train(T) = train(N) x N / T`` (the same
responses over fewer ranks: micro-steps per group and optimizer state per rank grow as N / T; the simulator's
per-micro-step time is flat from 64 to 1,024 GPUs, docs/simulator.md); a partial step's training scales with the
tokens it trains; the trainer needs ``16 bytes x parameters / T <= 0.6 x`` a GPU's memory (bf16 weights, fp32
master and Adam moments, sharded; the rest for activations); no per-step host overheads (reward, tokenization);
each step's lengths are drawn afresh (the trace's lengths resampled, or the log-normal).
Tokens per second per GPU: (prompt + response) tokens trained per step / step / N.

Legend: N total GPUs, E engine GPUs, T trainer GPUs, K engines, g GPUs per engine, B responses per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..rollouts.engines.sync_cost import hf_tensor_bytes
from ..rollouts.fleet.dealing import request_tokens
from .decode_table import EngineModel
from .fleet import fleet_layout, fleet_sync_ms
from .partial_rollout import Budget, deal_cached, partial_steps
from .rollout import gpu_memory_bytes, sleep_wake_ms

MODES = ("sync_colocated", "async", "partial")
KS = (1, 2, 4, 8)
TRAINER_MEMORY_SHARE = 0.6  # of a GPU's memory for the sharded model states (16 bytes per parameter)


@dataclass(frozen=True)
class SplitSearch:
    """What the search varies and holds."""

    gpus: int
    gpus_per_node: int = 8
    ep: int = 8
    engine_gpus: int = 8
    prompt_tokens: int = 128
    max_batch: int = 1024
    decode_efficiency: float = 1.0
    samples_per_prompt: int = 1
    max_tokens: int = 0  # the cap the fleet client sends (0: the longest length seen)
    sleep_level: int = 0
    fleet_sync: str = "one_group"
    budgets: tuple = (Budget(fraction=0.5),)
    ks: tuple = KS
    steps: int = 8  # steps measured
    warmup: int = 6  # partial: steps that fill the pipeline first
    partial_max_staleness: int = 1  # [rl] partial_max_staleness: older responses are dropped
    seed: int = 0
    extra: dict = field(default_factory=dict)


def step_lengths(draw, steps: int, seed: int) -> list[np.ndarray]:
    """``steps`` steps' response lengths: ``draw(rng)`` per step (fresh log-normal, or the trace resampled)."""
    return [np.asarray(draw(np.random.default_rng(seed + 7919 * s)), np.int64) for s in range(steps)]


def async_step_ms(train_ms: float, sync_ms: float, rollout_k_ms: float, k: int) -> float:
    """k steps in flight, steady state: ``sync + max(train, E_k / k)`` (module docstring)."""
    return sync_ms + max(train_ms, rollout_k_ms / k)


def _fleet_rollout_ms(eng: EngineModel, steps: list[np.ndarray], K: int, sp: SplitSearch, max_tokens: int) -> float:
    """The rollout of ``steps`` (one or k steps' response lengths, generated together) on K engines, each step's
    requests dealt as the fleet client deals them (``dealing.deal`` on prompt + n x ``max_tokens``, on top of the
    outstanding estimates of the steps before it)."""
    n = sp.samples_per_prompt
    load, parts = np.zeros(K, np.int64), []
    for lens in steps:
        G = -(-len(lens) // n)
        size_G = np.minimum(n, len(lens) - n * np.arange(G))
        est_G = request_tokens(np.full(G, sp.prompt_tokens), size_G, max_tokens)
        engine_G = deal_cached(est_G, K, load)
        load = load + np.bincount(engine_G, weights=est_G, minlength=K).astype(np.int64)
        parts.append(engine_G)
    engine_G = np.concatenate(parts)
    lens = np.concatenate(steps)
    engine_S = np.concatenate([np.repeat(e, n)[: len(x)] for e, x in zip(parts, steps)])
    pre = np.bincount(engine_G, minlength=K) * float(sp.prompt_tokens)
    return eng.fleet_ms(engine_S, lens, K, prefill_tokens_K=pre,
                        prefill_pairs_K=pre * (sp.prompt_tokens + 1) / 2)["rollout_ms"]


def trainer_fits(model, cal, T: int) -> bool:
    """The sharded model states (16 bytes per parameter: the bf16 HF tensors x 8) fit T GPUs (docstring)."""
    return 8.0 * float(hf_tensor_bytes(model, 2).sum()) / T <= TRAINER_MEMORY_SHARE * gpu_memory_bytes(cal)


def best_split(model, cal, link, hbm_Bps: float, sp: SplitSearch, train_ms_N: dict, lens_by_step: list[np.ndarray]
               ) -> dict:
    """Search every split (E in engine-size units, T = N - E a multiple of ``ep`` the trainer fits on) and k per
    balancer (``train_ms_N``: each balancer's trainer stages on all N GPUs, ms); ``lens_by_step``: the steps'
    response lengths (``warmup + steps`` of them). The best of each mode and every candidate."""
    t0 = time.perf_counter()
    N, g = sp.gpus, sp.engine_gpus
    if N % g or g > sp.gpus_per_node and g % sp.gpus_per_node:
        raise ValueError(f"--best-split: engines of {g} GPUs do not tile {N} GPUs in nodes of {sp.gpus_per_node}")
    mt = sp.max_tokens or int(max(np.max(x) for x in lens_by_step))
    measured = lens_by_step[sp.warmup:] or lens_by_step
    B = len(measured[0])
    tokens_step = float(np.mean([sp.prompt_tokens * len(x) + x.sum() for x in measured]))
    eng = EngineModel(model, cal, link, g, hbm_Bps, sp.prompt_tokens, sp.max_batch, sp.decode_efficiency)
    sw = sleep_wake_ms(model, link, g, sp.sleep_level)
    sw_ms = sw["sleep_ms"] + sw["wake_ms"]
    col = fleet_layout(N, sp.gpus_per_node, 0, g)  # the engines the runtime launches on the trainer's GPUs
    col_sync = fleet_sync_ms(model, link, col)["sync_ms"]
    # rollouts do not depend on the balancer: charge each (mode, split, k) once
    K = col.count
    roll_col = float(np.mean([_fleet_rollout_ms(eng, [x], K, sp, mt) for x in measured]))
    new_tokens = float(np.mean([x.sum() for x in measured]))  # what a full step trains

    def partial(k_engines):
        return {str(b): partial_steps(eng, lens_by_step, k_engines, b, sp.samples_per_prompt, mt, 0, sp.warmup,
                                      sp.partial_max_staleness) for b in sp.budgets}

    part_col = partial(K)
    splits = []
    for E in range(g, N, g):
        T = N - E
        if T % sp.ep or T < sp.ep or not trainer_fits(model, cal, T):
            continue
        lay = fleet_layout(T, sp.gpus_per_node, E, g)  # the runtime's engines on E GPUs of their own
        Ke = lay.count
        sync = fleet_sync_ms(model, link, lay, sp.fleet_sync)["sync_ms"]
        roll_k = {}
        for k in sp.ks:
            wins = [measured[i:i + k] for i in range(0, max(len(measured) - k + 1, 1), k)]
            roll_k[k] = float(np.mean([_fleet_rollout_ms(eng, w, Ke, sp, mt) for w in wins]))
        part = partial(Ke)
        splits.append((E, T, Ke, sync, roll_k, part))
    out: dict = {}
    for bal, tN in train_ms_N.items():
        cands = {m: [] for m in MODES}
        cands["sync_colocated"].append(dict(engine_gpus=N, trainer_gpus=N, k=0, engines=K, rollout_s=roll_col / 1e3,
                                            train_s=tN / 1e3, sync_s=col_sync / 1e3, sleep_wake_s=sw_ms / 1e3,
                                            step_s=(roll_col + sw_ms + col_sync + tN) / 1e3, staleness_max=0))
        for b, p in part_col.items():
            ratio = p["trained_tokens_S"] / new_tokens
            step = float(np.mean(p["rollout_ms_S"] + sw_ms + col_sync + tN * ratio))
            cands["partial"].append(_partial_row(N, N, 0, K, b, p, tN, col_sync, step, sw_ms, sp.prompt_tokens))
        for E, T, Ke, sync, roll_k, part in splits:
            tT = tN * N / T
            for k, r in roll_k.items():
                cands["async"].append(dict(engine_gpus=E, trainer_gpus=T, k=k, engines=Ke, rollout_s=r / k / 1e3,
                                           train_s=tT / 1e3, sync_s=sync / 1e3, sleep_wake_s=0.0,
                                           step_s=async_step_ms(tT, sync, r, k) / 1e3, staleness_max=k))
            for b, p in part.items():
                step = float(np.mean(p["rollout_ms_S"] + sync + tT * p["trained_tokens_S"] / new_tokens))
                cands["partial"].append(_partial_row(E, T, 0, Ke, b, p, tT, sync, step, 0.0, sp.prompt_tokens))
        out[bal] = {}
        for m, rows in cands.items():
            for r in rows:
                tok = r.pop("_tokens", tokens_step)
                r["tokens_per_s_per_gpu"] = tok / r["step_s"] / N
            best = max(rows, key=lambda r: r["tokens_per_s_per_gpu"]) if rows else None
            out[bal][m] = {**(best or {}), "candidates": len(rows)}
        out[bal]["curves"] = {m: [[r["engine_gpus"], r["k"], r.get("budget", ""), round(r["step_s"], 3)]
                                  for r in rows] for m, rows in cands.items()}
    out["setting"] = {**{k: v for k, v in vars(sp).items() if k not in ("budgets", "extra")},
                      "budgets": [str(b) for b in sp.budgets], "responses_per_step": B, "max_tokens": mt,
                      "mean_response": float(np.mean([x.mean() for x in measured])),
                      "longest_response": int(max(x.max() for x in measured)), "tokens_per_step": tokens_step,
                      **sp.extra, "search_s": time.perf_counter() - t0}
    return out


def _partial_row(E, T, k, K, budget, p, train_ms, sync_ms, step_ms, sw_ms, prompt_tokens) -> dict:
    """One partial candidate; its tokens are what its steps trained (prompt + response of each finished one)."""
    tokens = float(np.mean(p["trained_tokens_S"]) + prompt_tokens * np.mean(p["trained_S"]))
    return dict(engine_gpus=E, trainer_gpus=T, k=k, engines=K, budget=budget,
                rollout_s=float(p["rollout_ms_S"].mean()) / 1e3, train_s=train_ms / 1e3, sync_s=sync_ms / 1e3, sleep_wake_s=sw_ms / 1e3, step_s=step_ms / 1e3,
                staleness_mean=p["staleness_mean"], staleness_max=p["staleness_max"], stale_share=p["stale_share"],
                in_flight=float(np.mean(p["in_flight_S"])), decode_steps=float(np.mean(p["decode_steps_S"])),
                dropped_per_step=float(np.mean(p["dropped_S"])),
                wasted_token_share=float(np.sum(p["wasted_tokens_S"]) / max(np.sum(p["tokens_S"]), 1.0)),
                _tokens=tokens)


def search_of_run(a, res: dict, model, cal, link, lens: np.ndarray) -> dict:
    """``scripts/simulate_cluster.py --best-split``: the search on the run's cluster and rollout flags; each balancer's
    trainer stages from the run (``res[b]["train_ms"]``, all ``a.gpus`` GPUs); every step draws ``len(lens)``
    lengths: the log-normal of ``--response-lengths``, else the run's lengths resampled."""
    from .sequences import lognormal_lengths

    budgets = tuple(Budget.parse(x) for x in str(a.rollout_token_budget).split(",") if x)
    sp = SplitSearch(gpus=a.gpus, gpus_per_node=a.gpus_per_node, ep=a.ep, engine_gpus=a.engine_gpus or a.gpus_per_node,
                     prompt_tokens=a.prompt_tokens, max_batch=a.rollout_batch, decode_efficiency=a.decode_efficiency,
                     samples_per_prompt=a.samples_per_prompt, max_tokens=a.max_tokens, sleep_level=a.sleep_level,
                     fleet_sync=a.fleet_sync, budgets=budgets, seed=a.seed,
                     partial_max_staleness=a.partial_max_staleness,
                     extra={"lengths": a.response_lengths or ("trace" if a.trace else "synthetic model")})
    B = len(lens)
    if a.lengths:
        draw = lambda r: lognormal_lengths(B, *a.lengths, seed=int(r.integers(2**31)))  # noqa: E731
    else:
        draw = lambda r: r.choice(lens, B)  # noqa: E731
    steps = step_lengths(draw, sp.warmup + sp.steps, a.seed)
    hbm = (a.hbm_gbps or cal.hbm_GBps) * 1e9
    return best_split(model, cal, link, hbm, sp, {b: res[b]["train_ms"] for b in a.balancer_list}, steps)
