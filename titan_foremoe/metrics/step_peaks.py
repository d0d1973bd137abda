"""The predicted per-rank peaks of an RL step at the real size (``scripts/dry_run.py`` prints them).

The measured counterpart is ``stage_memory.py`` (``torch.cuda.max_memory_allocated`` per stage). Here, from the
dry run's built rank: the rollout's peak (``peak_rows``: the end of decoding, or an engine's weight sync), the
training micro-step's, a colocated engine's phases (``colocated_phases``) and an upper estimate of every NCCL
communicator's buffers at NCCL's defaults (``nccl_communicator_bytes``). Bytes per rank; nothing here runs a
collective (torch is imported inside each function, after the dry run has set up its fake backend).
"""

from __future__ import annotations

MiB = 2**20

# NCCL's per-connection buffers at its defaults (NVIDIA/nccl src/init.cc, ``computeBuffSizes``; constants from
# src/include/device.h): one buffer per protocol for every (peer, channel) connection.
NCCL_SIMPLE_BUFFSIZE = 4 * MiB  # NCCL_BUFFSIZE, DEFAULT_BUFFSIZE = 1 << 22
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16  # NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x 16 B = 512 KiB
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8  # NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x NCCL_STEPS x 8 B
NCCL_P2P_BUFFSIZE_NVL = 512 * 1024 * 8  # send/recv: NCCL_P2P_NVL_CHUNKSIZE (512 KiB) x NCCL_STEPS, inside a node
NCCL_P2P_BUFFSIZE_NET = 128 * 1024 * 8  # NCCL_P2P_NET_CHUNKSIZE (128 KiB) x NCCL_STEPS, across nodes
NCCL_CHANNELS = 16  # collective channels and p2p channels per peer NCCL reports on an 8-GPU NVSwitch node (nccl#892)
H100_BYTES = 80 * 10**9


def nccl_communicator_bytes(n_ranks: int, n_nodes: int, all_to_all: bool, collectives: bool = True,
                            channels: int = NCCL_CHANNELS) -> dict:
    """Upper estimate of one NCCL communicator's device buffers on one rank, at NCCL's defaults.

    Collectives: ``channels`` x connections x (Simple + LL128 + LL buffers); connections per channel: the ring's
    two neighbours, plus two tree peers when the communicator spans nodes. All-to-all (send/recv): every other
    rank x ``channels`` p2p channels per peer x both directions x one p2p buffer (NVLink chunk inside a node,
    network chunk across); ``collectives = False``: a communicator that only runs all-to-alls. NCCL connects lazily (only what an operation of that size uses), so this bounds it.
    NVLS (NVLink SHARP) buffers are not counted (``NCCL_NVLS_ENABLE=0`` removes them)."""
    if n_ranks <= 1:
        return {"collective": 0, "all_to_all": 0}
    per_connection = NCCL_SIMPLE_BUFFSIZE + NCCL_LL128_BUFFSIZE + NCCL_LL_BUFFSIZE
    connections = 2 + (2 if n_nodes > 1 else 0)
    p2p = NCCL_P2P_BUFFSIZE_NVL if n_nodes == 1 else NCCL_P2P_BUFFSIZE_NET
    return {"collective": channels * connections * per_connection if collectives else 0,
            "all_to_all": (n_ranks - 1) * channels * 2 * p2p if all_to_all else 0}


