"""Synthetic skewed loads for named model shapes (timing at scales we have no trace for).

Each layer gets a lognormal expert popularity (stable across micro-steps, as in RL)
that each micro-step perturbs; every source draws its tokens' top-k experts from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ModelShape:
    num_layers: int  # MoE layers
    num_experts: int
    top_k: int
    tokens_per_response: int = 280
    dim: int = 0  # model dim D and expert hidden size F (expert weights 3 x F x D), for memory figures
    moe_hidden_dim: int = 0


MODEL_SHAPES = {
    "gpt_oss_20b": ModelShape(24, 32, 4, dim=2880, moe_hidden_dim=2880),
    "gpt_oss_120b": ModelShape(36, 128, 4, dim=2880, moe_hidden_dim=2880),
    "qwen3_30b_a3b": ModelShape(48, 128, 8, dim=2048, moe_hidden_dim=768),
    "deepseek_v3": ModelShape(58, 256, 8, dim=7168, moe_hidden_dim=2048),  # MoE layers only (the first 3 of 61 are dense)
    "tiny": ModelShape(2, 8, 2, 20, dim=64, moe_hidden_dim=128),
}


def _draw(name: str, num_micro_steps: int, num_ranks: int, responses_per_source: int, seed: int, skew: float):
    """(rng, popularity p_MLSE, tokens_M1S): the draws of ``synthetic_loads`` before its multinomial."""
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown synthetic model {name!r}; choose from {sorted(MODEL_SHAPES)}")
    shp = MODEL_SHAPES[name]
    rng = np.random.default_rng(seed)
    L, E, k = shp.num_layers, shp.num_experts, shp.top_k
    # popularity: lognormal per expert and layer (stable), perturbed per micro-step and source;
    # an expert is picked at most once per token, so its probability is capped at 1 / top_k.
    base = rng.lognormal(0.0, skew, size=(L, E))
    noise = rng.lognormal(0.0, 0.3 * skew, size=(num_micro_steps, L, num_ranks, E))
    p = base[None, :, None, :] * noise
    for _ in range(3):
        p /= p.sum(axis=3, keepdims=True)
        np.minimum(p, 1.0 / k, out=p)
    p /= p.sum(axis=3, keepdims=True)
    tokens = rng.integers(
        shp.tokens_per_response // 4, 2 * shp.tokens_per_response, size=(num_micro_steps, 1, num_ranks)
    ) * responses_per_source
    return rng, p, tokens


def synthetic_tokens(name: str, num_micro_steps: int, num_ranks: int, responses_per_source: int, seed: int,
                     skew: float = 0.8) -> np.ndarray:
    """``tokens_MS`` that ``synthetic_loads`` routes for the same arguments (each source's responses share them)."""
    return _draw(name, num_micro_steps, num_ranks, responses_per_source, seed, skew)[2][:, 0, :]


def synthetic_loads(
    name: str, num_micro_steps: int, num_ranks: int, responses_per_source: int, seed: int, skew: float = 0.8,
    tokens_MS: np.ndarray | None = None,
) -> np.ndarray:
    """loads_MLSE int64 for a named shape; deterministic for a seed. ``tokens_MS``: route these tokens per
    micro-step and source instead of the drawn ones (same popularity draws: a scheduled workload's cells)."""
    rng, p, tokens = _draw(name, num_micro_steps, num_ranks, responses_per_source, seed, skew)
    if tokens_MS is not None:
        tokens = np.asarray(tokens_MS, dtype=np.int64)[:, None, :]
    shp = MODEL_SHAPES[name]
    n = np.broadcast_to(tokens * shp.top_k, (num_micro_steps, shp.num_layers, num_ranks))
    return rng.multinomial(n, p).astype(np.int64)
