"""Bytes the transfer engine copies per micro-step on one rank: do replica rows land in their bank slot?

One rank of a ``foremoe`` stage plan (synthetic loads, Qwen3-30B-A3B shape by default) runs the transfer engine's
``prefetch`` + ``wait`` for every (micro-step, layer) as the placement runtime does, with a fake all-to-all (no
process group: the collective's own bytes are the wire's, not a copy) and a dispatch mode (``CopyCounter``) that
counts every aten op copying data (``copy_``, ``index_copy_``, ``index_put_``, ``index_select``, ``cat``,
``_to_copy``, ...) and where it writes. Reported per micro-step per rank: bytes received by the all-to-alls,
bytes copied INTO the banks (a second copy of received rows, and kept replicas), other copied bytes (send-side
packing and temporaries), and whether every all-to-all's output buffer lies inside a bank. On the ``meta``
device (default) the real sizes cost no memory or time.

    python benchmarks/measure_bank_copies.py                         # EP 8, after
    python benchmarks/measure_bank_copies.py --ep 64                 # EP 64 (2 owned experts per rank)
    PYTHONPATH=/tmp/base python benchmarks/measure_bank_copies.py    # the same on another checkout (before)

Works on checkouts before and after "replica rows land directly in their bank slot" (uses ``compile_stage``,
``TransferEngine.prefetch`` / ``wait`` / ``banks`` only).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that copy data: name -> (index of the tensor written in place or None (a new output), index of the
# source whose elements are copied or None (the output's))
COPY_OPS = {
    "copy_": (0, 1), "index_copy_": (0, 3), "index_copy": (None, 3), "index_put_": (0, 2), "index_put": (None, 2),
    "index_select": (None, None), "cat": (None, None), "_to_copy": (None, None), "clone": (None, None),
    "index": (None, None), "gather": (None, None), "take": (None, None), "stack": (None, None),
    "narrow_copy": (None, None), "masked_scatter_": (0, 2), "scatter_": (0, 3), "index_add_": (0, 3),
}


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def inside(t: torch.Tensor, storage_of: torch.Tensor) -> bool:
    """Whether ``t``'s bytes lie inside the storage of ``storage_of`` (data_ptr ranges; CPU/CUDA tensors)."""
    s = storage_of.untyped_storage()
    start = t.data_ptr()
    return s.data_ptr() <= start and start + t.numel() * t.element_size() <= s.data_ptr() + s.nbytes()


