"""What the exact balancer's device planner costs per layer: aten ops dispatched (on a GPU each is a kernel launch,
~4-6 us eager when launch-bound) and this host's time, plan + this rank's row selection, and the duplicates per rank.

One layer, synthetic skewed counts (Dirichlet 0.5 over experts, the reactive benchmark's), best of 20 runs, on
the CPU (no GPU here: the simulator charges ``--exact-plan-us`` instead). The count all-gather is not here.

    python benchmarks/bench_exact_layer.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_foremoe.planner.exact import plan_exact, rank_rows, replicas_R

SHAPES = (  # (name, experts, EP ranks, ranks per node, tokens per rank x top-k)
    ("qwen3_30b_a3b EP 8", 128, 8, 8, 4096 * 8),
    ("qwen3_30b_a3b EP 64", 128, 64, 8, 4096 * 8),
    ("deepseek_v3 shape EP 256", 256, 256, 8, 4096 * 8),
)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _layer(load_E: torch.Tensor, R: int, G: int, rows: int) -> torch.Tensor:
    a = plan_exact(load_E, R, G)
    rank_rows(a, 1, rows, load_E)
    return a


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    for name, E, R, G, pairs in SHAPES:
        load_E = torch.as_tensor(rng.multinomial(pairs * R, rng.dirichlet(np.full(E, 0.5))))
        rows = int(load_E.reshape(R // G, -1).sum(1)[0]) // G  # rank 1's quota, within a row of the exact one
        with _Ops() as ops:
            a = _layer(load_E, R, G, rows)
        ms = []
        for _ in range(20):
            t0 = time.perf_counter()
            _layer(load_E, R, G, rows)
            ms.append((time.perf_counter() - t0) * 1e3)
        print(f"{name:26s} E={E:4d} R={R:4d}: {ops.n} aten ops, {min(ms):.3f} ms here, "
              f"{float(replicas_R(a).float().mean()):.2f} duplicates per rank (max {int(replicas_R(a).max())})")


if __name__ == "__main__":
    main()
