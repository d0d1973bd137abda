#!/usr/bin/env python
"""One-command check for a single lent GPU: ``scripts/gpu_check.sh [--cpu] [--only STAGES] --out DIR``.

Sized for one call of at most 9 minutes on one H200 that has its own torch (2.11 with CUDA 13) and no package
registry (``gpu_check.sh`` installs the carried torchtitan wheels). ``STAGES`` run one after another, each in a
process of its own under its own time limit: ``kernels`` (below), then the trainer stages of ``gpu_stages.py``
(the trainer at world size 1, two ranks on one GPU, one Qwen3-30B-A3B MoE layer, CUDA IPC) and of
``gpu_fleet_stages.py`` (the engine fleet's IPC weight sync and relay device, vLLM's sleep mode). ``DIR/report.json``
gathers every stage's verdict and figures (``DIR/stages/NAME.json``).

The ``kernels`` stage needs torch and numpy only, and imports none of torchtitan: the experts' kernels (``models/slot_swiglu.py``, ``slot_gemm.py``, ``grouped_swiglu.py``), the transfer engine
and the placement tables are loaded without ``titan_foremoe/models/__init__.py`` (which applies torchtitan's CPU
patches). It prints one PASS / FAIL line per check with its figures and writes

* ``DIR/report.json``: every check's verdict and figures, and the environment (torch, CUDA, GPU, NCCL, the
  torch features the trainer needs, whether torchtitan imports here and why not);
* ``DIR/grouped_mm_calibration.json``: the SwiGLU expert kernels timed over a grid of groups and tokens per
  group, forward and backward, in the format ``scripts/simulate_cluster.py --calibration`` takes (dense
  ``torch._grouped_mm`` as ``grouped_mm``; the runtime's slot paths as ``slot_swiglu``: in place, gather).

Checks:

1. **slot SwiGLU** (in place and gather) against dense ``torch._grouped_mm`` at the Qwen3-30B-A3B (2048 x 768, EP 8:
   16 owned + 2 spare slots) and gpt-oss-20b (2880 x 2880, EP 8: 4 + 1) expert shapes, bf16, forward and backward
   (values, gradients of x, the owned rows and the bank rows), with empty, odd and unaligned groups and a spare
   slot reading an owned row, and again with the bank read in order from the engine's layout (w1 | w3 | w2 per
   row: the spare part's w1 and w3 as one GEMM); after filling the caching allocator with NaN (a read of
   unwritten rows shows); under ``torch.cuda.set_sync_debug_mode("error")`` and torch's CUDA sanitizer. PASS:
   relative error <= 2e-2, no NaN, no sync, no sanitizer report, the in-order case on the one-GEMM path.
2. **stream program**: the transfer engine's prefetch into a bank on its side stream, the first-use wait, the
   slot SwiGLU on the replicas, the gradient return to the owner, at world size 1 on NCCL (gloo with --cpu, under
   the checked backend's stream analysis), plus one NCCL all-to-all issued from the side stream and waited on at
   first use. PASS: values and gradients equal the dense reference's, no sync, no stream fault, the replica read
   in order with w1 and w3 as one GEMM.
3. **timings** of the three paths over the grid (CUDA events; median of the repeats; in place: one spare slot
   reading the engine-laid bank row in order, w1 and w3 as one GEMM).
4. **environment**.
5. **attention**: the kernel each attention path runs here (``models/attention_kernels.py``: packed varlen FA2 /
   FA3, the KV-cache flash decode, SDPA's pick for padded rows), each run once. PASS: both flash calls run and
   padded rows take SDPA's cuDNN or flash kernel (CPU: the fallbacks are named).
2b. **landing** (``gpu_landing.py``): returned gradients added on the engine's landing stream before the gate
   (values against autograd, no sync), and on CUDA what it costs the dense GEMMs it overlaps (``landing_overlap``).
6. **combine**: torchtitan's deterministic ``scatter_add`` combine and its backward gather timed at Qwen3-30B-A3B's
   shape (``benchmarks/bench_combine_scatter_add.py``).

``--cpu``: the same code on CPU with small shapes for the checks (and a small grid at the Qwen3-30B-A3B shape
for the timings, so the simulator can read the file), in well under a minute; CI runs it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_landing import check_landing  # noqa: E402


def _kernels_without_torchtitan() -> None:
    """Enter ``titan_foremoe.models`` without its ``__init__`` (which applies torchtitan's CPU patches and so
    imports torchtitan): only the torch-only kernel modules are imported from it here."""
    if "titan_foremoe.models" in sys.modules:
        return
    import titan_foremoe

    pkg = types.ModuleType("titan_foremoe.models")
    pkg.__path__ = [os.path.join(titan_foremoe.__path__[0], "models")]
    sys.modules["titan_foremoe.models"] = pkg


_kernels_without_torchtitan()

from calibrate_gpu import PUBLIC_LINKS, Timer, copies, dense  # noqa: E402  (torch only)

from titan_foremoe.distributed import environment  # noqa: E402
from titan_foremoe.models.grouped_swiglu import grouped_swiglu  # noqa: E402
from titan_foremoe.models.slot_gemm import InPlaceSplit, SlotWeights  # noqa: E402
from titan_foremoe.models.slot_swiglu import w13_view  # noqa: E402
from titan_foremoe.placement.tables import slot_split  # noqa: E402
from titan_foremoe.transfer.banks import pack_rows, packed_view, unpack_rows  # noqa: E402

# expert shapes, EP 8: owned experts and spare slots per rank
SHAPES = {"qwen3_30b_a3b": dict(dim=2048, hidden=768, owned=16, spare=2),
          "gpt_oss_20b": dict(dim=2880, hidden=2880, owned=4, spare=1)}
CPU_SHAPES = {"small": dict(dim=64, hidden=48, owned=4, spare=2)}
GRID = {"cuda": dict(groups=[1, 2, 4, 8, 16], tokens=[16, 64, 256, 1024, 4096], repeats=5,
                     models=["qwen3_30b_a3b", "gpt_oss_20b"]),
        "cpu": dict(groups=[1, 2], tokens=[1, 8], repeats=3, models=["qwen3_30b_a3b"])}
REL_TOL = 2e-2  # bf16 against bf16: the slot paths and dense group the same rows, in other GEMM calls
PATHS = ("inplace", "gather")


# -- helpers ---------------------------------------------------------------------------------------------------
def nan_fill_allocator(device: torch.device, gib: float) -> float:
    """Fill the caching allocator's blocks with NaN and free them (kept cached): later allocations that a kernel
    fails to write read NaN. Small-pool blocks (<= 1 MiB) and large ones. CPU: no caching allocator (no-op)."""
    if device.type != "cuda":
        return 0.0
    held = [torch.full((n // 2,), float("nan"), dtype=torch.bfloat16, device=device)
            for n in [512, 4096, 65536, (1 << 20) - 512] for _ in range(64)]
    chunk = 256 << 20
    free = torch.cuda.mem_get_info(device)[0]
    for _ in range(int(min(gib * (1 << 30), free * 0.5) // chunk)):
        held.append(torch.full((chunk // 2,), float("nan"), dtype=torch.bfloat16, device=device))
    total = sum(t.numel() * 2 for t in held) / (1 << 30)
    del held
    return total


@contextmanager
def no_sync_region(device: torch.device):
    """CUDA: any synchronizing call raises (``set_sync_debug_mode("error")``) and torch's CUDA sanitizer checks
    stream order; CPU: nothing here (the stream program runs under the checked backend)."""
    if device.type != "cuda":
        yield
        return
    from torch.cuda import _sanitizer

    _sanitizer.enable_cuda_sanitizer()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
        _sanitizer.cuda_sanitizer.disable()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _weights(g, device, dtype, rows, dim, hidden, grad=True):
    def rand(*shape):
        t = (torch.randn(*shape, generator=g) * 0.05).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)
    return [rand(rows, *s) for s in ((hidden, dim), (dim, hidden), (hidden, dim))]


def _bank_weights(g, device, dtype, rows, dim, hidden):
    """The bank as the transfer engine holds it (``transfer/banks.py``): views of one packed ``[B, 3*F*D]`` tensor,
    w1 | w3 | w2 per row (so the in-order spare part reads w1 and w3 as one matrix, ``slot_swiglu.w13_view``);
    each view a leaf of its own, so its gradient is the function's, as ``ReplicaWeights`` receives it."""
    w = _weights(g, device, dtype, rows, dim, hidden, grad=False)
    return [v.requires_grad_(True) for v in unpack_rows(pack_rows(*w), [tuple(x.shape[1:]) for x in w])]


