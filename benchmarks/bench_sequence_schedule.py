#!/usr/bin/env python
"""Cost and balance of the sequence scheduler (titan_foremoe/schedule), the figures of docs/schedule.md.

python benchmarks/bench_sequence_schedule.py --trace /work/shared/traces/gptoss20b_mmlu_routing.npz [--json OUT]

1. balance: today's dealing (rollout order, each rank's micro-batch padded to its longest row) vs balanced +
   packed, on the trace's response lengths (+150-token prompt) and on long-tailed lengths (log-normal, median
   1.5k, sigma 1, capped at 8k), 8 ranks x 4 rows per micro-step: padding and busiest-rank / mean tokens.
2. experts: the expert spread's effect on the trace (64 ranks, EP 8, 1024 sequences).
3. cost: time (median of 3, one core) and peak traced host memory of ``schedule_sequences`` at R = 64 / 256 /
   1024 ranks and 512-4096 sequences per step, both policies, trace and log-normal lengths.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_foremoe.schedule import schedule_sequences  # noqa: E402

PROMPT = 150


def trace_tokens(path: str) -> np.ndarray:
    """Positions each trace sequence computes: prompt + response - 1."""
    return np.diff(np.load(path)["offsets"]) + PROMPT - 1


def lognormal_tokens(n: int, median: float = 1500, sigma: float = 1.0, cap: int = 8192, seed: int = 0):
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(np.log(median), sigma, n), cap).astype(np.int64) + PROMPT - 1


def step(tokens: np.ndarray, n: int, ranks: int):
    """A step of n sequences, rank-major (a rank's rows are its rollout order), one mini-batch."""
    tok = np.resize(tokens, n)
    src = np.arange(n) * ranks // n
    return tok, np.zeros(n, np.int64), src


def balance(tokens: np.ndarray, ranks: int = 8, rows: int = 4) -> dict:
    n = len(tokens) // (ranks * rows) * ranks * rows
    tok, mb, src = step(tokens[:n], n, ranks)
    order = schedule_sequences(tok, mb, src, ranks=ranks, policy="rollout_order", rows_per_micro=rows)
    out = {"sequences": n, "ranks": ranks, "rows_per_micro": rows,
           "rollout_order_padded": order.metrics(tok, padded=True),
           "rollout_order_packed": order.metrics(tok)}
    bal = schedule_sequences(tok, mb, src, ranks=ranks, micro_steps=order.micro_steps)
    out["balanced_packed_same_micro_steps"] = bal.metrics(tok)
    budget = int(np.ceil(tok.sum() / (ranks * order.micro_steps)))
    budget = max(budget, int(tok.max()))
    bud = schedule_sequences(tok, mb, src, ranks=ranks, max_tokens=int(budget * 1.1))
    out["balanced_packed_budget"] = dict(bud.metrics(tok), max_tokens=int(budget * 1.1))
    return out


def experts(path: str, ranks: int = 64, n: int = 1024, ep: int = 8) -> dict:
    """Expert spread on the trace: per (micro-step, EP group) cell, busiest expert over the mean (loads summed
    over layers), rollout order vs balanced without and with ``loads_NE``; and the floor of the whole step's loads."""
    d = np.load(path)
    experts_TLK, offsets = d["experts"], d["offsets"]
    E, lens = int(experts_TLK.max()) + 1, np.diff(offsets)
    owner_T = np.repeat(np.arange(len(lens)), lens)
    sig_nE = sum(np.bincount((owner_T[:, None] * E + experts_TLK[:, l].astype(np.int64)).ravel(),
                             minlength=len(lens) * E) for l in range(experts_TLK.shape[1])).reshape(len(lens), E)
    pick = np.random.default_rng(0).permutation(np.resize(np.arange(len(lens)), n))
    tok, loads = lens[pick] + PROMPT - 1, sig_nE[pick]
    src, mb = np.arange(n) * ranks // n, np.arange(n) % 2
    runs = {"rollout_order": schedule_sequences(tok, mb, src, ranks=ranks, policy="rollout_order",
                                                rows_per_micro=n // ranks // 4),
            "balanced": schedule_sequences(tok, mb, src, ranks=ranks, micro_steps=2),
            "balanced_with_loads": schedule_sequences(tok, mb, src, ranks=ranks, micro_steps=2, loads_NE=loads, ep=ep)}
    out = {k: s.metrics(tok, loads_NE=loads, ep=ep)["experts_max_over_mean"] for k, s in runs.items()}
    total = loads.sum(axis=0)
    out["whole_step_floor"] = float(total.max() / total.mean())
    return out


def cost(tokens: np.ndarray, name: str, budget: int) -> list[dict]:
    rows = []
    for ranks in (64, 256, 1024):
        for n in (512, 1024, 2048, 4096):
            tok, mb, src = step(tokens, n, ranks)
            for policy, kw in (("rollout_order", {"max_tokens": budget}), ("balanced", {"max_tokens": budget})):
                times = []
                for _ in range(3):
                    t = time.perf_counter()
                    s = schedule_sequences(tok, mb, src, ranks=ranks, policy=policy, **kw)
                    times.append(time.perf_counter() - t)
                tracemalloc.start()
                schedule_sequences(tok, mb, src, ranks=ranks, policy=policy, **kw)
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                m = s.metrics(tok)
                rows.append({"lengths": name, "ranks": ranks, "sequences": n, "policy": policy,
                             "max_tokens": budget, "ms": 1e3 * float(np.median(times)), "peak_MiB": peak / 2**20,
                             "micro_steps": s.micro_steps, "tokens_max_over_mean": m["tokens_max_over_mean"]})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--json", default=None, help="write all figures here")
    p.add_argument("--skip-cost", action="store_true")
    a = p.parse_args(argv)
    trace = trace_tokens(a.trace)
    lognormal = lognormal_tokens(4096)
    out = {"balance": {"trace": balance(trace), "lognormal": balance(lognormal)}}
    out["experts"] = experts(a.trace)
    print(json.dumps({k: out[k] for k in ("balance", "experts")}, indent=1), flush=True)
    if not a.skip_cost:
        out["cost"] = cost(trace, "trace", 4096) + cost(lognormal, "lognormal", 16384)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
