"""One weight sync's cost per rank at a config's model and a cluster size (``rollouts/engines/sync_cost.py``).

    python benchmarks/weight_sync_cost.py --config train_configs/qwen3_30b_a3b_hf_vllm.toml --world-size 16 \
        --rollout-gpus 48 --json /tmp/sync.json

Prints and writes, per design (``--design``: one of ``reload``, ``current``, ``bucketed``; default all three),
the busiest trainer rank's bytes sent and received, collectives, peak extra memory and ``sync_s`` on the H100
links the simulator uses (``--calibration``). ``--rollout-gpus 0``: the engines are colocated on the trainer's
GPUs. The engine (vLLM or SGLang) and the bucket size come from the config (``[rollout_engine]`` /
``[sglang_engine]`` ``weight_sync_bucket_mb``); the model from the config's HF folder if it is here, else from its
name (``--model`` overrides). ``--senders S`` (default: the config's ``[sglang_engine] weight_sync_senders`` for
SGLang, 1 for vLLM, whose transfer group takes one sender): with S > 1 the bucketed design is printed twice, from
one source (the single-sender row) and from S sender groups (SGLang's named groups).

    python benchmarks/weight_sync_cost.py --config train_configs/qwen3_30b_a3b_hf_vllm.toml --world-size 16 \
        --engines 1,2,6 --engine-gpus 8

``--engines K[,K...]``: the fleet (``rollouts/fleet/layout.py``, engines of ``--engine-gpus`` on GPUs of their
own, sources dealt over the trainer's nodes) synced at once, per design of ``sync_cost.FLEET_DESIGNS`` (one
transfer group of every engine's workers, one gather per node forwarded to per-engine groups, per-engine groups):
sync_s, the busiest trainer NIC's bytes out and in and an engine node's NIC in (as shares of M / 8), and what a
failed engine breaks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from titan_foremoe.config.loader import load_config  # noqa: E402
from titan_foremoe.rollouts.engines.sync_cost import (  # noqa: E402
    DESIGNS, FAILURE_ISOLATION, FLEET_DESIGNS, LOADS, FleetSync, SyncLinks, SyncSetting, expert_tensor_count,
    fleet_sync_cost, hf_entry_bytes, hf_tensor_bytes, sync_cost)
from titan_foremoe.rollouts.fleet.layout import engine_layout  # noqa: E402
from titan_foremoe.simulator.calibration import load_calibration  # noqa: E402
from titan_foremoe.simulator.simulate import device_costs  # noqa: E402
from titan_foremoe.simulator.models import MODELS, ModelSpec  # noqa: E402

CALIBRATION = os.path.join(os.path.dirname(__file__), "..", "calibrations", "h100_measured.json")


def model_of(cfg, name: str | None) -> ModelSpec:
    """The config's model as a simulator spec: ``name``, its HF ``config.json``, or the folder's / flavor's name."""
    if name:
        return MODELS[name]
    folder = cfg.model.hf_assets_path
    path = os.path.join(folder, "config.json")
    if folder and os.path.isfile(path):
        c = json.load(open(path))
        return ModelSpec(os.path.basename(folder.rstrip("/")), dim=c["hidden_size"],
                         moe_hidden=c["moe_intermediate_size"], num_experts=c["num_experts"],
                         top_k=c["num_experts_per_tok"], moe_layers=c["num_hidden_layers"], vocab=c["vocab_size"],
                         n_heads=c["num_attention_heads"], n_kv_heads=c["num_key_value_heads"],
                         head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    key = os.path.basename(folder.rstrip("/")).lower().replace("-", "_") if folder else cfg.model.flavor
    for known in MODELS:
        if known in key:
            return MODELS[known]
    raise SystemExit(f"{cfg.job.name}: no model shape for {folder or cfg.model.flavor!r}: pass --model "
                     f"({', '.join(sorted(MODELS))})")


def fleet_rows(a, cfg, spec, sizes, links, counts: list[int], bucket_mb: int, load: str) -> int:
    """The fleet's sync per engine count and design (``--engines``)."""
    g = a.engine_gpus or a.gpus_per_node
    M = float(sizes.sum())
    rows = []
    for K in counts:
        lay = engine_layout(trainer_gpus=a.world_size, gpus_per_node=a.gpus_per_node, engines=K, gpus_per_engine=g,
                            colocated=False)
        for design in FLEET_DESIGNS:
            f = FleetSync.of(lay, design, bucket_bytes=bucket_mb << 20, state_entries=12 * spec.num_layers + 3,
                             expert_tensors=expert_tensor_count(spec), load=load)
            r = fleet_sync_cost(sizes, f, links)
            rows.append({**r, "trainer_gpus": a.world_size, "engine_gpus": g, "sources": list(f.sources)})
            print(f"{spec.name} {a.world_size} trainer + {K} x {g} engine GPUs {design:12s} sync_s {r['sync_s']:.3f}  "
                  f"trainer NIC out {r['nic_out_bytes'] / (M / 8):.2f} x M/8, in {r['nic_in_bytes'] / (M / 8):.2f}; "
                  f"engine NIC in {r['engine_nic_bytes'] / (M / 8):.2f}; gathers {r['gathers']}, rings per node "
                  f"{r['rings_per_node']}; engine load {load}")
    for design in FLEET_DESIGNS:
        t = [r["sync_s"] for r in rows if r["design"] == design]
        print(f"{design}: sync {min(t):.3f}-{max(t):.3f} s over {counts} engines ({max(t) / min(t) - 1:+.1%}); a failed "
              f"engine: {FAILURE_ISOLATION[design]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": spec.name, "model_bytes": M, "links": vars(links), "rows": rows}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--world-size", type=int, required=True, help="trainer GPUs")
    ap.add_argument("--rollout-gpus", type=int, default=0, help="engine GPUs of their own (0: colocated)")
    ap.add_argument("--engine-gpus", type=int, default=0,
                    help="GPUs per engine (0: all the rollout GPUs, one server as the runtime drives; colocated: "
                         "one node)")
    ap.add_argument("--senders", type=int, default=0,
                    help="sender groups (0: the config's: [sglang_engine] weight_sync_senders, vLLM 1)")
    ap.add_argument("--engine-load", choices=LOADS, default=None,
                    help="the engine's load of each sync (sync_cost.engine_load_s; default the config's: stacked "
                         "with vLLM's [rollout_engine] fused_expert_load, else per_tensor)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--design", choices=DESIGNS, default=None, help="one design (default: all)")
    ap.add_argument("--model", choices=sorted(MODELS), default=None)
    ap.add_argument("--calibration", default=CALIBRATION)
    ap.add_argument("--engines", default="",
                    help="comma list of engine counts: the fleet's sync per design (sync_cost.fleet_sync_cost)")
    ap.add_argument("--json", default="", help="write the rows here")
    a = ap.parse_args(argv)
    if a.senders < 0:
        ap.error(f"--senders must be >= 0, got {a.senders}")
    try:
        counts = [int(x) for x in a.engines.split(",") if x]
    except ValueError:
        ap.error(f"--engines {a.engines!r}: a comma list of engine counts")
    if any(k < 1 for k in counts):
        ap.error(f"--engines {a.engines!r}: counts must be >= 1")
    cfg = load_config(a.config)
    sglang = cfg.rl.rollout_source == "sglang"
    eng = cfg.sglang_engine if sglang else cfg.rollout_engine
    senders = a.senders or (cfg.sglang_engine.weight_sync_senders if sglang else 1)
    load = a.engine_load or ("stacked" if not sglang and getattr(eng, "fused_expert_load", False) else "per_tensor")
    spec = model_of(cfg, a.model)
    dtype_bytes = 2 if eng.dtype == "bfloat16" else 4
    sizes = hf_tensor_bytes(spec, dtype_bytes)
    links = SyncLinks.of(device_costs(load_calibration(a.calibration)))
    g = a.engine_gpus or a.rollout_gpus or a.gpus_per_node
    if counts:
        return fleet_rows(a, cfg, spec, sizes, links, counts, eng.weight_sync_bucket_mb, load)
    rows = []
    runs = [(d, 1) for d in ([a.design] if a.design else DESIGNS)]
    if senders > 1 and a.rollout_gpus and (a.design or "bucketed") == "bucketed":
        runs.append(("bucketed", senders))
    for design, S in runs:
        s = SyncSetting(design, a.world_size, a.rollout_gpus, g, a.gpus_per_node,
                        bucket_bytes=eng.weight_sync_bucket_mb << 20,
                        api="sglang" if sglang or S > 1 else "vllm",
                        state_entries=12 * spec.num_layers + 3, senders=S, expert_tensors=expert_tensor_count(spec),
                        load="per_tensor" if sglang or S > 1 else load)
        r = sync_cost(sizes, s, links, hf_entry_bytes(spec, dtype_bytes))
        rows.append(r)
        where = f"colocated on {a.world_size}" if not a.rollout_gpus else f"{a.world_size} + {a.rollout_gpus}"
        name = design if S == 1 else f"{design} x{S}"
        print(f"{spec.name} {name:12s} {where} GPUs: sync_s {r['sync_s']:.3f}  sent/rank "
              f"{r['bytes_sent_per_rank'] / 1e9:.2f} GB  received/rank {r['bytes_received_per_rank'] / 1e9:.2f} GB "
              f"(IB {r['bytes_received_ib_per_rank'] / 1e9:.2f})  collectives {r['collectives_per_rank']}  "
              f"peak extra {r['peak_extra_bytes_per_rank'] / 1e9:.2f} GB  buckets {r['buckets']}  "
              f"engine load {r['setting']['load']}")
    out = {"model": spec.name, "model_bytes": float(sizes.sum()), "hf_tensors": len(sizes),
           "world_size": a.world_size, "rollout_gpus": a.rollout_gpus, "engine_gpus": g,
           "engine": "sglang" if sglang else "vllm", "links": vars(links), "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
