"""The RL step outside the trainer's stages: rollout on the inference engine, and the weight sync before it.

Rollout (same for every balancer: the engine does not use the trainer's placement). Engines of
``engine_gpus`` GPUs (default one node: attention and dense layers tensor-parallel over them, experts
expert-parallel) serve their share of the rollout's responses; each prompt of ``prompt_tokens`` is
prefilled, then every response decodes its trace length with continuous batching of up to ``max_batch``
sequences (vLLM's default ``max_num_seqs`` 256): ``steps = max(longest response, total tokens / max_batch)``
decode steps at the mean batch ``b = total tokens / steps``. One decode step on one GPU, per layer:
* attention and dense projections: measured bf16 GEMM rows (``gemm_table``) at m = b, as one GEMM with the
  layer's projection weights / engine_gpus (same FLOPs and weight bytes), the output head likewise;
* routed experts: the inference kernel, vLLM's fused MoE (the measured rows' fit, ``fused_moe.py``), on
  the GPU's E / engine_gpus experts with b x top-k pairs spread evenly, every pair scanned (vLLM's EP path);
* attention reads the KV cache of b sequences at the mean context (prompt + half the mean response) at the
  HBM rate; two tensor-parallel all-reduces of b x D activations (charged on the NCCL all-to-all curve at the
  same bytes: the calibration carries no all-reduce rows).
``decode_efficiency`` (default 1: the kernel tables' speed) divides the decode time: what a real engine loses
end to end to sampling, scheduling, returned log-probs, CUDA-graph batch padding and the shrinking batch of the
tail; docs/simulator.md fits it on a published generation time (0.43, not the default).
Prefill: the prompts' forward FLOPs (projections, experts, causal attention) at the calibrated dense rate
over the engine's GPUs. Calibrations without measured rows (datasheet) use a roofline: max(FLOPs at the
dense rate, weight bytes at the HBM rate).

Weight sync: ``rollouts/engines/sync_cost.py``'s ``sync_cost`` of the design the runtime runs (default the
bucketed sync: buckets gathered once to each engine's source rank, broadcast with its node's GPUs as relays;
colocated, the engine's IPC path), on the calibration's NVLink / InfiniBand rates and latency; ``"current"``
(every rank all-gathers every parameter, rank 0 broadcasts tensor by tensor) and ``"reload"`` stay as rows.
"""

from __future__ import annotations

import numpy as np

from .calibration import Calibration
from .models import ModelSpec
from .timing import DeviceCosts


class _Gemm:
    """bf16 GEMM time (ms) at (m, n, k): measured rows where the calibration has them, else a roofline."""

    def __init__(self, cal: Calibration, link: DeviceCosts, hbm_Bps: float):
        self.table = cal.gemm_table()
        self.rate = link.dense_tflops * 1e12
        self.hbm = hbm_Bps

    def __call__(self, m: float, n: float, k: float) -> float:
        n, k = max(int(round(n)), 1), max(int(round(k)), 1)
        if self.table is not None:
            return float(self.table(m, n, k))
        return max(2.0 * m * n * k / self.rate, (n * k + m * (n + k)) * 2 / self.hbm) * 1e3


def _kv_bytes_per_token_layer(model: ModelSpec, g: int) -> float:
    """KV cache bytes (bf16) one GPU reads per token of context per layer (GQA heads split over TP, MLA latent
    replicated)."""
    if model.kv_lora:
        return (model.kv_lora + model.qk_rope) * 2.0
    return 2 * int(np.ceil(model.n_kv_heads / g)) * model.head_dim * 2.0


