"""Activation bytes one transformer block saves for backward, measured on a one-block model of the real width.

A model with the flavor's dimensions, one block and a 256-token vocabulary is built on CPU in the expert
compute dtype; one masked forward (all tokens real, routes replayed from the live router, as the RL update
runs) of ``tokens`` tokens runs with ``torch.autograd.graph.saved_tensors_hooks`` entered around the
block only, and every saved storage that is not a parameter is counted once. Two probe sizes give bytes
per token (the slope, so nothing fixed is scaled); SDPA is forced to its flash kernel, as on the GPU
(O(tokens) saved: output and log-sum-exp). Activation checkpointing is off in this project's RL jobs
(``parallelize.build_model`` passes ``ac_config=None``), so every block holds this from its forward to
its backward. The expert part assumes an even load (each token's k rows on the rank that runs them).

    python scripts/activation_bytes.py --flavor qwen3_30b_a3b
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch


def block_bytes(args, tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Saved-for-backward bytes of block 0 for one sequence of ``tokens`` tokens (parameters excluded)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from titan_foremoe.models.build import build_model_config
    from titan_foremoe.models.seams import routing

    small = dataclasses.replace(args, n_layers=1, vocab_size=256, max_seq_len=max(tokens, 16))
    cfg = build_model_config(small, expert_dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.to(dtype).train()
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params:
            seen[s._cdata] = s.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    block = model.layers["0"] if isinstance(model.layers, torch.nn.ModuleDict) else model.layers[0]
    block.register_forward_pre_hook(lambda *_: hooks.__enter__())
    block.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    inputs = torch.randint(0, 256, (1, tokens))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), routing(model, token_mask_BL=torch.ones(1, tokens, dtype=torch.bool)):
        model(inputs)
    return sum(seen.values())


def bytes_per_token(args, dtype: torch.dtype = torch.bfloat16, probes: tuple[int, int] = (64, 128)) -> float:
    """Slope of ``block_bytes`` between two probe sizes: one block's activation bytes per token."""
    a, b = (block_bytes(args, t, dtype) for t in probes)
    return (b - a) / (probes[1] - probes[0])


def main(argv: list[str]) -> int:
    from titan_foremoe.models.flavors import get_flavor

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="qwen3_30b_a3b")
    ap.add_argument("--tokens", type=int, default=2 * 4096, help="tokens per rank per micro-step")
    a = ap.parse_args(argv)
    args = get_flavor(a.flavor)
    per = bytes_per_token(args)
    print(f"{a.flavor}: {per / 1e3:.1f} kB per token per block; {a.tokens} tokens x {args.n_layers} blocks = "
          f"{per * a.tokens * args.n_layers / 2**30:.2f} GiB held for backward per micro-step per rank")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