def job_communicators(cfg, pd, rank: int, ranks_per_node: int) -> list[dict]:
    """The NCCL communicators this rank joins: the distinct process groups of the job's meshes (torchtitan's
    ``batch``/``loss``/``fsdp`` share the default group), plus the transfer lane's two twins of the EP group
    (``transfer/groups.py``: prefetch and gradient return, all-to-alls only) when a balancer runs. The host
    lane's gloo twin holds host memory, not device memory."""
    import torch.distributed as dist

    found: dict[int, dict] = {}
    world = list(range(dist.get_world_size()))
    found[id(dist.group.WORLD)] = {"name": "default (world)", "ranks": world, "all_to_all": False}
    for dim in ("batch", "loss", "fsdp", "dp_replicate", "efsdp", "ep"):
        try:
            group = pd.get_mesh(dim).get_group()
        except (ValueError, KeyError, RuntimeError):
            continue  # not a dimension of this job
        entry = found.setdefault(id(group), {"name": dim, "ranks": dist.get_process_group_ranks(group),
                                             "all_to_all": False})
        if entry["name"] != dim and dim not in entry["name"]:
            entry["name"] += f" = {dim}"
        entry["all_to_all"] |= dim == "ep"
    out = list(found.values())
    ep = next((c for c in out if c["all_to_all"]), None)
    if cfg.balance.balancer != "off" and ep is not None:
        out += [{"name": f"ep twin ({what})", "ranks": ep["ranks"], "all_to_all": True, "collectives": False}
                for what in ("prefetch", "gradient return")]
    for c in out:
        c["n_ranks"] = len(c["ranks"])
        c["n_nodes"] = len({r // ranks_per_node for r in c["ranks"]})
        c.update(nccl_communicator_bytes(c["n_ranks"], c["n_nodes"], c["all_to_all"], c.pop("collectives", True)))
        c["bytes"] = c["collective"] + c["all_to_all"]
        del c["ranks"]
    return out


def weight_sync_peak(cfg, args, world_size: int, ranks_per_node: int) -> dict:
    """The weight sync's peak memory beyond the model on its busiest rank, from ``sync_cost`` (the function the
    simulator charges): the streamed syncs (``nccl``, ``distributed``, ``ipc``: colocated on rank 0's node) hold
    buckets, the folder syncs the largest tensor being written."""
    import torch

    from titan_foremoe.rollouts.engines.sync_cost import (SyncLinks, SyncSetting, expert_tensor_count,
                                                          hf_tensor_bytes, sync_cost)
    from titan_foremoe.rollouts.sources import engine_section
    from titan_foremoe.simulator.models import ModelSpec

    e = engine_section(cfg)
    spec = ModelSpec("policy", dim=args.dim, moe_hidden=args.moe_hidden_dim, num_experts=args.num_experts,
                     top_k=args.top_k, moe_layers=args.n_layers, vocab=args.vocab_size, n_heads=args.n_heads,
                     n_kv_heads=args.n_kv_heads, head_dim=args.head_dim)
    colocated = e.weight_sync == "ipc"
    g = min(ranks_per_node, world_size) if colocated else max(e.gpus_per_engine, 1)
    s = SyncSetting("bucketed" if e.weight_sync in ("nccl", "distributed", "ipc") else "reload", world_size,
                    0 if colocated else g, g, ranks_per_node, bucket_bytes=e.weight_sync_bucket_mb << 20,
                    api="sglang" if cfg.rl.rollout_source == "sglang" else "vllm",
                    state_entries=12 * args.n_layers + 3, expert_tensors=expert_tensor_count(spec))
    sizes = hf_tensor_bytes(spec, getattr(torch, e.dtype).itemsize)
    r = sync_cost(sizes, s, SyncLinks(1e9, 1e9, 0.0))  # memory does not depend on the links
    from titan_foremoe.rollouts.fleet.layout import describe, fleet_of

    fleet = describe(fleet_of(e, world_size, ranks_per_node))
    return {"weight_sync": e.weight_sync, "design": s.design, "peak_extra_bytes": r["peak_extra_bytes_per_rank"],
            "buckets": r["buckets"],
            "fleet": fleet}


def colocated_phases(cfg, args, rollout: dict, training: dict, ranks_per_node: int,
                     full_layers: int, *asleep: dict) -> tuple[dict, dict]:
    """A colocated engine (``weight_sync = "ipc"``) on every rank's GPU, per phase (``fleet/colocated_memory.py``):
    the rollout with the engine awake (its ``gpu_memory_utilization`` budget: weight share, KV cache, residue) and
    the trainer's state kept, the weight sync with only its weights awake (moved out of ``rollout``), the training
    with it asleep (``sleep_level``; awake at 0), and so every other phase in ``asleep`` (the recompute). Edits
    ``rollout``, ``training`` and ``asleep`` in place; returns the sync phase and the engine's figures ({} {} when
    not colocated)."""
    from dataclasses import asdict

    import torch

    from titan_foremoe.rollouts.engines.sync_cost import hf_tensor_bytes
    from titan_foremoe.rollouts.fleet.colocated_memory import colocated_memory, gpu_memory_utilization
    from titan_foremoe.simulator.models import ModelSpec

    e = cfg.rollout_engine
    if cfg.rl.rollout_source != "vllm" or e.weight_sync != "ipc":
        return {}, {}
    spec = ModelSpec("policy", dim=args.dim, moe_hidden=args.moe_hidden_dim, num_experts=args.num_experts,
                     top_k=args.top_k, moe_layers=full_layers, vocab=args.vocab_size, n_heads=args.n_heads,
                     n_kv_heads=args.n_kv_heads, head_dim=args.head_dim)  # the full depth, not the built layers
    itemsize = getattr(torch, e.dtype).itemsize
    g = e.gpus_per_engine
    mem = colocated_memory(model_bytes=int(hf_tensor_bytes(spec, itemsize).sum()), gpus_per_engine=g,
                           gpus_per_node=ranks_per_node, gpu_bytes=H100_BYTES,
                           utilization=gpu_memory_utilization(e.extra_args), sleep_level=e.sleep_level,
                           n_layers=full_layers, n_kv_heads=args.n_kv_heads, head_dim=args.head_dim,
                           kv_itemsize=itemsize)
    sync_key = next((k for k in rollout if k.startswith("weight sync (")), None)
    sync_extra = rollout.pop(sync_key) if sync_key else 0
    kept = dict(rollout)
    rollout[f"engine awake: weight share (the model / {g} GPUs)"] = mem.weights_per_gpu
    rollout[f"engine awake: KV cache ({mem.kv_tokens_per_gpu:,} tokens), activations, context "
            f"(gpu_memory_utilization x GPU - weights)"] = mem.budget_per_gpu - mem.weights_per_gpu
    sync = {**kept, "engine weights awake, KV cache asleep": mem.weights_per_gpu}
    if sync_key:
        sync[sync_key] = sync_extra
    for phase in (training, *asleep):
        if mem.sleep_level:
            phase[f"engine asleep (sleep_level {mem.sleep_level}): CUDA context + allocator reserve"] = \
                mem.asleep_per_gpu
        else:
            phase["engine awake (sleep_level 0): its whole gpu_memory_utilization budget"] = mem.budget_per_gpu
    return sync, asdict(mem)


def kv_cache_bytes(n_layers: int, rows: int, tokens: int, n_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """What the rollout's KV caches allocate (``rollouts/generate.py: _LazyKVCache``): per layer, keys and values
    of ``[rows, tokens, n_kv_heads, head_dim]`` for the whole rollout (``tokens`` = the longest prompt +
    ``max_new_tokens``) at the first token."""
    return n_layers * rows * tokens * n_kv_heads * head_dim * 2 * itemsize


def peak_rows(cfg, resolved, model, args, pd, rank: int, ranks_per_node: int, full_layers: int, table: dict,
              per_token: float, act_once: float, tokens: int) -> tuple[dict, dict, dict, list[dict]]:
    """The three peaks of an RL step on this rank, at full depth, and its NCCL communicators.

    Rollout peak (the end of decoding, ``rollouts/generate.py``): the persistent state (fp32 master shard,
    the last update's gradients, which ``zero_grad`` frees only when the next update starts, AdamW, banks),
    the weights unsharded once for the whole decode (``generate.unsharded``: every non-expert weight and this
    rank's EP-local experts, in the compute dtype), the KV cache (``_LazyKVCache``: rows x ``seq_len``, the
    longest a prompt + ``max_new_tokens`` can be, x KV heads x head dim, keys and values, every layer), the
    prefill's one block at a time (rows x the longest prompt, ``seq_len - max_new_tokens``), the decode step's
    ``[rows, vocab]`` fp32 logits / log-prob buffers and the rollout's own buffers (tokens, routes, log-probs).
    Training peak (one update micro-step's backward): the dry run's table above, plus what is transient there:
    two FSDP-unsharded blocks, the unsharded root (embeddings, lm_head), the log-prob head's chunk buffers in
    backward (three ``[chunk, vocab]`` fp32 buffers, the lm_head weight's fp32 gradient sum and one bf16
    chunk product of its size, docs/memory.md) and the recomputed block's activation gradients (taken equal
    to its activations). Recompute peak (one no-grad forward of ``[rl] recompute_merge`` x ``tokens``): the
    persistent state and the kept gradients, the FSDP-unsharded blocks and root, one block's forward at the merged
    tokens (bounded by what it would keep for a backward, ``per_token``: a no-grad forward frees its
    intermediates as it goes) and the log-prob head's forward chunk buffers; below the training peak at k <= 2
    under full AC (that holds two blocks' activations and every block's input)."""
    import torch

    L, scale = args.n_layers, full_layers / args.n_layers
    mp = getattr(torch, cfg.training.mixed_precision_param).itemsize
    unsharded_layer = unsharded_other = 0
    for name, p in model.named_parameters():
        numel = p.numel()  # a DTensor's global size
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and "ep" in (mesh.mesh_dim_names or ()):
            numel //= mesh["ep"].size()  # this rank's EP-local experts, gathered over efsdp
        if name.startswith("layers."):
            unsharded_layer += numel * mp
        else:
            unsharded_other += numel * mp
    unsharded = unsharded_layer * scale + unsharded_other
    at = f"bytes_at_{full_layers}_layers"
    rows = resolved.rollout_sequences // resolved.dp_degree  # decoded together (``EmbeddedSource.generate``)
    T, P = cfg.training.seq_len, cfg.training.seq_len - cfg.rl.max_new_tokens
    from titan_foremoe.routing_log import route_dtype

    route_bytes = torch.empty(0, dtype=route_dtype(args.num_experts)).element_size()
    persistent = {k: table[k][at] for k in ("weights (fp32 master shard)", "optimizer state (AdamW)",
                                            "replica banks", "placement tables (micro-step 0, all layers)",
                                            "stage plan (all micro-steps)")}
    if cfg.rl.rollout_source != "embedded":  # an engine (its own memory) or files generate: nothing decodes here
        rollout = {**persistent, "gradients (fp32 shard, kept from the last update)": table["gradients (fp32 shard)"][at]}
        if cfg.rl.rollout_source in ("vllm", "sglang"):  # the weight sync's buffers, as the simulator charges them
            sync = weight_sync_peak(cfg, args, resolved.world_size, ranks_per_node)
            rollout[f"weight sync ({sync['weight_sync']}): peak extra, busiest rank"] = sync["peak_extra_bytes"]
            print(f"engine fleet: {sync['fleet']}")
    else:
        rollout = {
            **persistent,
            "gradients (fp32 shard, kept from the last update)": table["gradients (fp32 shard)"][at],
            "weights unsharded for decode (compute dtype)": unsharded,
            f"KV cache ({rows} rows x {T} tokens, {full_layers} layers)":
                kv_cache_bytes(full_layers, rows, T, args.n_kv_heads, args.head_dim, mp),
            f"prefill: one block at {rows} rows x {P} prompt tokens": per_token * rows * P,
            "decode logits / log-probs ([rows, vocab] fp32 x 4)": 4 * rows * args.vocab_size * 4,
            "rollout buffers (tokens, routes, log-probs)": rows * T * (8 + full_layers * args.top_k * route_bytes + 4 + 1),
        }
    chunk = cfg.rl.logprob_chunk_tokens
    k = cfg.rl.recompute_merge
    unsharded_in_flight = {  # both stages' forwards: FSDP gathers a block ahead, the root for the whole pass
        "FSDP-unsharded blocks in flight (2, compute dtype)": 2 * unsharded_layer / L,
        "unsharded root (embeddings, lm_head, norm)": unsharded_other,
    }
    recompute = {
        **persistent, "gradients (fp32 shard, kept from the last update)": table["gradients (fp32 shard)"][at],
        **unsharded_in_flight,
        f"one block's forward at recompute_merge {k} x {tokens} tokens (at most its activations for a backward)":
            per_token * k * tokens,
        f"log-prob head forward (chunk {chunk})": 2 * chunk * args.vocab_size * 4,
    }
    training = {name: r[at] for name, r in table.items()}
    training.update({
        **unsharded_in_flight,
        f"log-prob head backward (chunk {chunk})": 3 * chunk * args.vocab_size * 4
        + args.vocab_size * args.dim * (4 + mp),
        "recomputed block's activation gradients (= its activations)": act_once,
    })
    return rollout, training, recompute, job_communicators(cfg, pd, rank, ranks_per_node)