class CopyCounter(TorchDispatchMode):
    """Records ``(op, bytes written, destination tensor)`` for every aten op copying floating-point data run inside
    it (weights; index tables are not counted); the destination is the tensor written in place (or ``out=``), else
    the op's new output. Also every c10d all-to-all's output buffer."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, int, torch.Tensor]] = []
        self.all_to_all_outputs: list[torch.Tensor] = []  # output buffers of c10d all-to-alls (real groups)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.namespace == "c10d" and name.startswith("alltoall_base"):
            self.all_to_all_outputs.append(args[0])
        elif name in COPY_OPS:
            dst_i, src_i = COPY_OPS[name]
            dst = kwargs.get("out", args[dst_i] if dst_i is not None else out)
            if isinstance(dst, (tuple, list)):
                dst = dst[0]
            src = args[src_i] if src_i is not None and len(args) > src_i else dst
            if dst.is_floating_point():  # weights and gradients, not index uploads (uint8/int64 tables)
                self.records.append((name, src.numel() * dst.element_size(), dst))
        return out

    def bytes_into(self, keys: set[int]) -> int:
        return sum(n for _, n, d in self.records if storage_key(d) in keys)

    def bytes_total(self) -> int:
        return sum(n for _, n, _ in self.records)


class _Work:
    def wait(self):
        return True


def fake_all_to_all(log: list):
    """``dist.all_to_all_single`` standing in for the wire: records its output tensor, moves nothing."""
    def run(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        log.append(output)
        return _Work() if async_op else None
    return run


def measure(model: str, ep: int, micro_steps: int, micro_steps_per_step: int, spare: int, rank: int,
            ranks_per_node: int, device: str, dtype=torch.bfloat16, seed: int = 0) -> dict:
    import torch.distributed as dist

    from titan_foremoe.placement.tables import compile_stage
    from titan_foremoe.planner import PlannerConfig, Topology, plan_stage
    from titan_foremoe.planner.synthetic import MODEL_SHAPES, synthetic_loads
    from titan_foremoe.transfer.engine import TransferEngine

    shape = MODEL_SHAPES[model]
    E, L, F, D = shape.num_experts, shape.num_layers, shape.moe_hidden_dim, shape.dim
    if E % ep:
        raise SystemExit(f"{E} experts do not divide over EP {ep}")
    K, P = E // ep, min(ranks_per_node, ep)
    loads = synthetic_loads(model, micro_steps, ep, 4, seed)
    plan = plan_stage("foremoe", loads, Topology.from_ranks(ep, P), PlannerConfig(spare_slots=spare),
                      micro_steps_per_step=micro_steps_per_step)
    tables = compile_stage(plan, loads, rank)
    rows = max(spare, *(t.num_bank_rows for t in tables))
    owned = (torch.empty(K, F, D, dtype=dtype, device=device), torch.empty(K, D, F, dtype=dtype, device=device),
             torch.empty(K, F, D, dtype=dtype, device=device))  # every layer reads the same shard: sizes only
    outputs: list[torch.Tensor] = []
    real = dist.all_to_all_single
    dist.all_to_all_single = fake_all_to_all(outputs)
    try:
        engine = TransferEngine(object(), rank, ep, np.arange(ep) // P, path="direct")
        per_m = []
        for m, t in enumerate(tables):
            counter = CopyCounter()
            outputs.clear()
            with counter:
                for layer, lt in enumerate(t.layers):  # issued one micro-step ahead, landed at first use
                    engine.prefetch(layer, owned, lt.transfers, m % 2, rows, dtype)
                for layer in range(L):
                    engine.wait(layer)
            bank_keys = {storage_key(w) for lb in engine.layers.values() for bank in lb.banks for w in bank}
            received = sum(o.numel() * o.element_size() for o in outputs)
            in_bank = [storage_key(o) in bank_keys for o in outputs if o.numel()]
            per_m.append({"received": received, "into_banks": counter.bytes_into(bank_keys),
                          "other": counter.bytes_total() - counter.bytes_into(bank_keys),
                          "outputs_in_bank": all(in_bank), "direct_rows": sum(len(lt.transfers.direct.recv_row_T)
                                                                             for lt in t.layers),
                          "kept_rows": sum(len(lt.transfers.keep_row_U) for lt in t.layers),
                          "sent_rows": sum(len(lt.transfers.direct.send_row_T) for lt in t.layers)})
    finally:
        dist.all_to_all_single = real
    row_bytes = 3 * F * D * torch.empty(0, dtype=dtype).element_size()
    mean = {k: float(np.mean([p[k] for p in per_m])) for k in per_m[0] if k != "outputs_in_bank"}
    return {"model": model, "ep": ep, "rank": rank, "micro_steps": micro_steps, "row_bytes": row_bytes,
            "bank_rows": rows, "per_micro_step": per_m, "mean": mean,
            "outputs_in_bank": all(p["outputs_in_bank"] for p in per_m)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3_30b_a3b")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--micro-steps", type=int, default=8)
    ap.add_argument("--micro-steps-per-step", type=int, default=4)
    ap.add_argument("--spare", type=int, default=2)
    ap.add_argument("--rank", type=int, default=-1, help="EP rank measured (default: EP // 2)")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--device", default="meta", help="meta (sizes only, default) or cpu (real copies)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rank = a.rank if a.rank >= 0 else a.ep // 2
    r = measure(a.model, a.ep, a.micro_steps, a.micro_steps_per_step, a.spare, rank, a.ranks_per_node, a.device)
    mb = 1e6
    mean = r["mean"]
    print(f"{a.model}, EP {a.ep}, rank {rank}, {a.micro_steps} micro-steps ({a.micro_steps_per_step} per step), "
          f"bf16 rows of {r['row_bytes'] / mb:.2f} MB; per micro-step per rank, all layers (mean):")
    print("| received by all-to-alls | copied into banks | other copies (send side) | rows: received / kept / sent "
          "| all-to-all output is the bank |")
    print("|---|---|---|---|---|")
    print(f"| {mean['received'] / mb:.1f} MB | {mean['into_banks'] / mb:.1f} MB | {mean['other'] / mb:.1f} MB | "
          f"{mean['direct_rows']:.1f} / {mean['kept_rows']:.1f} / {mean['sent_rows']:.1f} | {r['outputs_in_bank']} |")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(r, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
