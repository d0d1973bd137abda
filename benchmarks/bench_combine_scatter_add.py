"""Time torchtitan's deterministic ``scatter_add`` combine at Qwen3-30B-A3B's shape, per layer and per micro-step.

torchtitan's MoE combine (``token_dispatcher.combine``, ``torchtitan.ops.scatter_add.deterministic_scatter_add``)
adds each token's top-k expert outputs back into its row with ``out.scatter_add(0, index, src)`` under
``torch.use_deterministic_algorithms(True)``; on CUDA that is a sort-based path, slower than the atomic one. Its
backward is a ``gather``. This times both modes of the forward and the backward's gather, for one rank's rows of
one micro-step (``--tokens`` tokens x ``--top-k`` rows of ``--dim``), and multiplies by the MoE layers run per
micro-step (forward, the activation-checkpoint recompute of it, and the backward) for the per-micro-step figure.

    python benchmarks/bench_combine_scatter_add.py [--tokens 16384 --top-k 8 --dim 2048 --layers 48] [--device cuda]

``time_combine`` is the function ``scripts/gpu_check.py`` calls on the real device.
Legend: T tokens, K top-k, R = T*K routed rows, D model dim.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def scatter_add(out_TD: torch.Tensor, index_RD: torch.Tensor, src_RD: torch.Tensor, deterministic: bool):
    """``out.scatter_add(0, index, src)`` with torch's deterministic algorithms on or off (what torchtitan's
    op does with them on), restoring the caller's setting."""
    prev, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        return out_TD.scatter_add(0, index_RD, src_RD)
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=warn)


def time_combine(tokens: int, top_k: int, dim: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 repeats: int = 5, layers: int = 48) -> dict:
    """ms of the combine's ``scatter_add`` (deterministic and not) and of its backward ``gather``, per layer,
    and per micro-step: ``layers`` x (2 forward scatter_adds, the forward and its recompute under full
    activation checkpointing, + 1 gather in backward)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    R = tokens * top_k
    token_R = torch.randperm(R, generator=g) % tokens  # each token's top-k rows, in expert order (shuffled)
    index_RD = token_R.to(device).reshape(-1, 1).expand(-1, dim)
    src_RD = torch.randn(R, dim, generator=g).to(device, dtype)
    out_TD = torch.zeros(tokens, dim, device=device, dtype=dtype)
    det = _ms(lambda: scatter_add(out_TD, index_RD, src_RD, True), device, repeats)
    atomic = _ms(lambda: scatter_add(out_TD, index_RD, src_RD, False), device, repeats)
    gather = _ms(lambda: torch.gather(out_TD, 0, index_RD), device, repeats)
    got = scatter_add(out_TD, index_RD, src_RD, True).float()
    want = torch.zeros(tokens, dim, device=device).index_add_(0, token_R.to(device), src_RD.float())
    return {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "tokens": tokens, "top_k": top_k,
            "dim": dim, "layers": layers, "repeats": repeats,
            "deterministic_ms": round(det, 4), "atomic_ms": round(atomic, 4), "gather_bwd_ms": round(gather, 4),
            "deterministic_over_atomic": round(det / max(atomic, 1e-9), 3),
            "per_micro_step_ms": round(layers * (2 * det + gather), 2),
            "per_micro_step_extra_over_atomic_ms": round(layers * 2 * (det - atomic), 2),
            "max_abs_err": float((got - want).abs().max())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank per micro-step (16k packed)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=48, help="MoE layers (Qwen3-30B-A3B: 48)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    r = time_combine(a.tokens, a.top_k, a.dim, torch.device(a.device), repeats=a.repeats, layers=a.layers)
    print(json.dumps(r))
    print(f"combine scatter_add {a.tokens}x{a.top_k} rows of {a.dim} on {a.device}: deterministic "
          f"{r['deterministic_ms']:.2f} ms, atomic {r['atomic_ms']:.2f} ms, backward gather {r['gather_bwd_ms']:.2f} ms "
          f"per layer; {r['per_micro_step_ms']:.0f} ms per micro-step over {a.layers} layers "
          f"(+{r['per_micro_step_extra_over_atomic_ms']:.0f} ms for determinism)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