# -- 1. the slot SwiGLU against dense torch._grouped_mm ----------------------------------------------------------
def slot_case(spec: dict, device: torch.device, dtype: torch.dtype, seed: int = 0, in_order: bool = False):
    """A rank's slots: ``owned`` in place, ``spare`` reading bank rows, the last spare slot an owned row (with
    ``in_order``: spare slot s reads bank row s, every row, as one spare slot with a replica does: the bank read as
    it is, ``InPlaceSplit.bank_in_order``); row counts with empty, odd and unaligned groups."""
    g = torch.Generator().manual_seed(seed)
    K, J, D, F = spec["owned"], spec["spare"], spec["dim"], spec["hidden"]
    source_C = np.concatenate([np.arange(K), K + np.arange(J)])
    if not in_order:
        source_C[-1] = 1  # a spare slot holding a replica of owned expert 1 (reads the owned row)
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 400, K + J) | 1  # odd: unaligned group boundaries
    # empty owned and spare groups; in order every spare slot keeps rows (one spare slot: its part runs the plain
    # GEMMs that write in place, slot_swiglu's _mm)
    counts[[0, K // 2] if in_order else [0, K // 2, K]] = 0
    split = slot_split(source_C, counts[None], K)
    owned = _weights(g, device, dtype, K, D, F)
    bank = (_bank_weights if in_order else _weights)(g, device, dtype, J, D, F)
    x = (torch.randn(int(counts.sum()), D, generator=g)).to(device=device, dtype=dtype).requires_grad_(True)
    dy = torch.randn(x.shape[0], D, generator=g).to(device=device, dtype=dtype)
    in_place = InPlaceSplit(split.owned_rows, split.spare_rows, torch.as_tensor(split.spare_source_J, device=device),
                            torch.as_tensor(split.spare_owned_U, device=device) if len(split.spare_owned_U) else None,
                            in_order)
    return dict(owned=owned, bank=bank, x=x, dy=dy, counts_C=torch.as_tensor(counts, device=device),
                index_C=torch.as_tensor(source_C, device=device),
                split=in_place, counts=counts)


def run_path(case: dict, path: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Forward and backward of one path: [y, grad x, grad owned w1 w2 w3, grad bank w1 w2 w3]."""
    owned, bank, x = case["owned"], case["bank"], case["x"]
    weights = [SlotWeights(o, b, case["index_C"], case["split"] if path == "inplace" else None)
               for o, b in zip(owned, bank)]
    if path == "dense":  # torch._grouped_mm over the materialized [C, X, Y] slots, torch's own autograd
        weights = [w.dense() for w in weights]
    y = grouped_swiglu(x, *weights, case["counts_C"], dtype)
    return [y, *torch.autograd.grad(y, [x, *owned, *bank], case["dy"])]


NAMES = ["y", "grad x", "grad w1", "grad w2", "grad w3", "grad bank w1", "grad bank w2", "grad bank w3"]


def check_slot_swiglu(name: str, spec: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """Both slot paths against dense ``torch._grouped_mm``, and the in-place path reading the bank in order."""
    case, ordered = slot_case(spec, device, dtype), slot_case(spec, device, dtype, in_order=True)
    with no_sync_region(device):
        ref, ref_o = run_path(case, "dense", dtype), run_path(ordered, "dense", dtype)
        got = {p: run_path(case, p, dtype) for p in PATHS}
        got["inplace in order"] = run_path(ordered, "inplace", dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
    refs = {p: ref_o if p == "inplace in order" else ref for p in got}
    fused13 = w13_view(ordered["bank"][0], ordered["bank"][2]) is not None  # in order: w1, w3 as one GEMM
    err = {f"{p}: {n}": rel_err(a, b) for p in got for n, a, b in zip(NAMES, got[p], refs[p])}
    nan = [f"{p}: {n}" for p in got for n, a in zip(NAMES, got[p]) if not torch.isfinite(a).all()]
    worst = max(err, key=err.get)
    # one bank row: its weight gradients come as ONE packed row, which the return sends as it is (banks.grad_rows)
    packed_grad = packed_view(*got["inplace in order"][5:8]) is not None
    ok = err[worst] <= REL_TOL and not nan and fused13 and packed_grad == (spec["spare"] == 1)
    return {"passed": ok, "shape": f"{spec['dim']}x{spec['hidden']}", "slots": f"{spec['owned']} owned + "
            f"{spec['spare']} spare", "rows": int(case["counts"].sum()), "group_rows": case["counts"].tolist(),
            "worst_rel_err": err[worst], "worst": worst, "non_finite": nan, "rel_err": err,
            "in_order_w13_one_gemm": fused13, "one_bank_row_grad_packed": packed_grad,
            "line": f"slot SwiGLU {name} {spec['dim']}x{spec['hidden']} bf16 fwd+bwd: worst relative error "
                    f"{err[worst]:.2e} ({worst}){'; NaN in ' + ', '.join(nan) if nan else ''}"}


# -- 2. the transfer engine's stream program at world size 1 -----------------------------------------------------
def check_stream_program(device: torch.device, dtype: torch.dtype) -> dict:
    """Prefetch a replica of owned expert 1 into a spare slot on the side stream, wait at first use, run the slot
    SwiGLU (in place) on it, return its gradient to the owner; one NCCL all-to-all from the side stream."""
    import torch.distributed as dist

    from titan_foremoe.distributed import device as dev
    from titan_foremoe.distributed.uploads import upload
    from titan_foremoe.transfer.engine import TransferEngine
    from titan_foremoe.transfer.schedule import Exchange, LayerTransfers

    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    checked = None
    try:
        if device.type == "cuda":
            dev.set_backend(dev.Cuda())
            outer, region = nullcontext(), lambda: no_sync_region(device)
        else:  # the checked backend: CUDA's stream semantics on CPU; its strict mode raises on any host sync
            from titan_foremoe.distributed.checked import checking
            outer, region = checking(), lambda: dev.strict("the stream program")
        with outer as checked:
            group, grad_group = dist.new_group([0]), dist.new_group([0])
            engine = TransferEngine(group, 0, 1, np.zeros(1, dtype=np.int64), grad_group=grad_group)
            # one rank owning experts 0 and 1; its spare slot 2 holds a replica of expert 1, moved into bank row 0
            # by the direct lane (to itself) and its gradient returned to owned row 1
            one = lambda *a: np.array(a, dtype=np.int64)  # noqa: E731
            lt = LayerTransfers(direct=Exchange(one(0), one(1), one(0), one(0)),
                                host=Exchange(one(), one(), one(), one()), grad=Exchange(one(0), one(0), one(0), one(1)),
                                keep_prev_row_U=one(), keep_row_U=one(), send_inter_T=np.zeros(1, bool), stale=True,
                                host_any=False)
            slot_source_C, counts_C = one(0, 1, 2), one(5, 3, 4)  # slot 2 reads cat(owned, bank) row 2: bank row 0
            split = slot_split(slot_source_C, counts_C[None], 2)
            D, F = 64, 32
            g = torch.Generator().manual_seed(1)
            with dev.host_code() if checked is not None else nullcontext():
                host = [torch.randn(2, *s, generator=g) * 0.1 for s in ((F, D), (D, F), (F, D))]
                x_host = torch.randn(int(counts_C.sum()), D, generator=g)
                counts_host, slots_host = torch.as_tensor(counts_C), torch.as_tensor(one(0, 1, 1))
            # set-up outside the no-sync region (uploads), as the trainer does before a stage
            owned = [dev.to_device(h, device).to(dtype).requires_grad_(True) for h in host]
            ref_owned = [o.detach().clone().requires_grad_(True) for o in owned]
            x, counts, slot_rows = (dev.to_device(t, device) for t in (x_host, counts_host, slots_host))
            x = x.to(dtype).requires_grad_(True)
            x_ref = x.detach().clone().requires_grad_(True)
            # the stage's device indices in one upload ahead of use, as the placement runtime's upload_tables
            arrays = engine.index_arrays(lt, slot_source_C, 2, split)
            on_device = upload({str(i): a for i, a in enumerate(arrays.values())}, device)
            engine.stage_indices.update({k: on_device[str(i)] for i, k in enumerate(arrays)})
            probe = torch.arange(8, device=device, dtype=torch.float32)
            landed = torch.empty_like(probe)
            dist.all_to_all_single(torch.empty_like(probe), probe, group=group)  # NCCL's lazy set-up, outside
            with region():
                engine.prefetch(0, tuple(o.detach() for o in owned), lt, bank=0, rows=1, dtype=dtype)
                side = engine._side_stream(device)
                side.wait_stream(dev.current_stream(device))
                with dev.use_stream(side):  # an NCCL all-to-all from the side stream, waited on at first use
                    work = dist.all_to_all_single(landed, probe, group=group, async_op=True)
                    dev.record_stream(landed, side)
                work.wait()
                landed_ok = landed + 0  # first use on the compute stream, after work.wait()
                w = engine.slot_weights(0, tuple(owned), slot_source_C, lt, bank=0, dtype=dtype, split=split)
                fused13 = w[0].split.bank_in_order and w13_view(w[0].bank_BXY, w[2].bank_BXY) is not None
                y = grouped_swiglu(x, *w, counts, dtype)
                y.float().square().sum().backward()
                # the dense reference: the slots materialized from the owned rows, torch._grouped_mm's autograd
                y_ref = grouped_swiglu(x_ref, *[r.index_select(0, slot_rows) for r in ref_owned], counts, dtype)
                y_ref.float().square().sum().backward()
            got = [y.detach(), x.grad.detach()] + [o.grad.detach() for o in owned]  # x's: the one bank row's in-place
            ref = [y_ref.detach(), x_ref.grad.detach()] + [r.grad.detach() for r in ref_owned]  # data gradient
            with dev.expected_sync("the check reads its verdict") if checked is not None else nullcontext():
                err = {n: rel_err(a, r) for n, a, r in zip(["y", "grad x", "grad w1", "grad w2", "grad w3"], got, ref)}
                a2a_ok = bool(torch.equal(landed_ok.cpu(), probe.cpu()))
            syncs = checked.summary() if checked is not None else {}
        worst = max(err.values())
        ok = worst <= (0.0 if dtype == torch.float32 else REL_TOL) and a2a_ok and fused13
        stats = engine.stats
        return {"passed": ok, "backend": backend, "rel_err": err, "nccl_all_to_all_from_side_stream": a2a_ok,
                "received_rows": int(len(lt.direct.recv_row_T)), "bank_rows_read_in_place": int(split.spare_rows),
                "bank_w1_w3_one_gemm": bool(fused13),
                "grad_return_bytes": int(stats.grad_return_bytes), "host_syncs_counted": syncs,
                "line": f"stream program (prefetch, first-use wait, slot SwiGLU, gradient return) on {backend}, world "
                        f"size 1: worst relative error {worst:.1e}, side-stream all-to-all "
                        f"{'ok' if a2a_ok else 'WRONG'}"}
    finally:
        dev.set_backend(dev.Plain())
        dist.destroy_process_group()


# -- attention kernels -----------------------------------------------------------------------------------------
def check_attention(device: torch.device, dtype: torch.dtype) -> dict:
    """Which attention kernel each path runs here (``models/attention_kernels.py``), each run once on CUDA: the
    packed varlen forward + backward and the KV-cache decode must run, and the padded path take SDPA's flash
    or cuDNN kernel. PASS on CPU reports the fallbacks."""
    from titan_foremoe.models.attention_kernels import describe_attention_kernels

    d = describe_attention_kernels(device, dtype)
    ok = device.type == "cpu" or (d["problem"] is None and d["ran_packed"] == "ok" and d["ran_decode"] == "ok"
                                  and d["sdpa_padded"] in ("cudnn", "flash"))
    ran = f"; ran packed {d['ran_packed']}, decode {d['ran_decode']}" if "ran_packed" in d else ""
    return {"passed": ok, "kernels": d,
            "line": f"attention on {d['capability'] or 'cpu'}: packed {d['packed']}, decode {d['decode']}, padded SDPA "
                    f"{d.get('sdpa_padded', d['padded'])}, masked decode SDPA {d.get('sdpa_masked_decode', 'math')}"
                    f"{ran}" + (f"; {d['problem']}" if d["problem"] else "")}


def check_combine(device: torch.device, dtype: torch.dtype) -> dict:
    """torchtitan's deterministic ``scatter_add`` combine timed (``benchmarks/bench_combine_scatter_add.py``):
    Qwen3-30B-A3B's 16k tokens x top-8 of 2048 on CUDA, 1k tokens on CPU. PASS: the sum is right."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_combine_scatter_add import time_combine

    r = time_combine(16384 if device.type == "cuda" else 1024, 8, 2048, device, dtype,
                     repeats=5 if device.type == "cuda" else 1)
    return {"passed": r["max_abs_err"] < 0.5, **r,
            "line": f"combine scatter_add {r['tokens']}x8 of 2048: deterministic {r['deterministic_ms']:.3f} ms, "
                    f"atomic {r['atomic_ms']:.3f} ms, gather {r['gather_bwd_ms']:.3f} ms per layer; "
                    f"{r['per_micro_step_ms']:.1f} ms per micro-step over 48 layers"}


# -- 3. timings -------------------------------------------------------------------------------------------------
def time_paths(spec: dict, groups: list[int], tokens: list[int], device: torch.device, dtype: torch.dtype,
               repeats: int) -> dict:
    """ms[k][n] forward and backward of dense, in-place and gather SwiGLU over k groups of n rows (k >= 2: one of
    the k a spare slot reading a bank row)."""
    timer = Timer(device.type)
    D, F = spec["dim"], spec["hidden"]
    g = torch.Generator().manual_seed(2)
    out = {p: {"fwd_ms": [], "bwd_ms": []} for p in ("dense", *PATHS)}
    for k in groups:
        J = 1 if k >= 2 else 0
        owned = _weights(g, device, dtype, k - J, D, F)
        bank = _bank_weights(g, device, dtype, max(J, 1), D, F)  # in order (J = 1): w1 and w3 as one GEMM
        source_C = np.arange(k)
        rows = {p: {"fwd_ms": [], "bwd_ms": []} for p in out}
        for n in tokens:
            counts = np.full(k, n)
            split = slot_split(source_C, counts[None], k - J)
            case = dict(owned=owned, bank=bank, x=torch.randn(k * n, D, generator=g).to(device, dtype)
                        .requires_grad_(True), dy=torch.randn(k * n, D, generator=g).to(device, dtype),
                        counts_C=torch.as_tensor(counts, device=device), index_C=torch.as_tensor(source_C, device=device),
                        split=InPlaceSplit(split.owned_rows, split.spare_rows,  # one spare slot: its bank row
                                           torch.as_tensor(split.spare_source_J, device=device), None, bool(J)))
            for p in out:
                weights = [SlotWeights(o, b, case["index_C"], case["split"] if p == "inplace" else None)
                           for o, b in zip(owned, bank)]
                if p == "dense":
                    weights = [w.dense().detach().requires_grad_(True) for w in weights]

                def fwd():
                    return grouped_swiglu(case["x"], *weights, case["counts_C"], dtype)

                f = statistics.median(timer(fwd, repeats))
                y = fwd()  # the backward timed alone, on one graph kept (not fwd+bwd minus fwd: on a loaded
                b = statistics.median(timer(lambda: y.backward(case["dy"], retain_graph=True), repeats))  # CPU <= 0)
                rows[p]["fwd_ms"].append(round(f, 5))
                rows[p]["bwd_ms"].append(round(b, 5))
        for p in out:
            out[p]["fwd_ms"].append(rows[p]["fwd_ms"])
            out[p]["bwd_ms"].append(rows[p]["bwd_ms"])
    return out


def calibration(args, device, dtype, timings: dict, env: dict) -> dict:
    """``simulate_cluster.py --calibration`` format (``simulator/calibration.py``): ``grouped_mm`` = dense
    ``torch._grouped_mm`` SwiGLU; ``slot_swiglu`` = the runtime's slot paths per shape."""
    grid = GRID[device.type]
    a = argparse.Namespace(repeats=grid["repeats"], matmul_n=256 if device.type == "cpu" else None,
                           copy_mb=4.0 if device.type == "cpu" else 256.0)
    timer = Timer(device.type)
    d = dense(a, timer, dtype, device.type)
    first = SHAPES[grid["models"][0]]
    c = copies(a, timer, dtype, device.type, (first["dim"], first["hidden"]))
    common = lambda m: {"dim": SHAPES[m]["dim"], "hidden": SHAPES[m]["hidden"], "dtype": str(dtype)[6:],  # noqa
                        "experts_per_rank": grid["groups"], "tokens_per_expert": grid["tokens"], "model": m}
    return {
        "kind": "measured", "source": "scripts/gpu_check.sh", "device": env["device"], "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv), "repeats": grid["repeats"],
        "clock": "cuda_events" if device.type == "cuda" else "wall",
        "dense_matmul": d,
        "grouped_mm": {f"{SHAPES[m]['dim']}x{SHAPES[m]['hidden']}": common(m) | timings[m]["dense"]
                       for m in grid["models"]},
        "slot_swiglu": {f"{SHAPES[m]['dim']}x{SHAPES[m]['hidden']}": {p: common(m) | timings[m][p] for p in PATHS}
                        | {"spare_slots": "1 of the k groups (k >= 2) reads a bank row"} for m in grid["models"]},
        "copies": {"h2d_pinned_GBps": c["h2d"]["GBps"], "d2d_GBps": c["d2d"]["GBps"],
                   "gemm_slowdown_with_h2d": max(c["h2d"]["gemm_slowdown"], 0.0),
                   "gemm_slowdown_with_d2d": max(c["d2d"]["gemm_slowdown"], 0.0)},
        "links": dict(PUBLIC_LINKS),
    }


# -- 4. environment ---------------------------------------------------------------------------------------------
def torchtitan_probe() -> subprocess.Popen:
    """Whether torchtitan imports here, after the CPU patches as every entry point applies them: in a subprocess
    (this process never imports it), started first and read at the end (its import takes seconds)."""
    code = "import torchtitan_patches; torchtitan_patches.apply_all(); import torchtitan.models.common.moe"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def environment_report(device: torch.device, probe: subprocess.Popen) -> dict:
    """Versions, device and the torch features the trainer needs; whether torchtitan imports (``probe``)."""
    out, err = probe.communicate(timeout=180)
    err = (err.strip().splitlines() or [""])[-1]
    cuda = device.type == "cuda"
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)",
           "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
           "memory_GiB": round(torch.cuda.get_device_properties(device).total_memory / (1 << 30), 1) if cuda else None,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
           "versions": environment.versions(), "needs": environment.NEEDS, "features": environment.features(),
           "torchtitan_imports": probe.returncode == 0, "torchtitan_error": err if probe.returncode else None,
           "trainer_ready": environment.problem(import_torchtitan=False) is None and probe.returncode == 0}
    env["problem"] = environment.problem(import_torchtitan=False) or (
        None if probe.returncode == 0 else f"torchtitan does not import: {err}")
    return env


# -- the kernel stage (checks 1-4) -------------------------------------------------------------------------------
def kernels(a) -> dict:
    """Checks 1-4 in this process; writes the calibration. The stage's verdict: every check passed."""
    out = Path(a.out)
    device = torch.device("cpu") if a.cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    report = {"checks": {}}

    def verdict(key, fn):
        t = time.time()
        try:
            r = fn()
        except Exception as e:  # a check's failure is its verdict, with the reason
            r = {"passed": False, "line": f"{key}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                 "traceback": traceback.format_exc()}
        r["seconds"] = round(time.time() - t, 2)
        report["checks"][key] = r
        print(f"  {'PASS' if r['passed'] else 'FAIL'} {r['line']} ({r['seconds']:.1f} s)", flush=True)
        return r

    probe = torchtitan_probe()
    report["nan_filled_GiB"] = nan_fill_allocator(device, a.nan_fill_gib)
    for name, spec in (CPU_SHAPES if a.cpu else SHAPES).items():
        verdict(f"slot_swiglu_{name}", lambda: check_slot_swiglu(name, spec, device, dtype))
    verdict("stream_program", lambda: check_stream_program(device, dtype))
    landing = verdict("landing", lambda: check_landing(device, dtype, SHAPES, no_sync_region))  # gpu_landing.py
    verdict("attention", lambda: check_attention(device, dtype))
    verdict("combine", lambda: check_combine(device, dtype))
    env = environment_report(device, probe)
    report["environment"] = env
    print(f"  environment: torch {env['torch']} CUDA {env['cuda']} on {env['device']}; torchtitan imports: "
          f"{env['torchtitan_imports']}" + (f" ({env['torchtitan_error']})" if env["torchtitan_error"] else "")
          + f"; trainer features missing: {[k for k, v in env['features'].items() if not v] or 'none'}", flush=True)
    grid = GRID[device.type]
    timings = {}

    def timing():
        for m in grid["models"]:
            timings[m] = time_paths(SHAPES[m], grid["groups"], grid["tokens"], device, dtype, grid["repeats"])
        cal = calibration(a, device, dtype, timings, env)
        if landing.get("landing_overlap") is not None:  # measured: the simulator's and planner's landing charge
            cal["copies"]["landing_overlap"] = landing["landing_overlap"]
        (out / "grouped_mm_calibration.json").write_text(json.dumps(cal, indent=1) + "\n")
        m = grid["models"][0]
        k, n = len(grid["groups"]) - 1, len(grid["tokens"]) - 1
        fig = ", ".join(f"{pth} {timings[m][pth]['fwd_ms'][k][n]:.3f}/{timings[m][pth]['bwd_ms'][k][n]:.3f}"
                        for pth in ("dense", *PATHS))
        return {"passed": True, "line": f"timings {m} {grid['groups'][k]} groups x {grid['tokens'][n]} rows, fwd/bwd "
                                        f"ms: {fig}; wrote {out / 'grouped_mm_calibration.json'}"}

    verdict("timings", timing)
    checks = report["checks"].values()
    report["passed"] = all(r["passed"] for r in checks)
    report["line"] = (f"kernels: {sum(r['passed'] for r in checks)} of {len(checks)} checks passed (slot SwiGLU, "
                      f"stream program, timings); torchtitan imports: {env['torchtitan_imports']}")
    return report


# -- stages: each in a process of its own, under its own time limit ---------------------------------------------
# name -> (what it runs, seconds on one H200, seconds with --cpu); the H200 limits add up to 9 minutes (docs/gpu.md)
STAGES = {
    "kernels": ("gpu_check.kernels", 85, 240),
    "trainer": ("gpu_stages.stage_trainer", 180, 420),
    "two_ranks": ("gpu_stages.stage_two_ranks", 150, 420),
    "moe_layer": ("gpu_stages.stage_moe_layer", 40, 120),
    "ipc": ("gpu_stages.stage_ipc", 30, 120),
    "fleet_ipc": ("gpu_fleet_stages.stage_fleet_ipc", 45, 240),
    "fleet_sleep": ("gpu_fleet_stages.stage_fleet_sleep", 10, 60),
}


def run_stage(name: str, a) -> dict:
    """The stage ``name`` in this process: its verdict, also written to ``DIR/stages/NAME.json``."""
    module, fn = STAGES[name][0].split(".")
    import importlib

    t = time.time()
    try:
        f = kernels if module == "gpu_check" else getattr(importlib.import_module(module), fn)
        r = f(a) if module == "gpu_check" else f(a.cpu, Path(a.out) / name)
    except Exception as e:  # the stage's failure is its verdict
        r = {"passed": False, "line": f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
             "traceback": traceback.format_exc()}
    r["seconds"] = round(time.time() - t, 1)
    path = Path(a.out) / "stages" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=1, default=str) + "\n")
    return r


