#!/usr/bin/env python
"""Measure the device costs the cluster simulator needs; torch only (stock PyTorch >= 2.11).

On one GPU (bf16) or on CPU (fp32 by default): SwiGLU grouped GEMMs (``torch._grouped_mm``,
three matmuls) forward and backward for the real expert shapes vs tokens per expert and
experts per rank; pinned host-to-device and device-to-device copies alone and while
grouped GEMMs run on another stream (the slow-down of each); a dense matmul's achieved
TFLOP/s. Every point is the median of --repeats timings, with min and max. Inter-GPU
links cannot be measured on one GPU: the JSON carries public NVLink / InfiniBand figures.

    python scripts/calibrate_gpu.py --out calibrations/h100_measured.json
    python scripts/calibrate_gpu.py --device cpu --shape 128x256 --out /tmp/cpu_cal.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F

# Expert shapes (dim x moe hidden) of the simulator's models; kept here so the script needs torch only.
SHAPES = {"gpt_oss_20b": (2880, 2880), "qwen3_30b_a3b": (2048, 768), "deepseek_v3": (7168, 2048)}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
EXPERTS = [1, 2, 4, 8, 16, 32]
PUBLIC_LINKS = {"nvlink_GBps": 360.0, "ib_GBps": 45.0, "a2a_latency_us": 25.0,
                "source": "public figures: NVLink 4 450 GB/s per direction x 0.8, NDR 400 Gb/s per GPU x 0.9"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--models", default=",".join(SHAPES), help="expert shapes of these models")
    p.add_argument("--shape", action="append", default=[], help="extra expert shape DIMxHIDDEN (repeatable)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens per expert grid")
    p.add_argument("--experts", default=",".join(map(str, EXPERTS)), help="experts per rank grid")
    p.add_argument("--max-rows", type=int, default=1 << 17, help="skip points with more rows (k * n) than this")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--copy-mb", type=float, default=64.0, help="bytes per copy for the copy timings")
    p.add_argument("--matmul-n", type=int, default=None, help="dense matmul size (default 8192 GPU, 1024 CPU)")
    p.add_argument("--a2a-overhead", action="store_true",
                   help="time an all-to-all launch on a world-size-1 process group (gloo on CPU, nccl on GPU)")
    p.add_argument("--clock", default="wall", choices=["wall", "thread"],
                   help="CPU only: 'thread' times the calling thread's CPU time (time.thread_time, one intra-op thread), "
                        "as bench_moe_runtime.py's expert_cpu_ms_straggler, immune to other processes on the cores")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    a.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    shapes = {}
    for m in [x for x in a.models.split(",") if x]:
        if m not in SHAPES:
            p.error(f"unknown model {m!r}; choose from {sorted(SHAPES)}")
        shapes[m] = SHAPES[m]
    for s in a.shape:
        try:
            d, h = (int(x) for x in s.lower().split("x"))
        except ValueError:
            p.error(f"--shape {s!r} must be DIMxHIDDEN")
        shapes[f"custom_{d}x{h}"] = (d, h)
    a.shapes = shapes
    a.token_grid = sorted({int(x) for x in a.tokens.split(",") if x})
    a.expert_grid = sorted({int(x) for x in a.experts.split(",") if x})
    if len(a.token_grid) < 2 or a.repeats < 1 or not a.expert_grid:
        p.error("need >= 2 token points, >= 1 expert point and --repeats >= 1")
    return a


class Timer:
    """Time of a callable: CUDA events on GPU, perf_counter (or the thread's CPU time) on CPU."""

    def __init__(self, device: str, clock: str = "wall"):
        self.cuda = device == "cuda"
        self.now = time.thread_time if clock == "thread" and not self.cuda else time.perf_counter

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn, repeats: int) -> list[float]:
        fn()  # warm-up
        self.sync()
        out = []
        for _ in range(repeats):
            if self.cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                out.append(s.elapsed_time(e))
            else:
                t0 = self.now()
                fn()
                out.append((self.now() - t0) * 1e3)
        return out


def stats(ms: list[float]) -> dict:
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms)}


def swiglu(x, w1, w2, w3, offs):
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)) * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


