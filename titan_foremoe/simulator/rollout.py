"""The RL step outside the trainer's stages: rollout on the inference engine, and the weight sync before it.

Rollout (same for every balancer: the engine does not use the trainer's placement). The engines the config
launches (``rollouts/fleet/layout.py``'s ``engine_layout``: how many, ``engine_gpus`` GPUs each, attention and
dense layers tensor-parallel over them, experts expert-parallel) serve the step's requests as the runtime's fleet
client deals them (``rollouts/fleet/dealing.py``: a request is a prompt with its ``samples_per_prompt``
responses, dealt LPT on its *estimated* tokens, prompt + n x ``max_tokens``); each engine is then charged the real
lengths it was dealt. Each request's prompt of ``prompt_tokens`` is prefilled once (its samples share the prefix
cache), then every response decodes its trace length with continuous batching of up to ``max_batch`` sequences
(``max_num_seqs``: vLLM 0.28 defaults to 1024 on GPUs of >= 70 GiB, ``engine/arg_utils.py``), fewer where the KV
cache cannot hold them (``kv_seqs``: the GPU's memory x vLLM's ``gpu_memory_utilization`` 0.9, less the engine's
weights per GPU and 2 GB, over each sequence's final context; vLLM would preempt past it):
``steps = max(longest response, total tokens / batch)`` decode steps at the mean batch ``b = total tokens / steps``. One decode step on one GPU, per layer:
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

Sleep and wake (colocated engines with ``[rollout_engine] sleep_level``, ``sleep_wake_ms``): level 1 copies each
GPU's share of the engine's weights to pinned host memory after the rollout and back before the next one (PCIe at
the calibration's pinned D2H / H2D rates: Qwen3-30B-A3B on an 8-GPU engine, 7.6 GB per GPU, ~0.14 s each way; the
vLLM blog's sleep-mode benchmarks, 2025-10-26, report level-1 wakes of 0.1-6 s from 0.6B to 235B models), the KV
cache dropped and re-allocated (free); level 2 discards the weights (the sync refills them: no copy), one call each.

The embedded loop (``rollout_source = "embedded"``) is charged by ``embedded_rollout.py``.

Weight sync: ``rollouts/engines/sync_cost.py``'s ``sync_cost`` of the design the runtime runs (default the
bucketed sync: buckets gathered once to rank 0, broadcast with its node's GPUs as relays to ONE transfer group of
every engine's workers, the fleet's ``one_group``;
colocated, the IPC path as ``rollouts/engines/ipc_weights.py`` runs it: ``colocated_ipc_cost``), on the calibration's NVLink / InfiniBand rates and latency; ``"current"``
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


def prefill_flops(model: ModelSpec, tokens, pairs):
    """Forward FLOPs of prefilling ``tokens`` positions with ``pairs`` causal attention pairs (scalars or arrays)."""
    per_token = (model.moe_layers * (model.layer_dense_flops(True) + model.top_k * model.expert_flops_per_token())
                 + model.dense_layers * model.layer_dense_flops(False) + model.head_flops())
    return tokens * per_token + pairs * model.num_layers * model.attn_pair_flops()


def prefill_ms(model: ModelSpec, link: DeviceCosts, prompts: int, prompt_tokens: int, g: int) -> float:
    """Forward FLOPs of the prompts (causal attention included) over the engine's g GPUs at the dense rate."""
    flops = prefill_flops(model, prompts * prompt_tokens, prompts * prompt_tokens * (prompt_tokens + 1) / 2)
    return flops / (g * link.dense_tflops * 1e12) * 1e3