def spawn_stage(name: str, a, limit: int) -> dict:
    """``run_stage`` in a subprocess (a crash or hang ends only this stage), killed at ``limit`` seconds."""
    cmd = [sys.executable, __file__, "--stage", name, "--out", a.out, "--nan-fill-gib", str(a.nan_fill_gib)]
    cmd += ["--cpu"] if a.cpu else []
    path = Path(a.out) / "stages" / f"{name}.json"
    path.unlink(missing_ok=True)
    t = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the stage and the jobs it started
        log, _ = proc.communicate()
        return {"passed": False, "line": f"{name}: over its limit of {limit} s", "log_tail": log[-4000:],
                "seconds": round(time.time() - t, 1)}
    (Path(a.out) / "stages").mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "stages" / f"{name}.log").write_text(log)
    for line in log.splitlines():
        if line.startswith("  "):  # a stage's own check lines
            print(line, flush=True)
    if not path.exists():
        tail = (log.strip().splitlines() or ["no output"])[-1]
        return {"passed": False, "line": f"{name}: exit {proc.returncode}: {tail}", "seconds": round(time.time() - t, 1)}
    return json.loads(path.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on CPU with small shapes (CI)")
    p.add_argument("--out", required=True, help="folder for report.json and grouped_mm_calibration.json")
    p.add_argument("--nan-fill-gib", type=float, default=8.0, help="NaN-filled allocator blocks (CUDA)")
    p.add_argument("--only", default=",".join(STAGES), help=f"stages to run, comma-separated ({', '.join(STAGES)})")
    p.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # one stage in this process (internal)
    a = p.parse_args(argv)
    t0 = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if not a.cpu and not torch.cuda.is_available():
        print("FAIL no CUDA device (use --cpu for the CPU mode)", flush=True)
        return 2
    if a.stage:
        return 0 if run_stage(a.stage, a)["passed"] is not False else 1
    only = [s for s in a.only.split(",") if s]
    if unknown := [s for s in only if s not in STAGES]:
        print(f"FAIL --only: unknown stage {unknown[0]} (stages: {', '.join(STAGES)})", flush=True)
        return 2
    report = {"mode": "cpu" if a.cpu else "cuda", "command": " ".join(sys.argv), "stages": {}}
    for name in only:
        limit = STAGES[name][2 if a.cpu else 1]
        r = spawn_stage(name, a, limit)
        report["stages"][name] = r
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[r["passed"]]
        print(f"{verdict} {r['line']} ({r.get('seconds', 0):.1f} s of {limit})", flush=True)
    k = report["stages"].get("kernels", {})
    report["checks"], report["environment"] = k.get("checks", {}), k.get("environment", {})
    report["wall_s"] = round(time.time() - t0, 1)
    report["passed"] = all(r["passed"] is not False for r in report["stages"].values())
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"{'PASS' if report['passed'] else 'FAIL'} gpu_check ({report['mode']}) in {report['wall_s']} s; "
          f"send back {out}/report.json, {out}/grouped_mm_calibration.json and {out}/stages/", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