def grouped_curve(dim, hidden, a, timer, dtype, dev) -> dict:
    K, N = a.expert_grid, a.token_grid
    fwd = [[None] * len(N) for _ in K]
    bwd = [[None] * len(N) for _ in K]
    spread = [[None] * len(N) for _ in K]
    for i, k in enumerate(K):
        w1 = torch.randn(k, hidden, dim, device=dev, dtype=dtype, requires_grad=True)
        w3 = torch.randn(k, hidden, dim, device=dev, dtype=dtype, requires_grad=True)
        w2 = torch.randn(k, dim, hidden, device=dev, dtype=dtype, requires_grad=True)
        for j, n in enumerate(N):
            if k * n > a.max_rows:
                continue
            x = torch.randn(k * n, dim, device=dev, dtype=dtype, requires_grad=True)
            offs = torch.arange(1, k + 1, device=dev, dtype=torch.int32) * n
            g = torch.randn(k * n, dim, device=dev, dtype=dtype)
            f = timer(lambda: swiglu(x, w1, w2, w3, offs), a.repeats)

            def fb():
                swiglu(x, w1, w2, w3, offs).backward(g)
            fb_ms = timer(fb, a.repeats)
            b = [max(t - statistics.median(f), 0.0) for t in fb_ms]  # backward alone
            fwd[i][j], bwd[i][j] = statistics.median(f), statistics.median(b)
            spread[i][j] = {"fwd": stats(f), "fwd_bwd": stats(fb_ms)}
        _fill_missing(fwd[i], N)
        _fill_missing(bwd[i], N)
    return {"dim": dim, "hidden": hidden, "dtype": str(dtype).replace("torch.", ""), "experts_per_rank": K,
            "tokens_per_expert": N, "fwd_ms": fwd, "bwd_ms": bwd, "spread": spread}


def _fill_missing(row, N):
    """Points skipped for size: extrapolate linearly in tokens from the last two measured."""
    have = [j for j, v in enumerate(row) if v is not None]
    if not have:
        raise SystemExit("no grouped-GEMM point fits --max-rows; raise it or shrink the grids")
    for j in range(len(row)):
        if row[j] is None:
            if len(have) == 1:
                row[j] = row[have[0]] * N[j] / N[have[0]]
            else:
                j0, j1 = have[-2], have[-1]
                slope = (row[j1] - row[j0]) / (N[j1] - N[j0])
                row[j] = row[j1] + slope * (N[j] - N[j1])


def copies(a, timer, dtype, dev, shape) -> dict:
    """Copy bandwidths alone and concurrent with grouped GEMMs (other stream / thread on CPU)."""
    n = int(a.copy_mb * 2**20) // 4
    cuda = dev == "cuda"
    host = torch.empty(n, dtype=torch.float32, pin_memory=cuda)
    d_src = torch.empty(n, dtype=torch.float32, device=dev)
    d_dst = torch.empty(n, dtype=torch.float32, device=dev)
    nbytes = n * 4
    h2d = lambda: d_dst.copy_(host, non_blocking=cuda)  # noqa: E731
    d2d = lambda: d_dst.copy_(d_src)  # noqa: E731
    dim, hidden = shape
    k, tok = 4, 512 if cuda else 64
    w = [torch.randn(k, hidden, dim, device=dev, dtype=dtype), torch.randn(k, dim, hidden, device=dev, dtype=dtype),
         torch.randn(k, hidden, dim, device=dev, dtype=dtype)]
    x = torch.randn(k * tok, dim, device=dev, dtype=dtype)
    offs = torch.arange(1, k + 1, device=dev, dtype=torch.int32) * tok
    gemm = lambda: swiglu(x, w[0], w[1], w[2], offs)  # noqa: E731
    out = {"bytes": nbytes}
    g_alone = statistics.median(timer(gemm, a.repeats))
    for name, fn in (("h2d", h2d), ("d2d", d2d)):
        alone = timer(fn, a.repeats)
        both = []  # copies on a side stream / thread while GEMMs run; time the GEMM loop and the copy
        reps = max(1, int(round(statistics.median(alone) / max(g_alone, 1e-6))))
        for _ in range(a.repeats):
            t_copy = []
            if cuda:
                side = torch.cuda.Stream()
                timer.sync()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                cs, ce = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(side):
                    cs.record(side)
                    fn()
                    ce.record(side)
                s.record()
                for _ in range(reps):
                    gemm()
                e.record()
                torch.cuda.synchronize()
                both.append((s.elapsed_time(e) / reps, cs.elapsed_time(ce)))
            else:
                th = threading.Thread(target=lambda: t_copy.append(timer(fn, 1)[0]))
                t0 = time.perf_counter()
                th.start()
                for _ in range(reps):
                    gemm()
                g = (time.perf_counter() - t0) * 1e3 / reps
                th.join()
                both.append((g, t_copy[0]))
        g_conc = statistics.median(b[0] for b in both)
        c_conc = statistics.median(b[1] for b in both)
        out[name] = {"alone_ms": stats(alone), "GBps": nbytes / statistics.median(alone) / 1e6,
                     "concurrent_GBps": nbytes / c_conc / 1e6, "gemm_alone_ms": g_alone, "gemm_concurrent_ms": g_conc,
                     "gemm_slowdown": g_conc / g_alone - 1.0, "copy_slowdown": c_conc / statistics.median(alone) - 1.0}
    return out


