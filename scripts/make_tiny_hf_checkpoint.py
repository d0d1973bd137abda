"""Make a tiny random Hugging Face Qwen3-MoE folder (model + tokenizer trained on the example data).

    python scripts/make_tiny_hf_checkpoint.py --out /tmp/tiny_qwen3_moe

The folder has a real checkpoint's layout (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a chat template, generation_config.json)
and loads in transformers; ``train_configs/qwen3_moe_hf_grpo.toml`` trains from it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "examples",
                                                   "arithmetic_word_problems.jsonl"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-hidden-dim", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=16, help="vLLM's CPU attention needs 32, 64, 80, ...")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    make_tiny_checkpoint(args.out, read_texts(args.data), n_layers=args.layers, dim=args.dim,
                         num_experts=args.experts, top_k=args.top_k, moe_hidden_dim=args.moe_hidden_dim, head_dim=args.head_dim,
                         seed=args.seed)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
