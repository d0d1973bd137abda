"""A colocated engine's memory on each of its GPUs and on its node's host, per phase of the RL step.

The engine (vLLM, tensor parallel over its ``g`` GPUs) shares every GPU with a trainer rank. Per phase (the order
of ``fleet/sleep.py``):

- **rollout** (awake): vLLM claims ``gpu_memory_utilization`` x the GPU (its ``--gpu-memory-utilization``,
  vLLM's default 0.9, a per-instance cap since 0.7): its weight share (the model / g: TP shards attention, the
  experts and the vocabulary), then KV cache with the rest after its profile run's activations. The trainer
  keeps its state (fp32 master shard, AdamW, the last gradients, banks): its activations are freed.
- **weight sync** (weights awake, KV asleep): the engine's weight share beside the sync's buffers.
- **training** (asleep): level 1 and level 2 alike leave on the GPU only what lives outside vLLM's ``cumem``
  pools: the worker's CUDA context and PyTorch's cached blocks of its profile run and sampler
  (``ENGINE_RESIDUE_BYTES``, assumed: ~0.5 GiB of CUDA 12 context, measured elsewhere on H100 by PyTorch users,
  + 1 GiB of cached blocks with ``--enforce-eager``; CUDA graphs would add their pool). Level 1 holds the weight
  share in pinned host memory (``host_bytes_per_node``: one model copy per engine on the node), level 2 nothing.

The KV cache's token capacity per GPU follows from vLLM's own layout: per token, every layer's K and V of the KV
heads this GPU holds (``max(1, kv_heads / g)``: vLLM replicates KV heads when TP exceeds them).

Cost: arithmetic on the config (no allocation), every rank the same.

Legend: g GPUs per engine, n GPUs per node, M the engine's weights in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

VLLM_DEFAULT_UTILIZATION = 0.9
CUDA_CONTEXT_BYTES = 512 << 20  # assumed: a CUDA 12 context with torch's kernels loaded, per process and GPU
ALLOCATOR_RESERVE_BYTES = 1 << 30  # assumed: torch's cached blocks outside the cumem pools (eager engine)
ENGINE_RESIDUE_BYTES = CUDA_CONTEXT_BYTES + ALLOCATOR_RESERVE_BYTES


def gpu_memory_utilization(extra_args: list[str] | tuple[str, ...]) -> float:
    """vLLM's ``--gpu-memory-utilization`` from the engine's extra arguments (its default when absent)."""
    args = list(extra_args)
    for i, a in enumerate(args):
        if a == "--gpu-memory-utilization" and i + 1 < len(args):
            return float(args[i + 1])
        if a.startswith("--gpu-memory-utilization="):
            return float(a.split("=", 1)[1])
    return VLLM_DEFAULT_UTILIZATION


@dataclass(frozen=True)
class ColocatedMemory:
    """Bytes per GPU (the engine's share of one of its GPUs) and per node (host)."""

    weights_per_gpu: int  # the engine's weight share (awake)
    budget_per_gpu: int  # gpu_memory_utilization x the GPU: all the engine holds awake
    kv_cache_per_gpu: int  # the budget less the weights and the residue (vLLM's KV cache after its profile)
    kv_tokens_per_gpu: int  # tokens the KV cache holds (every sequence of the engine shares it)
    asleep_per_gpu: int  # what stays while the trainer trains (levels 1 and 2)
    host_bytes_per_node: int  # pinned host memory of sleep (level 1: the engines' weights on the node; 2: 0)
    sleep_level: int


def colocated_memory(*, model_bytes: int, gpus_per_engine: int, gpus_per_node: int, gpu_bytes: int,
                     utilization: float, sleep_level: int, n_layers: int, n_kv_heads: int, head_dim: int,
                     kv_itemsize: int) -> ColocatedMemory:
    g = max(1, gpus_per_engine)
    weights = -(-model_bytes // g)
    budget = int(utilization * gpu_bytes)
    kv = max(0, budget - weights - ENGINE_RESIDUE_BYTES)
    per_token = n_layers * 2 * max(1, n_kv_heads // g) * head_dim * kv_itemsize
    host = model_bytes * max(1, gpus_per_node // g) if sleep_level == 1 else 0
    return ColocatedMemory(weights, budget, kv, kv // per_token, ENGINE_RESIDUE_BYTES, host, sleep_level)
