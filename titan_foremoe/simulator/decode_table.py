"""``rollout.py``'s engine model, tabulated once per engine size and evaluated on every engine of a fleet at once.

The split search (``best_split.py``) charges thousands of engine rollouts (every split, every k, every partial
step): ``decode_step_ms`` costs ~7 ms a call, so ``EngineModel`` evaluates it once on a grid of batch sizes
(dense, experts and all-reduce depend on the batch only; the KV read is linear in batch x context and is kept
exact) and interpolates. Each engine is then charged exactly as ``engine_rollout_ms`` charges it: decode steps
``max(longest, tokens / slots)`` at the mean batch, slots ``min(max_batch, kv_seqs)``, prefill FLOPs at the dense
rate, decode / ``decode_efficiency``; ``tests/test_best_split.py`` checks it against ``engine_rollout_ms``.

One difference, stated: the context a decoded token attends to is the token-weighted mean (prompt + its position:
``sum(g pos + g (g - 1) / 2) / sum(g)`` over the sequences, ``g`` tokens generated this run from position ``pos``),
what the KV reads add up to; ``engine_rollout_ms`` charges prompt + half the *mean* response, which is low for
long-tailed lengths (the long responses hold most tokens, at long contexts).

Legend: S sequences of the run, K engines, B grid batch sizes.
"""

from __future__ import annotations

import numpy as np

from ..rollouts.engines.sync_cost import hf_tensor_bytes
from .rollout import GPU_MEMORY_UTILIZATION, decode_step_ms, gpu_memory_bytes, prefill_flops

GRID = 48  # batch sizes tabulated, geometric from 1 to max_batch


class EngineModel:
    """One engine size's rollout cost (``rollout.py``'s model), vectorized over a fleet's engines."""

    def __init__(self, model, cal, link, g: int, hbm_Bps: float, prompt_tokens: int, max_batch: int,
                 decode_efficiency: float = 1.0):
        self.model, self.g, self.P, self.max_batch = model, g, prompt_tokens, max_batch
        self.eff = decode_efficiency
        self.b_B = np.unique(np.round(np.geomspace(1, max(max_batch, 2), GRID)))
        parts = [decode_step_ms(model, cal, link, float(b), 0.0, g, hbm_Bps) for b in self.b_B]
        self.base_B = np.array([p["dense"] + p["experts"] + p["allreduce"] for p in parts])
        self.kv_ms = decode_step_ms(model, cal, link, 1.0, 1.0, g, hbm_Bps)["kv"]  # per sequence per context token
        free = gpu_memory_bytes(cal) * GPU_MEMORY_UTILIZATION - float(hf_tensor_bytes(model, 2).sum()) / g - 2e9
        self.kv_free_over_token = free / (self.kv_ms * hbm_Bps * 1e-3)  # kv_seqs' free / bytes per context token
        self.rate = g * link.dense_tflops * 1e12

    def step_ms(self, b, ctx):
        """One decode step of batch b at mean context ctx (``decode_step_ms``'s sum, the batch interpolated)."""
        return np.interp(b, self.b_B, self.base_B) + self.kv_ms * np.asarray(b) * np.asarray(ctx)

    def slots(self, final_ctx):
        """``min(max_batch, kv_seqs)``: sequences whose final context the KV cache holds."""
        return np.minimum(self.max_batch, np.maximum(np.floor(self.kv_free_over_token / np.maximum(final_ctx, 1.0)),
                                                     1.0))

    def fleet_ms(self, engine_S: np.ndarray, gen_S: np.ndarray, K: int, pos_S: np.ndarray | None = None,
                 final_S: np.ndarray | None = None, prefill_tokens_K=None, prefill_pairs_K=None) -> dict:
        """Each of K engines generating ``gen_S`` tokens of the sequences dealt to it (``engine_S``), from position
        ``pos_S`` (0: new), of final length ``final_S`` (default pos + gen); prefill of ``prefill_tokens_K``
        positions with ``prefill_pairs_K`` attention pairs per engine (default none). ``{"ms_K", "rollout_ms"
        (slowest engine), "decode_steps_K", "mean_batch_K", "tokens_K"}``."""
        gen = np.asarray(gen_S, dtype=np.float64)
        pos = np.zeros_like(gen) if pos_S is None else np.asarray(pos_S, dtype=np.float64)
        final = pos + gen if final_S is None else np.asarray(final_S, dtype=np.float64)
        count_K = np.bincount(engine_S, minlength=K).astype(np.float64)
        tokens_K = np.bincount(engine_S, weights=gen, minlength=K)
        longest_K = np.zeros(K)
        np.maximum.at(longest_K, engine_S, gen)
        pos_sum_K = np.bincount(engine_S, weights=gen * pos + gen * (gen - 1) / 2, minlength=K)
        final_K = self.P + np.bincount(engine_S, weights=final, minlength=K) / np.maximum(count_K, 1)
        slots_K = self.slots(final_K)
        steps_K = np.maximum(longest_K, np.ceil(tokens_K / slots_K))
        busy = steps_K > 0
        b_K = np.where(busy, tokens_K / np.maximum(steps_K, 1), 0.0)
        ctx_K = self.P + np.where(busy, pos_sum_K / np.maximum(tokens_K, 1), 0.0)
        decode_K = np.where(busy, steps_K * self.step_ms(np.maximum(b_K, 1), ctx_K), 0.0) / self.eff
        pre_K = np.zeros(K)
        if prefill_tokens_K is not None:
            pre_K = prefill_flops(self.model, np.asarray(prefill_tokens_K, float),
                                  np.asarray(prefill_pairs_K, float)) / self.rate * 1e3
        ms_K = decode_K + pre_K
        return {"ms_K": ms_K, "rollout_ms": float(ms_K.max()) if K else 0.0, "decode_steps_K": steps_K,
                "mean_batch_K": b_K, "tokens_K": tokens_K, "prefill_ms_K": pre_K}
