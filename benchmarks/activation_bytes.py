"""Activation bytes one transformer block saves for backward, per ``[activation_checkpoint]`` mode, at a flavor's
real width (how it is measured: ``titan_foremoe/models/activation_bytes.py``, which ``scripts/dry_run.py`` uses).

    python benchmarks/activation_bytes.py --flavor qwen3_30b_a3b --check
"""

from __future__ import annotations

import argparse
import sys

from titan_foremoe.models.activation_bytes import bytes_per_token, held_bytes, held_model_per_token, held_per_token


def main(argv: list[str]) -> int:
    from titan_foremoe.models.flavors import get_flavor

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="qwen3_30b_a3b")
    ap.add_argument("--tokens", type=int, default=2 * 4096, help="tokens per rank per micro-step")
    ap.add_argument("--mode", choices=["none", "full", "selective"], default=None,
                    help="[activation_checkpoint] mode (default: all three)")
    ap.add_argument("--check", action="store_true",
                    help="measure each mode's held bytes (MemTracker, 1 vs 2 blocks) next to the model")
    ap.add_argument("--peak-layers", type=int, default=0,
                    help="also: the measured peak of a forward + backward of this many blocks per mode")
    a = ap.parse_args(argv)
    args = get_flavor(a.flavor)
    per = bytes_per_token(args)
    L, T = args.n_layers, a.tokens
    print(f"{a.flavor}: {per / 1e3:.1f} kB saved per token per block (no AC)")
    sel = held_per_token(args, "selective") if (a.mode in (None, "selective") or a.check) else None
    for mode in [a.mode] if a.mode else ["none", "full", "selective"]:
        held, once = held_model_per_token(args, mode, per, per_token_selective=sel)
        line = (f"  AC {mode}: {held / 1e3:.1f} kB per token per block held, + {once / 1e3:.1f} kB per token "
                f"once (recompute); {T} tokens x {L} blocks = {(held * L + once) * T / 2**30:.2f} GiB "
                f"per micro-step per rank")
        if a.check:
            measured = sel if mode == "selective" else held_per_token(args, mode)
            line += f"; measured held {measured / 1e3:.1f} kB per token per block (MemTracker, 1 vs 2 blocks)"
        print(line)
        if a.peak_layers:
            peak = held_bytes(args, T, mode, a.peak_layers, backward=True)
            print(f"    measured peak, forward + backward, {a.peak_layers} blocks x {T} tokens: {peak / 2**20:.2f} MiB "
                  f"(model, activations only: {(held * a.peak_layers + once) * T / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
