"""What travels per RL step to give a vLLM engine the policy's weights (docs/rollouts_vllm.md).

    python benchmarks/vllm_sync_bytes.py --flavor qwen3_30b_a3b --ranks 64 --engines 8

Counts the parameters of a named flavor (``titan_foremoe/models/flavors.py``) and prints, in the engine dtype:
the HF folder written per step (by disk: each trainer rank writes its 1/R slice, each engine replica reads the
whole folder from shared storage) and the bytes a NCCL broadcast moves (verl / slime: bucketed broadcast from
the trainer to every engine replica), with times at the given bandwidths.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from titan_foremoe.models.flavors import FLAVORS  # noqa: E402


def param_count(a) -> int:
    attn = a.dim * a.n_heads * a.head_dim * 2 + a.dim * a.n_kv_heads * a.head_dim * 2 + 2 * a.head_dim
    moe = a.num_experts * 3 * a.dim * a.moe_hidden_dim + a.num_experts * a.dim
    return a.n_layers * (attn + moe + 2 * a.dim) + 2 * a.vocab_size * a.dim + a.dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="qwen3_30b_a3b", choices=sorted(FLAVORS))
    ap.add_argument("--ranks", type=int, default=64, help="trainer ranks (each writes its slice)")
    ap.add_argument("--engines", type=int, default=8, help="engine replicas that each need the whole model")
    ap.add_argument("--bytes-per-param", type=int, default=2, help="2: bf16 (the engine dtype)")
    ap.add_argument("--disk-gbps", type=float, default=5.0, help="GB/s of the shared file system per reader")
    ap.add_argument("--net-gbps", type=float, default=50.0, help="GB/s of one broadcast (400 Gb/s IB: 50)")
    args = ap.parse_args()
    n = param_count(FLAVORS[args.flavor])
    total = n * args.bytes_per_param / 1e9
    print(f"{args.flavor}: {n / 1e9:.2f} B parameters, {total:.1f} GB per copy at {args.bytes_per_param} B/param")
    print(f"disk: written {total:.1f} GB per step ({total / args.ranks:.2f} GB per trainer rank at R = {args.ranks}), "
          f"read {total * args.engines:.1f} GB ({args.engines} replicas x {total:.1f} GB; "
          f"{total / args.disk_gbps:.1f} s per replica at {args.disk_gbps:g} GB/s)")
    print(f"NCCL broadcast: {total:.1f} GB into each of {args.engines} replicas (one broadcast group reaches all: "
          f"{total / args.net_gbps:.2f} s at {args.net_gbps:g} GB/s), nothing on disk")


if __name__ == "__main__":
    main()
