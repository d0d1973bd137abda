"""Weight bytes the slot GEMM copies per call: the gather path vs reading the owned slots in place.

One expert matrix (w1's ``[K + B, F, D]``) on one rank: ``slot_grouped_mm`` forward and backward, every aten
op under a ``TorchDispatchMode`` and the bytes of each non-GEMM op's 3-D outputs (weight-shaped: gathers,
``cat``, zeroed gradients, ``index_add``) counted per phase; 2-D outputs (activation-sized) apart. On the
``meta`` device (default) the real size costs no memory and no time.

    python benchmarks/slot_gemm_bytes.py                       # Qwen3-30B-A3B, EP 8: K 16 + 2 spare, bf16
    python benchmarks/slot_gemm_bytes.py --device cpu --scale 8  # the same scaled down 8x (F, D), run on CPU
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_foremoe.models.slot_gemm import InPlaceSplit, SlotWeights, slot_grouped_mm
from titan_foremoe.placement.tables import slot_split

MB = 1e6
_GEMM = {torch.ops.aten._grouped_mm.default}


class CopyBytes(TorchDispatchMode):
    """Bytes written by every op but the grouped GEMMs and views, by shape (3-D: weight-shaped, 2-D:
    activation-sized): an op's new outputs, or for an in-place op (``copy_``, ``index_add_``) its source."""

    def __init__(self):
        super().__init__()
        self.weights = self.activations = 0

    def _count(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if t.dim() == 3:
            self.weights += n
        elif t.dim() == 2:
            self.activations += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _GEMM:
            return out
        if func._schema.name.endswith("_"):  # in place: what it writes is its (floating) source
            srcs = [a for a in args[1:] if isinstance(a, torch.Tensor) and a.is_floating_point()]
            for t in srcs[-1:]:
                self._count(t)
            return out
        if any(r.alias_info is not None for r in func._schema.returns):  # a view: nothing written
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


def slot_gemm_bytes(K: int, spare: int, F: int, D: int, rows: int, in_place: bool, dtype=torch.bfloat16,
                    device: str = "meta", replica_share: float = 0.25) -> dict:
    """Per-phase copied bytes of one ``slot_grouped_mm`` call over K owned + ``spare`` replica slots (all
    in the bank) with an even load, ``replica_share`` of the rows on the replicas."""
    C = K + spare
    counts_C = np.zeros(C, dtype=np.int64)
    moved = int(rows * replica_share) if spare else 0
    counts_C[:K] = (rows - moved) // K
    counts_C[0] += rows - moved - counts_C[:K].sum()
    if spare:
        counts_C[K:] = moved // spare
        counts_C[K] += moved - counts_C[K:].sum()
    src_C = np.concatenate([np.arange(K), K + np.arange(spare)])
    owned = torch.empty(K, F, D, dtype=dtype, device=device).requires_grad_(True)
    bank = torch.empty(spare, F, D, dtype=dtype, device=device).requires_grad_(True)
    x = torch.empty(rows, D, dtype=dtype, device=device).requires_grad_(True)
    offsets = torch.as_tensor(np.cumsum(counts_C), dtype=torch.int32, device=device)
    s = slot_split(src_C, counts_C[None], K) if in_place else None
    split = None if s is None else InPlaceSplit(s.owned_rows, s.spare_rows,
                                                torch.as_tensor(s.spare_source_J, device=device))
    w = SlotWeights(owned, bank, torch.as_tensor(src_C, device=device), split)
    fwd, bwd = CopyBytes(), CopyBytes()
    with fwd:
        y = slot_grouped_mm(x, w, offsets)
    g = torch.empty_like(y)
    with bwd:
        y.backward(g)
    return {"forward": fwd.weights, "backward": bwd.weights, "activations": fwd.activations + bwd.activations,
            "matrix_bytes": F * D * owned.element_size()}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--spare", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--expert-ffn", type=int, default=768)
    ap.add_argument("--rows", type=int, default=2 * 8192 * 8, help="expert rows on the rank")
    ap.add_argument("--scale", type=int, default=1, help="divide F, D and rows by this")
    ap.add_argument("--replica-share", type=float, default=0.25, help="share of the rows on the spare slots")
    ap.add_argument("--device", default="meta")
    a = ap.parse_args(argv)
    K, F, D, rows = a.experts // a.ep, a.expert_ffn // a.scale, a.hidden // a.scale, a.rows // a.scale
    print(f"one matrix [{F} x {D}] bf16 over K={K} owned + {a.spare} spare slots, {rows} rows "
          f"({a.replica_share:.0%} on the spare slots), {a.device}: bytes copied per call")
    print("| path | weight-shaped, forward | weight-shaped, backward | activation-sized, both |")
    print("|---|---|---|---|")
    res = {}
    for name, in_place in (("gather", False), ("in place", True)):
        r = res[name] = slot_gemm_bytes(K, a.spare, F, D, rows, in_place, device=a.device,
                                        replica_share=a.replica_share)
        print(f"| {name} | {r['forward'] / MB:.1f} MB | {r['backward'] / MB:.1f} MB | {r['activations'] / MB:.1f} MB |")
    before, after = (sum(res[n][k] for k in ("forward", "backward", "activations")) for n in ("gather", "in place"))
    print(f"all copies, one matrix's forward + backward: {before / MB:.0f} MB -> {after / MB:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
