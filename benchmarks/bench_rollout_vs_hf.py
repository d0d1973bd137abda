"""Rollout tokens/s of our embedded generator against transformers' ``generate``, same HF checkpoint, one process.

    python scripts/make_tiny_hf_checkpoint.py --out /tmp/tiny_qwen3_moe
    python benchmarks/bench_rollout_vs_hf.py --hf /tmp/tiny_qwen3_moe --batch 32 --new-tokens 32 --repeats 3

Both decode the same left-padded prompts greedily with a KV cache for exactly
``--new-tokens`` tokens (EOS ignored), fp32, on the CPU; our generator also
records every token's experts. Prints the best-of-repeats tokens/s of each and
their ratio (one run, one machine: the ratio is the figure to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import torchtitan_patches  # noqa: E402

torchtitan_patches.apply_all()


def load_ours(folder: str, expert_dtype: str = "float32") -> torch.nn.Module:
    """Our model on one process with the folder's weights (torchtitan's adapter, offline path)."""
    from safetensors.torch import load_file

    from titan_foremoe.models.build import build_model_config
    from titan_foremoe.models.hf import HFAdapter, model_args_from_hf, safetensors_files

    args = model_args_from_hf(folder)
    config = build_model_config(args, expert_dtype=expert_dtype)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # buffers (RoPE cache); weights are overwritten below
    hf_sd = {}
    for name in safetensors_files(folder):
        hf_sd.update(load_file(os.path.join(folder, name)))
    missing, unexpected = model.load_state_dict(HFAdapter(config, folder).from_hf(hf_sd), strict=False)
    params = dict(model.named_parameters())
    assert not unexpected and not [k for k in missing if k in params], (missing, unexpected)
    return model.eval()


def prompts_from(folder: str, batch: int) -> list[list[int]]:
    from titan_foremoe.data.hf_tokenizer import HFTokenizer
    from titan_foremoe.data.prompts import read_rows
    from titan_foremoe.data.tiny_hf import SYSTEM_PROMPT

    tok = HFTokenizer(folder)
    rows = read_rows(os.path.join(os.path.dirname(__file__), "..", "examples", "arithmetic_word_problems.jsonl"))
    return [tok.chat_prompt(r["prompt"], SYSTEM_PROMPT) for r in rows[:batch]], tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import Qwen3MoeForCausalLM

    from titan_foremoe.rollouts.generate import GenerationConfig, generate

    ours = load_ours(args.hf)
    ref = Qwen3MoeForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # no EOS on either side: both decode exactly --new-tokens
    prompts, tok = prompts_from(args.hf, args.batch)
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_id] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    n = args.batch * args.new_tokens

    def run_ours():
        r = generate(ours, prompts, GenerationConfig(max_new_tokens=args.new_tokens, temperature=0.0),
                     eos_id=[-1], pad_id=tok.pad_id, num_experts=ours.layers["0"].moe.router.num_experts,
                     generator=torch.Generator().manual_seed(0))
        return r.tokens_BT

    def run_hf():
        with torch.no_grad():
            return ref.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                                pad_token_id=tok.pad_id)

    times = {"ours": [], "transformers": []}
    for _ in range(args.repeats):
        for name, fn in (("ours", run_ours), ("transformers", run_hf)):
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
    # the same greedy tokens (a sanity check that both did the same work)
    ours_tokens, hf_tokens = run_ours(), run_hf()
    same = sum(ours_tokens[b, len(p): len(p) + args.new_tokens].tolist() == hf_tokens[b, P:].tolist()
               for b, p in enumerate(prompts))
    best = {k: min(v) for k, v in times.items()}
    result = {
        "batch": args.batch, "new_tokens": args.new_tokens, "threads": args.threads,
        "ours_tokens_per_s": n / best["ours"], "transformers_tokens_per_s": n / best["transformers"],
        "ratio_ours_over_transformers": best["transformers"] / best["ours"],
        "identical_greedy_rows": f"{same}/{args.batch}",
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
