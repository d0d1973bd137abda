"""Weight bytes the slot GEMM copies per call: the gather path vs reading the owned slots in place.

One expert matrix (w1's ``[K + B, F, D]``) on one rank: ``slot_grouped_mm`` forward and backward, every aten
op under a ``TorchDispatchMode`` and the bytes of each non-GEMM op's 3-D outputs (weight-shaped: gathers,
``cat``, zeroed gradients, ``index_add``) counted per phase; 2-D outputs (activation-sized) apart. On the
``meta`` device (default) the real size costs no memory and no time.

``--layer``: one layer's whole SwiGLU (3 matrices), the gather path, the per-GEMM in-place path
(``slot_grouped_mm`` three times, each joining its spare rows' output by a copy) and the fused one
(``models/slot_swiglu.py``); only data movement counted (``copy_``, gathers, ``cat``, zero fills,
``index_add``), the elementwise math (silu, mul, add: the same work on every path) apart.

    python benchmarks/slot_gemm_bytes.py                       # Qwen3-30B-A3B, EP 8: K 16 + 2 spare, bf16
    python benchmarks/slot_gemm_bytes.py --device cpu --scale 8  # the same scaled down 8x (F, D), run on CPU
    python benchmarks/slot_gemm_bytes.py --layer               # per layer: gather, in place per GEMM, fused
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_foremoe.models.slot_gemm import InPlaceSplit, SlotWeights, slot_grouped_mm
from titan_foremoe.models.slot_swiglu import slot_swiglu
from titan_foremoe.placement.tables import slot_split

MB = 1e6
_GEMM = {torch.ops.aten._grouped_mm.default}
_MOVES = {"copy_", "cat", "index_select", "index_add_", "index_add", "clone", "_to_copy", "zeros", "zeros_like",
          "new_zeros", "zero_", "fill_"}  # data movement
_ALLOC = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided"}  # nothing written


class CopyBytes(TorchDispatchMode):
    """Bytes written by every op but the grouped GEMMs and views, by shape (3-D: weight-shaped, 2-D:
    activation-sized): an op's new outputs, or for an in-place op (``copy_``, ``index_add_``) its source."""

    def __init__(self, moves_only: bool = False):
        super().__init__()
        self.moves_only = moves_only  # count data movement only (``_MOVES``); the rest in ``math``
        self.weights = self.activations = self.math = 0

    def _count(self, t: torch.Tensor, name: str) -> None:
        n = t.numel() * t.element_size()
        if self.moves_only and name.split("::")[-1] not in _MOVES:
            self.math += n
        elif t.dim() == 3:
            self.weights += n
        elif t.dim() == 2:
            self.activations += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if func in _GEMM or name.split("::")[-1] in _ALLOC:
            return out
        if func._overloadname.startswith("out"):  # ``out=``: writes its out tensor
            self._count(kwargs["out"], name)
            return out
        if name.endswith("_"):  # in place: what it writes is its (floating) source
            srcs = [a for a in args[1:] if isinstance(a, torch.Tensor) and a.is_floating_point()]
            for t in srcs[-1:]:
                self._count(t, name)
            return out
        if any(r.alias_info is not None for r in func._schema.returns):  # a view: nothing written
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._count(t, name)
        return out


def _slots(K: int, spare: int, rows: int, replica_share: float) -> tuple[np.ndarray, np.ndarray]:
    """Even load, ``replica_share`` of the rows on the spare slots (all in the bank): (counts_C, src_C)."""
    C = K + spare
    counts_C = np.zeros(C, dtype=np.int64)
    moved = int(rows * replica_share) if spare else 0
    counts_C[:K] = (rows - moved) // K
    counts_C[0] += rows - moved - counts_C[:K].sum()
    if spare:
        counts_C[K:] = moved // spare
        counts_C[K] += moved - counts_C[K:].sum()
    return counts_C, np.concatenate([np.arange(K), K + np.arange(spare)])


def _split(src_C, counts_C, K: int, device) -> InPlaceSplit | None:
    s = slot_split(src_C, counts_C[None], K)
    return None if s is None else InPlaceSplit(s.owned_rows, s.spare_rows,
                                               torch.as_tensor(s.spare_source_J, device=device))