def dense(a, timer, dtype, dev) -> dict:
    n = a.matmul_n or (8192 if dev == "cuda" else 1024)
    x = torch.randn(n, n, device=dev, dtype=dtype)
    y = torch.randn(n, n, device=dev, dtype=dtype)
    ms = timer(lambda: x @ y, a.repeats)
    tf = [2 * n**3 / (t * 1e-3) / 1e12 for t in ms]
    return {"dtype": str(dtype).replace("torch.", ""), "shape": [n, n, n], "achieved_tflops": statistics.median(tf),
            "spread_tflops": [min(tf), max(tf)]}


def a2a_overhead(a, timer, dev) -> float:
    import os
    import tempfile

    import torch.distributed as dist

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl" if dev == "cuda" else "gloo", store=store, rank=0, world_size=1)
    try:
        x = torch.ones(1024, device=dev)
        y = torch.empty_like(x)
        return statistics.median(timer(lambda: dist.all_to_all_single(y, x), max(a.repeats, 10))) * 1e3
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    a = parse_args(argv)
    dev = a.device
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    if a.clock == "thread" and dev == "cpu":
        torch.set_num_threads(1)  # the thread clock sees only this thread's work
    timer = Timer(dev, a.clock)
    name = torch.cuda.get_device_name() if dev == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    t0 = time.time()
    res = {"kind": "measured", "device": name, "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv), "repeats": a.repeats, "clock": a.clock if dev == "cpu" else "cuda_events"}
    res["dense_matmul"] = dense(a, timer, dtype, dev)
    res["grouped_mm"] = {}
    for m, (d, h) in a.shapes.items():
        print(f"grouped_mm {m} {d}x{h} ...", flush=True)
        res["grouped_mm"][f"{d}x{h}"] = grouped_curve(d, h, a, timer, dtype, dev) | {"model": m}
    c = copies(a, timer, dtype, dev, next(iter(a.shapes.values())))
    res["copies_detail"] = c
    res["copies"] = {"h2d_pinned_GBps": c["h2d"]["GBps"], "d2d_GBps": c["d2d"]["GBps"],
                     "gemm_slowdown_with_h2d": max(c["h2d"]["gemm_slowdown"], 0.0),
                     "gemm_slowdown_with_d2d": max(c["d2d"]["gemm_slowdown"], 0.0)}
    res["links"] = dict(PUBLIC_LINKS)
    if a.a2a_overhead:
        res["links"]["a2a_launch_us_world1"] = a2a_overhead(a, timer, dev)
    res["wall_s"] = time.time() - t0
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"dense {res['dense_matmul']['achieved_tflops']:.2f} TFLOP/s, h2d {c['h2d']['GBps']:.1f} GB/s, "
          f"d2d {c['d2d']['GBps']:.1f} GB/s, gemm slowdown h2d {c['h2d']['gemm_slowdown']:+.3f} "
          f"d2d {c['d2d']['gemm_slowdown']:+.3f}; wrote {a.out} in {res['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
