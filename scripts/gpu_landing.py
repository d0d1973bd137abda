"""``scripts/gpu_check.sh``'s landing check (the kernels stage): the owners' landing of returned replica gradients
on the transfer engine's landing stream (``transfer/landing.py``), on the device, and what it costs the compute
stream it overlaps.

1. **values**: one rank (NCCL at world size 1; gloo under the checked backend with ``--cpu``) whose spare slot
   runs a replica of its own expert 1 on the fused SwiGLU; the replica's gradient is returned from inside its
   backward (before the owned part) through the all-to-all and added into expert 1's gradient on the landing
   stream, started by the owned parameters' post-accumulate-grad hooks, before the gate (``finish_gradients``);
   oracle: torch's autograd with expert 1 read twice. No host sync in the region
   (``set_sync_debug_mode("error")`` and torch's CUDA sanitizer on CUDA).
2. **overlap** (CUDA only): at each model's expert shape, the landing of ``rows`` returned rows alone, a run of
   dense GEMMs (a block's projections' backward at ~1.1k tokens) alone, and both, the landing on its own stream
   started with the GEMMs. ``landing_overlap`` = (GEMMs with - GEMMs alone) / landing alone: the share of an
   overlapped landing the compute stream still pays; the simulator's and the planner's
   ``GroupedMMCost.landing_overlap`` (``simulator/grouped_mm.py``), written into the calibration's ``copies``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from contextlib import nullcontext

import numpy as np
import torch

ROWS = 4  # returned rows landed per layer (a hot owner's, trace at 64 GPUs: ~1-6)
TOKENS = 1152  # a rank's tokens per micro-step on the trace's default layout


def _values(device: torch.device, dtype: torch.dtype, region) -> dict:
    import torch.distributed as dist

    from titan_foremoe.distributed import device as dev
    from titan_foremoe.models.grouped_swiglu import grouped_swiglu
    from titan_foremoe.placement.tables import slot_split
    from titan_foremoe.transfer.engine import TransferEngine
    from titan_foremoe.transfer.schedule import Exchange, LayerTransfers

    one = lambda *a: np.array(a, dtype=np.int64)  # noqa: E731
    group = dist.new_group([0])
    engine = TransferEngine(group, 0, 1, np.zeros(1, dtype=np.int64), grad_group=group)
    K, D, F = 2, 64, 32
    g = torch.Generator().manual_seed(3)
    with dev.host_code() if dev.backend().name == "checked" else nullcontext():
        host = [torch.randn(K, *s, generator=g) * 0.1 for s in ((F, D), (D, F), (F, D))]
        x_host, dy_host = torch.randn(9, D, generator=g), torch.randn(9, D, generator=g)
    params = [dev.to_device(h, device).to(dtype).requires_grad_(True) for h in host]
    x, dy = (dev.to_device(t, device).to(dtype) for t in (x_host, dy_host))
    counts = dev.to_device(torch.tensor([3, 2, 4]), device)
    empty = Exchange(one(), one(), one(), one())
    lt = LayerTransfers(direct=empty, host=empty, grad=Exchange(one(0), one(0), one(0), one(1)), keep_prev_row_U=one(),
                        keep_row_U=one(), send_inter_T=np.zeros(0, bool), stale=True, host_any=False)
    engine.grad_sink = lambda layer: params
    lb = engine.banks(0, tuple(params), 1, dtype)
    with torch.no_grad():
        for b, p in zip(lb.banks[0], params):
            b.copy_(p[1:2])
    probe = torch.zeros(1, device=device)
    dist.all_to_all_single(torch.empty_like(probe), probe, group=group)  # NCCL's lazy set-up, outside the region
    split = slot_split(one(0, 1, K), np.array([[3, 2, 4]]), K)  # the runtime's in-place path (the fused SwiGLU)
    with region():
        ws = engine.slot_weights(0, tuple(params), one(0, 1, K), lt, 0, dtype, split=split)
        grouped_swiglu(x, *ws, counts, dtype).backward(dy)
        early = engine._grad_pending[0].landed is not None
        engine.finish_gradients(0)
        got = [p.grad.detach().clone() for p in params]
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    grouped_swiglu(x, *[torch.cat([w, w[1:2]]) for w in leaves], counts, dtype).backward(dy)
    with dev.expected_sync("the check reads its verdict"):
        err = max(((a - w.grad).float().norm() / w.grad.float().norm()).item() for a, w in zip(got, leaves))
    return {"early": bool(early) and engine.early_returns == 1, "rel_err": err,
            "early_landings": engine.early_landings, "early_returns": engine.early_returns}


def _overlap(device: torch.device, dtype: torch.dtype, shapes: dict, repeats: int = 7) -> dict:
    """Per model shape: landing alone, GEMMs alone, GEMMs with the landing on another stream (ms, medians)."""
    from titan_foremoe.transfer.engine import TransferEngine

    out = {}
    for name, s in shapes.items():
        D, F, K = s["dim"], s["hidden"], s["owned"]
        grads = [torch.zeros(K, F, D, device=device, dtype=dtype), torch.zeros(K, D, F, device=device, dtype=dtype),
                 torch.zeros(K, F, D, device=device, dtype=dtype)]
        recv = torch.randn(ROWS, 3 * F * D, device=device, dtype=dtype)
        local = torch.arange(ROWS, device=device) % K
        land = lambda: TransferEngine._land(recv, local, grads)  # noqa: E731 - the engine's own landing
        x = torch.randn(TOKENS, D, device=device, dtype=dtype)
        w = torch.randn(D, 4 * D, device=device, dtype=dtype)
        gy = torch.randn(TOKENS, 4 * D, device=device, dtype=dtype)

        def dense():  # a block's projections' backward stand-in: data and weight gradients, a few times
            for _ in range(4):
                gy.mm(w.t())
                x.t().mm(gy)

        side = torch.cuda.Stream(device)

        def timed(fn_main, fn_side=None) -> tuple[float, float]:
            torch.cuda.synchronize(device)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ss, se = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            if fn_side is not None:
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    ss.record(side)
                    fn_side()
                    se.record(side)
            fn_main()
            e.record()
            torch.cuda.synchronize(device)
            return s.elapsed_time(e), (ss.elapsed_time(se) if fn_side is not None else 0.0)

        for fn in (land, dense):
            fn()
        t_land = statistics.median(timed(land)[0] for _ in range(repeats))
        t_dense = statistics.median(timed(dense)[0] for _ in range(repeats))
        both = [timed(dense, land) for _ in range(repeats)]
        t_both = statistics.median(b[0] for b in both)
        out[name] = {"rows": ROWS, "landing_ms": round(t_land, 4), "dense_ms": round(t_dense, 4),
                     "dense_with_landing_ms": round(t_both, 4),
                     "landing_beside_dense_ms": round(statistics.median(b[1] for b in both), 4),
                     "landing_overlap": round(max(t_both - t_dense, 0.0) / max(t_land, 1e-9), 3)}
    return out


def check_landing(device: torch.device, dtype: torch.dtype, shapes: dict, no_sync_region) -> dict:
    """``no_sync_region(device)``: ``gpu_check.py``'s CUDA region that raises on a sync (sanitizer on)."""
    import torch.distributed as dist

    from titan_foremoe.distributed import device as dev

    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    try:
        if device.type == "cuda":
            dev.set_backend(dev.Cuda())
            outer, region = nullcontext(), lambda: no_sync_region(device)
        else:
            from titan_foremoe.distributed.checked import checking
            outer, region = checking(), lambda: dev.strict("the landing")
        with outer:
            v = _values(device, dtype, region)
        dev.set_backend(dev.Plain())
        overlap = _overlap(device, dtype, shapes) if device.type == "cuda" else {}
    finally:
        dev.set_backend(dev.Plain())
        dist.destroy_process_group()
    tol = 0.0 if dtype == torch.float32 else 2e-2
    ok = v["early"] and v["rel_err"] <= tol
    fig = "; ".join(f"{m} {r['rows']} rows: landing {r['landing_ms']:.3f} ms, dense {r['dense_ms']:.3f} -> "
                    f"{r['dense_with_landing_ms']:.3f} ms beside it (overlap cost {r['landing_overlap']:.2f})"
                    for m, r in overlap.items())
    return {"passed": bool(ok), "values": v, "overlap": overlap,
            "landing_overlap": max((r["landing_overlap"] for r in overlap.values()), default=None),
            "line": f"gradient returned from the fused backward, landed on its stream before the gate on {backend}: "
                    f"{'early' if v['early'] else 'NOT early'}, worst relative error {v['rel_err']:.1e}"
                    + (f"; {fig}" if fig else "")}
