"""Token-to-expert counts exactly as aiconfigurator's MoE collector generates them (numpy, no torch).

The measured fused-MoE rows (aiconfigurator-core 0.12.0, ``moe_perf.parquet``) were taken with routing
logits from ``collector/helper.py`` of github.com/ai-dynamo/aiconfigurator (read at commit 095f58a5):
* ``balanced_logits``: token i picks experts (i + j * stride) % E, stride = ceil(E / topk), j < topk;
  with fewer tokens than stride, floor(i * stride / T + j * stride) % E.
* ``power_law_logits_v3`` -> ``_generate_power_law_distribution``: per-expert counts drawn by inverse CDF
  from a power law on [1, 0.8 T] (on [0.01, 2] when T * topk <= E), scaled to T * topk and rounded, capped
  at T (overflow and the rounding residue handed out one token at a time, rank by rank, to the emptiest /
  fullest valid local expert), then the busiest EP rank's experts swapped to rank 0. ``collector/vllm/
  collect_moe.py`` times rank 0 (experts [0, E / ep)) over 5 such draws and reports the mean.
Our RNG stream differs from torch.rand; the algorithm is the same.

Legend: E experts, K = E / ep local experts of rank 0, D draws.
"""

from __future__ import annotations

import math

import numpy as np


def balanced_counts_E(num_tokens: int, num_experts: int, topk: int) -> np.ndarray:
    """Tokens per expert of ``balanced_logits`` (deterministic)."""
    stride = math.ceil(num_experts / topk)
    i = np.arange(num_tokens, dtype=np.float64)[:, None]
    j = np.arange(topk, dtype=np.float64)[None, :]
    if num_tokens >= stride:
        sel = (i + j * stride) % num_experts
    else:
        sel = np.floor(i * stride / num_tokens + j * stride) % num_experts
    return np.bincount(sel.astype(np.int64).ravel(), minlength=num_experts)


def _water_fill(c_K: np.ndarray, remaining: int, step: int, bound: int) -> np.ndarray:
    """One rank's one-token-at-a-time loop in closed form: raise the emptiest experts to a common level
    (at most `bound`), or lower the fullest (at least 0); ties go to the lowest index, as argmin / argmax."""
    c = c_K.astype(np.int64)
    x = c if step > 0 else -c
    cap = bound if step > 0 else 0

    def need(level: int) -> int:
        return int(np.clip(level - x, 0, None).clip(max=np.maximum(cap * step - x, 0)).sum())

    lo, hi = int(x.min()), int(cap * step)
    while lo < hi:  # the highest level reachable with `remaining` tokens
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= remaining else (lo, mid - 1)
    y = np.maximum(x, min(lo, cap * step))
    rest = remaining - need(lo)
    tie = np.nonzero((y == lo) & (y < cap * step))[0][:max(rest, 0)]
    y[tie] += 1
    return y if step > 0 else -y


def _round_robin(counts_RK: np.ndarray, remaining: int, step: int, bound: int) -> np.ndarray:
    """``_round_robin_adjust_per_rank``: one token at a time, rank by rank, to the emptiest valid local expert
    (step +1, below `bound`) or from the fullest (step -1, above 0). One pass over the ranks per loop."""
    counts_RK = counts_RK.copy()
    R = counts_RK.shape[0]
    if R == 1:
        counts_RK[0] = _water_fill(counts_RK[0], remaining, step, bound)
        return counts_RK
    rows = np.arange(R)
    while remaining > 0:
        valid_RK = counts_RK < bound if step > 0 else counts_RK > 0
        ok_R = valid_RK.any(axis=1)
        if not ok_R.any():
            break
        key = np.where(valid_RK, counts_RK if step > 0 else -counts_RK, np.iinfo(np.int64).max)
        take = rows[ok_R][:remaining]
        counts_RK[take, key.argmin(axis=1)[take]] += step
        remaining -= len(take)
    return counts_RK


def power_law_counts_E(num_tokens: int, num_experts: int, topk: int, ep: int, alpha: float,
                       rng: np.random.Generator) -> np.ndarray:
    """Tokens per expert of one ``_generate_power_law_distribution`` draw (busiest rank first)."""
    lo, hi = (1.0, num_tokens * 0.8) if num_tokens * topk > num_experts else (0.01, 2.0)
    u = rng.random(num_experts)
    x = ((hi ** (1 - alpha) - lo ** (1 - alpha)) * u + lo ** (1 - alpha)) ** (1 / (1 - alpha))
    target = num_tokens * topk
    counts = np.round(x / x.sum() * target).astype(np.int64)  # torch.round: half to even, as np.round
    overflow = int(np.clip(counts - num_tokens, 0, None).sum())
    counts = np.minimum(counts, num_tokens)
    K = num_experts // ep
    if overflow > 0:
        counts = _round_robin(counts.reshape(ep, K), overflow, +1, num_tokens).ravel()
    delta = target - int(counts.sum())
    if delta:
        counts = _round_robin(counts.reshape(ep, K), abs(delta), 1 if delta > 0 else -1, num_tokens).ravel()
    c_RK = counts.reshape(ep, K)
    top = int(c_RK.sum(axis=1).argmax())
    c_RK[[0, top]] = c_RK[[top, 0]]
    return c_RK.ravel()


def rank0_counts_DK(distribution: str, num_tokens: int, num_experts: int, topk: int, ep: int,
                    draws: int = 5, seed: int = 0) -> np.ndarray:
    """Rank 0's tokens per local expert for each timed draw (balanced: one draw)."""
    K = num_experts // ep
    if distribution == "balanced":
        return balanced_counts_E(num_tokens, num_experts, topk)[None, :K]
    if not distribution.startswith("power_law_"):
        raise ValueError(f"unknown distribution {distribution!r}; expected balanced or power_law_<alpha>")
    alpha = float(distribution.removeprefix("power_law_"))
    rng = np.random.default_rng(seed)
    return np.stack([power_law_counts_E(num_tokens, num_experts, topk, ep, alpha, rng)[:K] for _ in range(draws)])