def decode_step_ms(model: ModelSpec, cal: Calibration, link: DeviceCosts, b: float, context: float, g: int,
                   hbm_Bps: float) -> dict:
    """One decode step of b sequences on one GPU of a g-GPU engine: ms per part."""
    gemm = _Gemm(cal, link, hbm_Bps)
    D = model.dim
    attn_n = model.attn_linear_flops() / (2.0 * D) / g  # projections as one GEMM of the same weights
    dense = model.num_layers * gemm(b, attn_n, D)
    if model.shared_hidden:
        dense += model.moe_layers * gemm(b, 3 * model.shared_hidden / g, D)
    if model.dense_layers:
        dense += model.dense_layers * gemm(b, 3 * model.dense_hidden / g, D)
    dense += gemm(b, model.vocab / g, D)  # output head
    local = max(model.num_experts // g, 1)
    pairs = b * model.top_k
    tok_E = np.full((1, local), pairs / model.num_experts)
    if "fused_moe" in cal.raw:
        experts = float(cal.fused(D, model.moe_hidden).forward_ms(tok_E, np.array([pairs]))[0])
    else:
        experts = float(cal.curve(D, model.moe_hidden).rank_ms(tok_E, backward=False)[0])
    experts *= model.moe_layers
    kv = model.num_layers * b * context * _kv_bytes_per_token_layer(model, g) / hbm_Bps * 1e3
    ar = 0.0
    if g > 1:
        s = link.a2a_s_MLPR(np.array([b * D * link.act_bytes * (g - 1) / g, 0.0])[None, None, :, None])
        ar = 2 * model.num_layers * (link.a2a_latency_us * 1e-3 + float(s.max()) * 1e3)
    return {"dense": dense, "experts": experts, "kv": kv, "allreduce": ar}


def prefill_ms(model: ModelSpec, link: DeviceCosts, prompts: int, prompt_tokens: int, g: int) -> float:
    """Forward FLOPs of the prompts (causal attention included) over the engine's g GPUs at the dense rate."""
    tokens = prompts * prompt_tokens
    per_token = (model.moe_layers * (model.layer_dense_flops(True) + model.top_k * model.expert_flops_per_token())
                 + model.dense_layers * model.layer_dense_flops(False) + model.head_flops())
    pairs = prompts * prompt_tokens * (prompt_tokens + 1) / 2
    flops = tokens * per_token + pairs * model.num_layers * model.attn_pair_flops()
    return flops / (g * link.dense_tflops * 1e12) * 1e3


def rollout_ms(model: ModelSpec, cal: Calibration, link: DeviceCosts, lens: np.ndarray, gpus: int, engine_gpus: int,
               prompt_tokens: int, max_batch: int, hbm_Bps: float, decode_efficiency: float = 1.0) -> dict:
    """Rollout of all responses (`lens`: generated tokens each) on gpus / engine_gpus engines; the slowest
    engine (responses dealt round-robin in trace order) sets the time; decode time / ``decode_efficiency``."""
    if not 0 < decode_efficiency <= 1:
        raise ValueError(f"decode efficiency {decode_efficiency}: must be in (0, 1]")
    g = max(min(engine_gpus, gpus), 1)
    engines = max(gpus // g, 1)
    lens = np.asarray(lens, dtype=np.float64)
    worst = None
    for e in range(engines):
        mine = lens[e::engines]
        if not len(mine):
            continue
        steps = max(float(mine.max()), float(np.ceil(mine.sum() / max_batch)))
        b = mine.sum() / steps
        ctx = prompt_tokens + mine.mean() / 2
        parts = decode_step_ms(model, cal, link, b, ctx, g, hbm_Bps)
        dec = {k: v * steps / decode_efficiency for k, v in parts.items()}
        pre = prefill_ms(model, link, len(mine), prompt_tokens, g)
        total = pre + sum(dec.values())
        if worst is None or total > worst["rollout_ms"]:
            worst = {"rollout_ms": total, "prefill_ms": pre, "decode_ms": sum(dec.values()),
                     "decode_parts_ms": dec, "decode_steps": steps, "mean_batch": b, "engines": engines,
                     "engine_gpus": g}
    return worst


def weight_sync_ms(model: ModelSpec, link: DeviceCosts, trainer_gpus: int, rollout_gpus: int, engine_gpus: int,
                   gpus_per_node: int, design: str = "bucketed", bucket_mb: int = 512, api: str = "vllm",
                   senders: int = 1) -> float:
    """One weight sync of the bf16 HF tensors to the engines (``sync_cost``: the runtime's plan); rollout_gpus 0:
    colocated. ``senders`` > 1: SGLang's sender groups (``[sglang_engine] weight_sync_senders``, buckets of whole
    entries); 1: one source (vLLM's transfer group)."""
    from ..rollouts.engines.sync_cost import SyncLinks, SyncSetting, hf_entry_bytes, hf_tensor_bytes, sync_cost

    # the runtime drives one engine server ([rollout_engine] url): disaggregated, one transfer group of all its GPUs
    several = senders > 1 and design == "bucketed" and rollout_gpus > 0
    s = SyncSetting(design, trainer_gpus, rollout_gpus, rollout_gpus or engine_gpus, gpus_per_node,
                    bucket_bytes=bucket_mb << 20,
                    api="sglang" if several else api, state_entries=12 * model.num_layers + 3,
                    senders=senders if several else 1)
    return sync_cost(hf_tensor_bytes(model, 2), s, SyncLinks.of(link), hf_entry_bytes(model, 2))["sync_s"] * 1e3