def slot_gemm_bytes(K: int, spare: int, F: int, D: int, rows: int, in_place: bool, dtype=torch.bfloat16,
                    device: str = "meta", replica_share: float = 0.25) -> dict:
    """Per-phase copied bytes of one ``slot_grouped_mm`` call over K owned + ``spare`` replica slots (all
    in the bank) with an even load, ``replica_share`` of the rows on the replicas."""
    counts_C, src_C = _slots(K, spare, rows, replica_share)
    owned = torch.empty(K, F, D, dtype=dtype, device=device).requires_grad_(True)
    bank = torch.empty(spare, F, D, dtype=dtype, device=device).requires_grad_(True)
    x = torch.empty(rows, D, dtype=dtype, device=device).requires_grad_(True)
    offsets = torch.as_tensor(np.cumsum(counts_C), dtype=torch.int32, device=device)
    split = _split(src_C, counts_C, K, device) if in_place else None
    w = SlotWeights(owned, bank, torch.as_tensor(src_C, device=device), split)
    fwd, bwd = CopyBytes(), CopyBytes()
    with fwd:
        y = slot_grouped_mm(x, w, offsets)
    g = torch.empty_like(y)
    with bwd:
        y.backward(g)
    return {"forward": fwd.weights, "backward": bwd.weights, "activations": fwd.activations + bwd.activations,
            "matrix_bytes": F * D * owned.element_size()}


LAYER_PATHS = ("gather", "in place, per GEMM", "in place, fused")


def swiglu_bytes(K: int, spare: int, F: int, D: int, rows: int, path: str, dtype=torch.bfloat16,
                 device: str = "meta", replica_share: float = 0.25) -> dict:
    """Data-movement bytes of one layer's slot SwiGLU (w1, w3, w2), forward and backward, on one of
    ``LAYER_PATHS``; ``math``: the elementwise ops' written bytes (not copies)."""
    if path not in LAYER_PATHS:
        raise ValueError(f"swiglu_bytes: path {path!r}, expected one of {LAYER_PATHS}")
    counts_C, src_C = _slots(K, spare, rows, replica_share)
    offsets = torch.as_tensor(np.cumsum(counts_C), dtype=torch.int32, device=device)
    split = None if path == "gather" else _split(src_C, counts_C, K, device)
    index = torch.as_tensor(src_C, device=device)
    shapes = ((F, D), (D, F), (F, D))  # w1, w2, w3
    w = [SlotWeights(torch.empty(K, *s, dtype=dtype, device=device).requires_grad_(True),
                     torch.empty(spare, *s, dtype=dtype, device=device).requires_grad_(True), index, split)
         for s in shapes]
    x = torch.empty(rows, D, dtype=dtype, device=device).requires_grad_(True)
    fwd, bwd = CopyBytes(moves_only=True), CopyBytes(moves_only=True)
    with fwd:
        if path == "in place, fused":
            y = slot_swiglu(x, *w, offsets)
        else:  # grouped_swiglu before the fused function: three slot GEMMs, torch's silu * mul between
            h = torch.nn.functional.silu(slot_grouped_mm(x, w[0], offsets)) * slot_grouped_mm(x, w[2], offsets)
            y = slot_grouped_mm(h, w[1], offsets)
    g = torch.empty_like(y)
    with bwd:
        y.backward(g)
    return {"forward": fwd.weights + fwd.activations, "backward": bwd.weights + bwd.activations,
            "weights": fwd.weights + bwd.weights, "activations": fwd.activations + bwd.activations,
            "math": fwd.math + bwd.math}


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
    ap.add_argument("--layer", action="store_true", help="one layer's whole SwiGLU: gather, per GEMM, fused")
    a = ap.parse_args(argv)
    K, F, D, rows = a.experts // a.ep, a.expert_ffn // a.scale, a.hidden // a.scale, a.rows // a.scale
    if a.layer:
        return _layer(a, K, F, D, rows)
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


def _layer(a, K: int, F: int, D: int, rows: int) -> int:
    print(f"one layer's SwiGLU (w1, w3 [{F} x {D}], w2 [{D} x {F}]) bf16 over K={K} owned + {a.spare} spare "
          f"slots, {rows} rows ({a.replica_share:.0%} on the spare slots), {a.device}: bytes moved per "
          f"micro-step (forward + backward)")
    print("| path | forward | backward | weight-shaped | activation-sized | total | elementwise math (not copies) |")
    print("|---|---|---|---|---|---|---|")
    for path in LAYER_PATHS:
        r = swiglu_bytes(K, a.spare, F, D, rows, path, device=a.device, replica_share=a.replica_share)
        print(f"| {path} | {r['forward'] / MB:.1f} MB | {r['backward'] / MB:.1f} MB | {r['weights'] / MB:.1f} MB | "
              f"{r['activations'] / MB:.1f} MB | {(r['forward'] + r['backward']) / MB:.0f} MB | "
              f"{r['math'] / MB:.0f} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
