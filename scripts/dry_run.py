"""Dry run of one rank of a large job on this machine: memory per rank at the real size.

torchtitan's ``comm.mode = "fake_backend"`` makes the process rank ``--rank`` of a
``--world-size`` job whose collectives do nothing, so this process builds exactly
that rank's share: the meshes, the model shard (FSDP2 + EP, materialized in CPU
memory), the optimizer state (one AdamW step on zero gradients), and the
placement runtime with its plan, per-micro-step tables and replica banks (one
stage planned from synthetic skewed loads of the job's shape and started, which
issues micro-step 0's transfers). Fewer layers (``--n-layers``) keep it small;
everything per layer is measured and extrapolated linearly to the model's
full depth (embeddings, output and final norm are counted once).

    python scripts/dry_run.py --config train_configs/qwen3_30b_a3b_grpo.toml --world-size 64 --rank 0 \\
        --n-layers 2 --out /tmp/dry_run.json

Prints a table and writes JSON. The weights are this rank's master copy
(``mixed_precision_param`` is the compute dtype, FSDP2 keeps parameters in
fp32), gradients the same size. Held for backward in one micro-step of
``[training] max_tokens_per_micro_step`` tokens (packed rows; without a budget ``local_batch_size x seq_len``): the blocks' activations under the config's
``[activation_checkpoint] mode`` (``full``: each block's input, plus one block's
activations while it is recomputed; "before" is without AC; measured per token on
a one-block model of the real width, ``benchmarks/activation_bytes.py``), *before* the fused log-prob head the
``[tokens, vocab]`` logits (``rl/logprobs.py``; now computed a chunk at a time inside the lm_head, none held) and,
*before* the bank rows, the slot-weight copies the grouped GEMMs saved (C slots x
3 matrices per layer; ``benchmarks/measure_saved_bytes.py`` measures both). The
prefetch buffers of micro-step m+1 (every layer's send and receive rows, from
micro-step 1's tables) lived through micro-step m before; now at most two
windows of layers (``[balance] prefetch_window_layers``) are in flight, and only
their send rows: received rows land in their bank slot (counted with the banks). FSDP's transient unsharded
blocks and one layer's dispatch buffers are transient, not counted in that table.

Then the three peaks of an RL step and NCCL (``peak_rows``): the rollout's (the end of decoding: the KV cache
at the rollout's rows per rank and ``seq_len`` tokens, the weights unsharded once for the decode, the
prefill's block, the decode's ``[rows, vocab]`` log-prob buffers, the persistent state), the training
micro-step's (the table plus its transients: unsharded blocks and root, the log-prob head's chunk buffers in
backward, the recomputed block's gradients), the recompute stage's (one no-grad forward of ``[rl]
recompute_merge`` micro-steps: one block at the merged tokens), and an upper estimate of every NCCL communicator's buffers at
NCCL's defaults (``nccl_communicator_bytes``). The per-rank peak is the largest stage plus NCCL; the script
exits 1 when it exceeds ``--budget-gib`` (64: an 80 GB H100, 74.5 GiB, less ~10 GiB for the CUDA context,
library workspaces and the allocator's fragmentation).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

# the step's peaks and NCCL's buffers (also imported from here: ``from dry_run import kv_cache_bytes``)
from titan_foremoe.metrics.step_peaks import (H100_BYTES, colocated_phases, job_communicators, kv_cache_bytes,
                                              nccl_communicator_bytes, peak_rows)

GiB = 2**30
BUDGET_GIB = 64.0


def tensor_bytes(obj, seen: set | None = None) -> int:
    """Bytes of every distinct tensor / ndarray reachable from ``obj`` (local shards for DTensors)."""
    import torch
    from torch.distributed.tensor import DTensor

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        key = ("t", obj.untyped_storage().data_ptr()) if obj.device.type != "meta" else ("m", id(obj))
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, np.ndarray):
        base = obj if obj.base is None else obj.base
        if ("n", id(base)) in seen:
            return 0
        seen.add(("n", id(base)))
        return base.nbytes if isinstance(base, np.ndarray) else obj.nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple, set)):
        return sum(tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type) and not isinstance(obj, torch.nn.Module):
        return sum(tensor_bytes(v, seen) for v in vars(obj).values())
    if hasattr(obj, "__slots__") and not isinstance(obj, type):
        return sum(tensor_bytes(getattr(obj, s), seen) for s in obj.__slots__ if hasattr(obj, s))
    return 0


def synthetic_loads_MLSE(M: int, L: int, S: int, E: int, k: int, batch: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """The planner's synthetic skewed loads (``planner/synthetic.py``) for this job's shape, registered under
    its own name; responses of ``seq_len / 8 .. seq_len`` tokens, so a source holds at most ``batch x seq_len``."""
    from titan_foremoe.planner.synthetic import MODEL_SHAPES, ModelShape, synthetic_loads

    name = f"dry_run_{L}x{E}x{k}_{seq_len}"
    MODEL_SHAPES.setdefault(name, ModelShape(L, E, k, tokens_per_response=max(seq_len // 2, 4)))
    return synthetic_loads(name, M, S, responses_per_source=batch, seed=seed)


def hf_with_layers(folder: str, n_layers: int, under: str) -> str:
    """An HF folder under ``under`` that is ``folder`` with ``num_hidden_layers = n_layers`` in its config.json
    (every other file linked, so the tokenizer and the weight files' headers are the original's)."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        from titan_foremoe.config.loader import ConfigError

        raise ConfigError(f"[model] hf_assets_path: {folder!r} is not a Hugging Face folder (no config.json; a "
                          "stand-in: python scripts/make_tiny_hf_checkpoint.py --out DIR)")
    out = os.path.join(under, "hf_layers")
    os.makedirs(out)
    for name in os.listdir(folder):
        if name != "config.json":
            os.symlink(os.path.abspath(os.path.join(folder, name)), os.path.join(out, name))
    with open(os.path.join(folder, "config.json")) as f:
        hf_config = json.load(f)
    hf_config["num_hidden_layers"] = n_layers
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config, f)
    return out


