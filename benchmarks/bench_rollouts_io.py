"""Rollout import and per-rank read cost at Qwen3-30B-A3B's routing shape (48 layers x top-8 of 128 experts).

Synthetic samples (random tokens, distinct top-8 ids per token) are written as an
SGLang file (base64 int32, the compact wire format) and a slime file (nested JSON
lists, the bulky one), imported, and read back the way a data-parallel rank reads
its rows of one step. Prints import throughput, file and directory sizes, and the
read time and route bytes per rank-step.

    python benchmarks/bench_rollouts_io.py --samples 16 --tokens 2048
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from titan_foremoe.rollouts import ModelSpec, RolloutSample, RolloutStore, import_rollouts
from titan_foremoe.rollouts.export import write_engine_file


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--ranks", type=int, default=4, help="data-parallel ranks sharing one step's rows")
    args = ap.parse_args()
    spec = ModelSpec(48, 8, 128, 151_936)
    rng = np.random.default_rng(0)
    samples = []
    for i in range(args.samples):
        T = args.tokens
        base = rng.integers(0, 16, size=(T - 1, spec.num_layers, 1))
        routes = (base + 16 * np.arange(spec.top_k)) % spec.num_experts  # 8 distinct ids per token
        lp = np.full(T, np.nan, np.float32)
        lp[args.prompt:] = -rng.random(T - args.prompt)
        samples.append(RolloutSample(rng.integers(0, spec.vocab_size, T), args.prompt, routes, lp, 1.0, None, str(i)))
    tokens = args.samples * args.tokens
    tmp = tempfile.mkdtemp()
    try:
        for fmt in ("sglang", "slime"):
            src = os.path.join(tmp, f"{fmt}.jsonl")
            t0 = time.perf_counter()
            write_engine_file(fmt, samples, src)
            t1 = time.perf_counter()
            import_rollouts(fmt, [src], os.path.join(tmp, fmt), spec, rows_per_shard=max(args.samples // 2, 1))
            t2 = time.perf_counter()
            print(f"{fmt:6s}: engine file {os.path.getsize(src) / tokens:7.0f} B/token (written in {t1 - t0:.1f} s); "
                  f"import {tokens / (t2 - t1):9,.0f} tokens/s; rollout dir "
                  f"{_dir_bytes(os.path.join(tmp, fmt)) / tokens:5.0f} B/token")
        store = RolloutStore(os.path.join(tmp, "sglang"))
        per_rank = args.samples // args.ranks
        t0 = time.perf_counter()
        rows = [store.read(r) for r in range(per_rank)]  # rank 0's rows of step 0
        dt = time.perf_counter() - t0
        route_bytes = sum(r.routes_RXK.nbytes for r in rows)
        print(f"rank read: {per_rank} rows x {args.tokens} tokens in {dt * 1e3:.1f} ms, "
              f"{route_bytes / 2**20:.1f} MiB of routes ({route_bytes / (per_rank * (args.tokens - 1)):.0f} B/token), "
              f"of {_dir_bytes(os.path.join(tmp, 'sglang')) / 2**20:.1f} MiB in the directory")
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
