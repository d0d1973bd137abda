"""Bytes one MoE layer's expert compute saves for backward: torchtitan's path, ``static`` and ``foremoe``.

One rank with a fake plan (no process group): the transfer engine of ``titan_foremoe`` serves the slots
(``static``: K owned slots + ``spare`` empty ones; ``foremoe``: the spare slots hold replicas in the bank,
taking ``replica_share`` of the rows), the layer's grouped SwiGLU runs under
``torch.autograd.graph.saved_tensors_hooks`` and every saved tensor's storage is counted once. Storages are
split into the owned **parameters** (FSDP frees its unsharded copy after forward and gathers it again for
backward: not held), the **banks** (persistent replica buffers, allocated once per stage) and **held**:
everything else, i.e. what exists only because backward needs it (activations and hidden weight copies).
On the ``meta`` device (default) the real size costs no memory.

    python benchmarks/measure_saved_bytes.py                        # Qwen3-30B-A3B layer, EP 8, seq 8192 x 2
    PYTHONPATH=/tmp/base python benchmarks/measure_saved_bytes.py   # the same on another checkout (before)

Works on checkouts whose ``TransferEngine.slot_weights`` returns tensors (before) or ``SlotWeights`` (with the
in-place split of ``placement.tables.slot_split`` where the checkout has it).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

MB = 1e6


def saved_storages(fn):
    """Run ``fn()`` and return ``(out, {storage key: bytes})`` of every tensor autograd saved meanwhile."""
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s._cdata] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen


def _keys(tensors) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors}


def layer_saved_bytes(balancer: str, K: int, spare: int, F: int, D: int, rows: int, dtype=torch.bfloat16,
                      device: str = "meta", replica_share: float = 0.25, backward: bool = False) -> dict:
    """Saved-for-backward bytes of one layer's expert compute on one rank (see the module docstring)."""
    from titan_foremoe.models.moe import grouped_swiglu
    try:
        from titan_foremoe.placement.tables import slot_split
    except ImportError:  # a checkout before the in-place slot GEMM
        slot_split = None
    from titan_foremoe.transfer.engine import TransferEngine
    from titan_foremoe.transfer.schedule import Exchange, LayerTransfers

    g = torch.Generator().manual_seed(0)

    def param(*shape):
        w = torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype) if device != "meta" else \
            torch.empty(*shape, dtype=dtype, device=device)
        return w.requires_grad_(True)

    owned = (param(K, F, D), param(K, D, F), param(K, F, D))
    x = param(rows, D)
    C = K + spare
    counts = np.full(C if balancer != "off" else K, 0, dtype=np.int64)
    moved = int(rows * replica_share) if balancer == "foremoe" and spare else 0
    counts[:K] = (rows - moved) // K
    counts[0] += rows - moved - counts[:K].sum()
    if moved:
        counts[K:] = moved // spare
        counts[K] += moved - counts[K:].sum()
    counts_t = torch.as_tensor(counts, device=device)
    banks: set[int] = set()

    def run():
        if balancer == "off":
            return grouped_swiglu(x, *owned, counts_t, dtype)
        engine = TransferEngine(None, 0, 1, np.zeros(1, dtype=np.int64))
        lb = engine.banks(0, owned, spare, dtype)
        banks.update(_keys(lb.banks[0]))
        e = np.zeros(0, dtype=np.int64)
        # a self-return: each replica row's gradient goes back to owned row j (the one rank is its own owner)
        rep = np.arange(spare) if balancer == "foremoe" else e
        grad = Exchange(np.zeros(len(rep), np.int64), rep, np.zeros(len(rep), np.int64), rep % K)
        lt = LayerTransfers(Exchange(e, e, e, e), Exchange(e, e, e, e), grad, e, e, np.zeros(0, bool), False, False)
        src = np.concatenate([np.arange(K), K + np.arange(spare) if balancer == "foremoe" else -np.ones(spare, int)])
        # the runtime's in-place split where the checkout has one (older ones gather every slot)
        kw = {} if slot_split is None else {"split": slot_split(src, counts[None], K)}
        w = engine.slot_weights(0, owned, src, lt, 0, dtype, **kw)
        return grouped_swiglu(x, *w, counts_t, dtype)

    out, saved = saved_storages(run)
    params = _keys(owned)
    by = {"params": 0, "banks": 0, "held": 0}
    for key, n in saved.items():
        by["params" if key in params else "banks" if key in banks else "held"] += n
    if backward:
        out.float().square().sum().backward()
        by["grads"] = [w.grad.clone() for w in (*owned, x)]
    bank_row_bytes = 3 * F * D * torch.empty(0, dtype=dtype).element_size()
    return {**by, "replica_rows_bytes": spare * bank_row_bytes if balancer == "foremoe" else 0}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--spare", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--expert-ffn", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=2 * 8192, help="tokens per rank per micro-step")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    K = a.experts // a.ep
    rows = a.tokens * a.top_k  # expert rows on one rank when the load is even
    res = {b: layer_saved_bytes(b, K, a.spare, a.expert_ffn, a.hidden, rows) for b in ("off", "static", "foremoe")}
    print(f"saved for backward per MoE layer per rank (K={K} owned, {a.spare} spare, {rows} rows, bf16); "
          f"x{a.layers} layers in the last column")
    print("| path | held (activations + copies) | owned params | banks | held x layers |")
    print("|---|---|---|---|---|")
    for b, r in res.items():
        print(f"| {b} | {r['held'] / MB:.1f} MB | {r['params'] / MB:.1f} MB | {r['banks'] / MB:.1f} MB | "
              f"{r['held'] * a.layers / 1e9:.2f} GB |")
    f, s = res["foremoe"], res["static"]
    ok = f["held"] + f["params"] + f["banks"] <= s["held"] + s["params"] + s["banks"] + f["replica_rows_bytes"]
    print(f"foremoe <= static + its replica rows ({f['replica_rows_bytes'] / MB:.1f} MB): {ok}; "
          f"held beyond torchtitan's path: static {(s['held'] - res['off']['held']) / MB:.1f} MB, "
          f"foremoe {(f['held'] - res['off']['held']) / MB:.1f} MB per layer")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