_PER_TOKEN: dict = {}


def _block_bytes_per_token(args, dtype) -> float:
    """``bytes_per_token`` (models/activation_bytes.py), once per block shape in this process (it builds a block of
    the real width: ~27 s at Qwen3-30B-A3B here, and every dry run of that shape measures the same)."""
    import dataclasses

    from titan_foremoe.models.activation_bytes import bytes_per_token

    key = (repr(dataclasses.replace(args, n_layers=1, vocab_size=0)), dtype)
    if key not in _PER_TOKEN:
        _PER_TOKEN[key] = bytes_per_token(args, dtype)
    return _PER_TOKEN[key]


def _fake_all_to_all(torch) -> None:
    """The fake backend refuses an uneven all-to-all whose send side is empty; its collectives do nothing anyway."""
    import torch.distributed as dist

    class _Done:
        def wait(self, *a, **k):
            return True

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        return _Done() if async_op else None

    dist.all_to_all_single = all_to_all_single


def dry_run(config: str, world_size: int, rank: int, n_layers: int | None, overrides: list[str],
            ranks_per_node: int = 8) -> dict:
    os.environ.update(NGPU=str(world_size), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank % ranks_per_node), LOCAL_WORLD_SIZE=str(ranks_per_node))
    import torchtitan_patches

    torchtitan_patches.apply_all()
    import torch

    from titan_foremoe.config import load_config
    from titan_foremoe.config.validate import model_args, validate
    from titan_foremoe.distributed import parallelize
    from titan_foremoe.placement.runtime import PlacementRuntime
    from titan_foremoe.planner.balancers import plan_stage
    from titan_foremoe.planner.types import CostModel, PlannerConfig, Topology
    from titan_foremoe.train import components

    _fake_all_to_all(torch)
    dump = tempfile.mkdtemp(prefix="dry_run_")
    extra = ["--comm.mode=fake_backend", "--metrics.enable_tensorboard=false", f"--job.dump_folder={dump}"]
    hf = load_config(config, overrides).model.hf_assets_path
    if n_layers is not None and hf:  # the shape is config.json's: a copy of the folder with fewer layers
        extra.append(f"--model.hf_assets_path={hf_with_layers(hf, n_layers, dump)}")
    elif n_layers is not None:
        extra.append(f"--model.n_layers={n_layers}")
    cfg = load_config(config, [*overrides, *extra])
    full_layers = model_args(load_config(config, overrides)).n_layers
    t0 = time.perf_counter()
    from titan_foremoe.config import validate as checks

    device_type = checks._job_device_type
    if cfg.rl.rollout_source == "vllm" and cfg.rollout_engine.weight_sync == "ipc":  # colocated: GPU-only keys
        checks._job_device_type = lambda: "cuda"  # (ipc, sleep_level) checked as on the job's GPUs, not ours
    try:
        resolved = validate(cfg, world_size)
    finally:
        checks._job_device_type = device_type
    assert parallelize.init_distributed(cfg) == world_size
    pd = parallelize.build_parallel_dims(cfg, world_size)
    args = model_args(cfg)  # the flavor's vocabulary, not the debug tokenizer's
    L = args.n_layers
    model = parallelize.build_model(cfg, args, pd, torch.device("cpu"))
    t_model = time.perf_counter() - t0

    # weights: per layer vs once (embeddings, norm, output)
    layer_w = sum(tensor_bytes(p) for n, p in model.named_parameters() if n.startswith("layers."))
    other_w = sum(tensor_bytes(p) for n, p in model.named_parameters() if not n.startswith("layers."))
    expert_w = sum(tensor_bytes(p) for n, p in model.named_parameters() if "routed_experts" in n)

    # optimizer state: one step on zero gradients materializes it
    opt = components.build_optimizers(cfg, model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    states = [s for o in opt.optimizers for s in o.state.values()]
    opt_bytes = sum(tensor_bytes(v) for s in states for v in s.values() if getattr(v, "dim", lambda: 0)() > 0)

    # placement: plan one update stage from synthetic loads, start it (tables + banks of micro-step 0)
    runtime = plan_ms = plan_ms_full = start_s = None
    banks = tables = plan_bytes = prefetch_rows = 0
    M = resolved.micro_steps * cfg.rl.updates_per_rollout
    if cfg.balance.balancer != "off":
        b, ep = cfg.balance, resolved.ep
        topology = Topology.from_ranks(ep, b.ranks_per_node or ep)
        ep_rank = pd.get_mesh("ep").get_local_rank()
        ep_group = pd.get_mesh("ep").get_group()
        runtime = PlacementRuntime(model, ep_group, ep_rank, ep, topology.node_of_rank_R(), path=b.transfer_path,
                                   cost=CostModel(), weights_dtype=getattr(torch, cfg.training.mixed_precision_param))
        batch_seq = (cfg.training.local_batch_size, cfg.training.seq_len)
        loads = synthetic_loads_MLSE(M, L, ep, args.num_experts, args.top_k, *batch_seq)
        t1 = time.perf_counter()
        plan = plan_stage(b.balancer, loads, topology, PlannerConfig(spare_slots=b.spare_slots),
                          micro_steps_per_step=resolved.micro_steps)
        plan_ms = (time.perf_counter() - t1) * 1e3 / M
        if L != full_layers:  # planning needs no model: time it at full depth too
            full = synthetic_loads_MLSE(M, full_layers, ep, args.num_experts, args.top_k, *batch_seq)
            t1 = time.perf_counter()
            plan_stage(b.balancer, full, topology, PlannerConfig(spare_slots=b.spare_slots),
                       micro_steps_per_step=resolved.micro_steps)
            plan_ms_full = (time.perf_counter() - t1) * 1e3 / M
        else:
            plan_ms_full = plan_ms
        t1 = time.perf_counter()
        with torch.no_grad():
            runtime.start_stage(plan, loads)
        start_s = time.perf_counter() - t1
        plan_bytes = tensor_bytes(plan)
        tables = runtime.tables[0].nbytes  # micro-step 0, all layers (the tables of M micro-steps: M times that)
        # micro-step 1's send and receive rows, all layers: in flight through micro-step 0 (received rows land in
        # the banks now, counted there; before they had receive buffers of their own)
        next_layers = runtime.tables[min(1, len(runtime.tables) - 1)].layers
        send_rows = sum(len(t.transfers.direct.send_row_T) for t in next_layers)
        prefetch_rows = send_rows + sum(len(t.transfers.direct.recv_row_T) for t in next_layers)
        runtime.end_stage()  # drains the transfers in flight: what the engine keeps is its banks
        banks = tensor_bytes(runtime.engine)

    # held for backward in one micro-step: per block by ``[activation_checkpoint] mode``, plus (AC on) one
    # block's activations alive once while it is recomputed in backward
    from titan_foremoe.models.activation_bytes import held_model_per_token, held_per_token

    from titan_foremoe.train.sequence_plan import positions_per_micro_step

    tokens = positions_per_micro_step(cfg)  # the token budget when set (packed rows), else rows x seq_len
    dtype = getattr(torch, cfg.model.expert_dtype)
    ac_mode = cfg.activation_checkpoint.mode
    per_token = _block_bytes_per_token(args, dtype)
    held, once = held_model_per_token(args, ac_mode, per_token, dtype, per_token_selective=held_per_token(
        args, "selective", dtype) if ac_mode == "selective" else None)
    act_none = per_token * tokens * L  # before: no activation checkpointing (every RL job until [activation_checkpoint])
    act_layer, act_once = held * tokens * L, once * tokens
    # before: the model's [tokens, vocab] logits (compute dtype), saved by the chunked log-probs for their backward;
    # now the lm_head computes the log-probs a chunk at a time from the hidden states (rl/logprobs.py:
    # lm_head_logprobs) and nothing of that size is held (its chunk buffers are transient, in backward)
    logits = tokens * args.vocab_size * getattr(torch, cfg.training.mixed_precision_param).itemsize
    row_bytes = args.expert_param_bytes(torch.empty(0, dtype=dtype).element_size())
    slots = (args.num_experts // resolved.ep + cfg.balance.spare_slots) if runtime is not None else 0
    copies_before = slots * row_bytes * L  # cat(owned, bank).index_select(...) saved per w1/w2/w3
    prefetch = prefetch_rows * row_bytes  # before: send and receive buffers
    prefetch_after = send_rows * row_bytes  # after: send buffers (the all-to-all writes into the bank)
    window = cfg.balance.prefetch_window_layers

    scale = full_layers / L
    rows = {
        "weights (fp32 master shard)": (layer_w, other_w),
        "gradients (fp32 shard)": (layer_w, other_w),
        "optimizer state (AdamW)": (None, opt_bytes),
        "replica banks": (banks, 0),
        "placement tables (micro-step 0, all layers)": (tables, 0),
        "stage plan (all micro-steps)": (plan_bytes, 0),
    }
    # optimizer state splits like the weights it mirrors
    opt_layer = opt_bytes * layer_w / max(layer_w + other_w, 1)
    rows["optimizer state (AdamW)"] = (opt_layer, opt_bytes - opt_layer)
    # held for backward / in flight during one micro-step: (after per layer, after once, before per layer, before once)
    held = {
        f"activations held for backward ({tokens} tokens, AC {ac_mode}; before: no AC)": (act_layer, act_once,
                                                                                          act_none, 0),
        "logits held for backward ([tokens, vocab])": (0, 0, 0, logits),
        "slot-weight copies held for backward": (0, 0, copies_before, 0),
        # before: every layer's send and receive buffers through the micro-step; after: the window's layers of the
        # next micro-step plus the current one's last window (``[balance] prefetch_window_layers``, 0: no bound),
        # send buffers only (received rows land in their bank slot)
        "prefetch send/recv buffers (next micro-step)": (
            0 if window else prefetch_after,
            prefetch_after / L * min(full_layers, 2 * window) if window else 0, prefetch, 0),
    }
    for name, (per_layer, once, _, _) in held.items():
        rows[name] = (per_layer, once)
    table = {name: {"measured_bytes": per_layer + once, f"bytes_at_{full_layers}_layers": per_layer * scale + once}
             for name, (per_layer, once) in rows.items()}
    for name, (_, _, before, before_once) in held.items():
        table[name][f"before_bytes_at_{full_layers}_layers"] = before * scale + before_once
    total = sum(r[f"bytes_at_{full_layers}_layers"] for r in table.values())
    total_before = sum(r.get(f"before_bytes_at_{full_layers}_layers", r[f"bytes_at_{full_layers}_layers"])
                       for r in table.values())
    rollout, training, recompute, nccl = peak_rows(cfg, resolved, model, args, pd, rank, ranks_per_node,
                                                   full_layers, table, per_token, act_once, tokens)
    sync_phase, colocated = colocated_phases(cfg, args, rollout, training, ranks_per_node, full_layers, recompute)
    peaks = {"rollout": sum(rollout.values()), "training": sum(training.values()),
             "recompute": sum(recompute.values()), "nccl": sum(c["bytes"] for c in nccl)}
    if sync_phase:
        peaks["weight_sync"] = sum(sync_phase.values())
    peaks["per_rank"] = max(peaks["rollout"], peaks["training"], peaks["recompute"],
                            peaks.get("weight_sync", 0)) + peaks["nccl"]
    import resource

    return {
        "rollout_peak": rollout, "training_peak": training, "recompute_peak": recompute,
        "nccl_communicators": nccl, "peaks": peaks,
        "weight_sync_peak": sync_phase, "colocated_engine": colocated,
        "config": config, "world_size": world_size, "rank": rank, "ep": resolved.ep, "dp_shard": resolved.dp_shard,
        "dp_replicate": resolved.dp_replicate, "efsdp": resolved.dp_shard // resolved.ep,
        "layers_built": L, "layers_full": full_layers, "activation_checkpoint": ac_mode, "micro_steps_planned": M,
        "expert_weight_bytes_built": expert_w, "table": table, f"total_bytes_at_{full_layers}_layers": total,
        f"total_before_bytes_at_{full_layers}_layers": total_before, "tokens_per_micro_step": tokens,
        "plan_ms_per_micro_step": plan_ms, "plan_ms_per_micro_step_full_depth": plan_ms_full, "start_stage_s": start_s, "build_model_s": t_model,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--n-layers", type=int, default=None)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-gib", type=float, default=BUDGET_GIB,
                    help="exit 1 when the per-rank peak (the largest of rollout, training and recompute, plus NCCL) exceeds it")
    args, overrides = ap.parse_known_args(argv)
    res = dry_run(args.config, args.world_size, args.rank, args.n_layers, overrides, args.ranks_per_node)
    full = res["layers_full"]
    print(f"dry run: rank {res['rank']} of {res['world_size']} (EP {res['ep']}, efsdp {res['efsdp']}, "
          f"dp_replicate {res['dp_replicate']}), {res['layers_built']} of {full} layers built, "
          f"peak RSS {res['peak_rss_gib']:.2f} GiB")
    print(f"| per rank | built ({res['layers_built']} layers) | at {full} layers: before (bb06e40) | after |")
    print("|---|---|---|---|")
    for name, r in res["table"].items():
        after = r[f"bytes_at_{full}_layers"]
        before = r.get(f"before_bytes_at_{full}_layers", after)
        print(f"| {name} | {r['measured_bytes'] / GiB:.3f} GiB | {before / GiB:.3f} GiB | {after / GiB:.3f} GiB |")
    print(f"| **total** | | **{res[f'total_before_bytes_at_{full}_layers'] / GiB:.2f} GiB** | "
          f"**{res[f'total_bytes_at_{full}_layers'] / GiB:.2f} GiB** |")
    if res["plan_ms_per_micro_step"] is not None:
        print(f"plan {res['plan_ms_per_micro_step']:.2f} ms / micro-step ({res['layers_built']} layers, "
              f"EP group of {res['ep']}), {res['plan_ms_per_micro_step_full_depth']:.1f} ms at {full} layers; start_stage (tables + micro-step 0 transfers) {res['start_stage_s']:.2f} s")
    for title, rows in (("rollout peak (end of decoding)", res["rollout_peak"]),
                        ("training peak (an update micro-step's backward)", res["training_peak"]),
                        ("recompute peak (one no-grad forward of [rl] recompute_merge micro-steps)",
                         res["recompute_peak"])):
        print(f"| {title}, per rank at {full} layers | |\n|---|---|")
        for name, b in rows.items():
            print(f"| {name} | {b / GiB:.3f} GiB |")
        print(f"| **sum** | **{sum(rows.values()) / GiB:.2f} GiB** |")
    print(f"| NCCL communicator (NCCL defaults, upper estimate) | ranks | nodes | collective | all-to-all |\n"
          "|---|---|---|---|---|")
    for c in res["nccl_communicators"]:
        print(f"| {c['name']} | {c['n_ranks']} | {c['n_nodes']} | {c['collective'] / GiB:.3f} GiB | "
              f"{c['all_to_all'] / GiB:.3f} GiB |")
    pk = res["peaks"]
    print(f"| **sum** | | | **{pk['nccl'] / GiB:.2f} GiB** | |")
    colo = res["colocated_engine"]
    if colo:
        print(f"| weight sync peak (colocated engine: weights awake, KV cache asleep), per rank | |\n|---|---|")
        for name, b in res["weight_sync_peak"].items():
            print(f"| {name} | {b / GiB:.3f} GiB |")
        print(f"| **sum** | **{pk['weight_sync'] / GiB:.2f} GiB** |")
        print(f"colocated engine per rank: rollout (engine awake) {pk['rollout'] / GiB:.2f} GiB, weight sync "
              f"{pk['weight_sync'] / GiB:.2f} GiB, training (engine asleep, sleep_level {colo['sleep_level']}) "
              f"{pk['training'] / GiB:.2f} GiB, + NCCL {pk['nccl'] / GiB:.2f} GiB")
        what = "the engines' weights offloaded" if colo["sleep_level"] == 1 else "nothing offloaded"
        print(f"sleep_level {colo['sleep_level']} host memory per node: {colo['host_bytes_per_node'] / GiB:.2f} GiB "
              f"pinned ({what})")
    sync = next((v for k, v in res["rollout_peak"].items() if k.startswith("weight sync (")), None)
    if sync is not None:
        print(f"weight sync: peak {sync / GiB:.2f} GiB beyond the model on its busiest rank (sync_cost, in the "
              "rollout peak)")
    fits = pk["per_rank"] <= args.budget_gib * GiB
    print(f"per-rank peak: max(rollout {pk['rollout'] / GiB:.2f}, training {pk['training'] / GiB:.2f}, "
          f"recompute {pk['recompute'] / GiB:.2f}"
          + (f", weight sync {pk['weight_sync'] / GiB:.2f}" if "weight_sync" in pk else "") + ") + NCCL "
          f"{pk['nccl'] / GiB:.2f} = {pk['per_rank'] / GiB:.2f} GiB of an 80 GB H100's {H100_BYTES / GiB:.2f} GiB; "
          f"{'within' if fits else 'OVER'} the {args.budget_gib:g} GiB target")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if fits else 1


if __name__ == "__main__":
    from titan_foremoe.config.loader import one_line_errors

    sys.exit(one_line_errors(main, sys.argv[1:]))