def deal_requests(lens: np.ndarray, engines: int, prompt_tokens: int, samples_per_prompt: int = 1,
                  max_tokens: int = 0) -> np.ndarray:
    """``[G]`` engine of each request (``samples_per_prompt`` consecutive responses of ``lens``), as the runtime's
    fleet client deals them (``dealing.deal``) on their estimated tokens: prompt + n x ``max_tokens`` (default
    the longest response: the cap the runtime sends)."""
    from ..rollouts.fleet.dealing import deal, request_tokens

    n = max(int(samples_per_prompt), 1)
    G = -(-len(lens) // n)
    size_G = np.minimum(n, len(lens) - n * np.arange(G))
    est_G = request_tokens(np.full(G, prompt_tokens), size_G, max_tokens or float(np.max(lens)))
    return deal(est_G, np.ones(max(engines, 1), bool))


GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of a GPU's memory for weights, activations and KV cache


def gpu_memory_bytes(cal: Calibration) -> float:
    """The calibration's GPU memory from its device name ("NVIDIA H100 80GB HBM3": 80 GB; an H200 141 GB), else
    80 GB."""
    import re

    name = str(cal.raw.get("device", ""))
    m = re.search(r"(\d+)\s*GB", name)
    return float(m.group(1)) * 1e9 if m else 141e9 if "H200" in name.upper() else 80e9


def kv_seqs(model: ModelSpec, cal: Calibration, g: int, context: float) -> int:
    """Sequences of ``context`` tokens one engine of g GPUs can hold in its KV cache (module docstring)."""
    from ..rollouts.engines.sync_cost import hf_tensor_bytes

    free = gpu_memory_bytes(cal) * GPU_MEMORY_UTILIZATION - float(hf_tensor_bytes(model, 2).sum()) / g - 2e9
    per_seq = model.num_layers * _kv_bytes_per_token_layer(model, g) * max(context, 1.0)
    return max(int(free // per_seq), 1)


def engine_rollout_ms(model: ModelSpec, cal: Calibration, link: DeviceCosts, lens: np.ndarray, requests: int, g: int,
                      prompt_tokens: int, max_batch: int, hbm_Bps: float, decode_efficiency: float = 1.0,
                      context: float | None = None) -> dict:
    """One engine of g GPUs generating ``lens`` (its responses) for ``requests`` prompts: continuous batching of up
    to ``max_batch`` sequences and what its KV cache holds, its longest response bounds its decode steps; decode
    time / ``decode_efficiency``. ``context``: the mean context a decoded token attends to (default prompt + half
    the mean response; ``decode_table.py`` passes the token-weighted mean)."""
    lens = np.asarray(lens, dtype=np.float64)
    max_batch = min(max_batch, kv_seqs(model, cal, g, prompt_tokens + float(lens.mean())))
    steps = max(float(lens.max()), float(np.ceil(lens.sum() / max_batch)))
    b = lens.sum() / steps
    ctx = prompt_tokens + lens.mean() / 2 if context is None else context
    parts = decode_step_ms(model, cal, link, b, ctx, g, hbm_Bps)
    dec = {k: v * steps / decode_efficiency for k, v in parts.items()}
    pre = prefill_ms(model, link, requests, prompt_tokens, g)
    return {"rollout_ms": pre + sum(dec.values()), "prefill_ms": pre, "decode_ms": sum(dec.values()),
            "decode_parts_ms": dec, "decode_steps": steps, "mean_batch": b, "tokens": float(lens.sum()),
            "max_batch": max_batch}


def rollout_ms(model: ModelSpec, cal: Calibration, link: DeviceCosts, lens: np.ndarray, gpus: int, engine_gpus: int,
               prompt_tokens: int, max_batch: int, hbm_Bps: float, decode_efficiency: float = 1.0, *,
               engines: int = 0, samples_per_prompt: int = 1, max_tokens: int = 0) -> dict:
    """Rollout of all responses (``lens``: generated tokens each) on ``engines`` engines of ``engine_gpus`` GPUs
    (0: ``gpus // engine_gpus``, the layout's default), requests dealt as the runtime deals them
    (``deal_requests``); the slowest engine sets the time. Also per engine: ``engine_ms``, ``engine_tokens``."""
    if not 0 < decode_efficiency <= 1:
        raise ValueError(f"decode efficiency {decode_efficiency}: must be in (0, 1]")
    g = max(min(engine_gpus, gpus), 1)
    K = engines or max(gpus // g, 1)
    lens = np.asarray(lens, dtype=np.float64)
    n = max(int(samples_per_prompt), 1)
    engine_G = deal_requests(lens, K, prompt_tokens, n, max_tokens)
    engine_S = np.repeat(engine_G, n)[: len(lens)]
    per = []
    for e in range(K):
        mine = lens[engine_S == e]
        per.append(engine_rollout_ms(model, cal, link, mine, int((engine_G == e).sum()), g, prompt_tokens, max_batch,
                                     hbm_Bps, decode_efficiency) if len(mine) else None)
    worst = max((p for p in per if p), key=lambda p: p["rollout_ms"])
    return {**worst, "engines": K, "engine_gpus": g, "samples_per_prompt": n,
            "engine_ms": [p["rollout_ms"] if p else 0.0 for p in per],
            "engine_tokens": [p["tokens"] if p else 0.0 for p in per]}


def sleep_wake_ms(model: ModelSpec, link: DeviceCosts, engine_gpus: int, level: int, call_ms: float = 2.0) -> dict:
    """Sleep after the rollout and wake before the next, per step (module docstring): level 1 the engine's bf16
    weights per GPU to pinned host memory (D2H) and back (H2D); level 2 no copy (the sync refills them); 0: none."""
    if level not in (0, 1, 2):
        raise ValueError(f"sleep level {level}: 0 (off), 1 or 2")
    if level == 0:
        return {"sleep_ms": 0.0, "wake_ms": 0.0, "host_bytes_per_gpu": 0.0}
    from ..rollouts.engines.sync_cost import hf_tensor_bytes

    per_gpu = float(hf_tensor_bytes(model, 2).sum()) / max(engine_gpus, 1) if level == 1 else 0.0
    d2h = (link.d2h_GBps or link.h2d_GBps) * 1e9
    return {"sleep_ms": per_gpu / d2h * 1e3 + call_ms, "wake_ms": per_gpu / (link.h2d_GBps * 1e9) * 1e3 + 2 * call_ms,
            "host_bytes_per_gpu": per_gpu}


def weight_sync_ms(model: ModelSpec, link: DeviceCosts, trainer_gpus: int, rollout_gpus: int, engine_gpus: int,
                   gpus_per_node: int, design: str = "bucketed", bucket_mb: int = 512, api: str = "vllm",
                   senders: int = 1, load: str = "stacked") -> float:
    """One weight sync of the bf16 HF tensors to the engines (``sync_cost``: the runtime's plan); rollout_gpus 0:
    colocated. ``senders`` > 1: SGLang's sender groups (``[sglang_engine] weight_sync_senders``, buckets of whole
    entries); 1: one source (vLLM's transfer group). ``load``: the engine's load of what arrives (``sync_cost``'s
    ``engine_load_s``): ``stacked`` (vLLM with our ``vllm_fused_load`` extension, the runtime's default) or
    ``per_tensor`` (the engines' stock loaders; SGLang always)."""
    from ..rollouts.engines.sync_cost import (SyncLinks, SyncSetting, expert_tensor_count, hf_entry_bytes,
                                              hf_tensor_bytes, sync_cost)

    # the designs the fleet does not run (current, reload, SGLang's sender groups): one engine server of all its GPUs
    several = senders > 1 and design == "bucketed" and rollout_gpus > 0
    s = SyncSetting(design, trainer_gpus, rollout_gpus, rollout_gpus or engine_gpus, gpus_per_node,
                    bucket_bytes=bucket_mb << 20,
                    api="sglang" if several else api, state_entries=12 * model.num_layers + 3,
                    senders=senders if several else 1, expert_tensors=expert_tensor_count(model),
                    load="per_tensor" if several or api == "sglang" else load)
    return sync_cost(hf_tensor_bytes(model, 2), s, SyncLinks.of(link), hf_entry_bytes(model, 2))["sync_s"] * 1e3
