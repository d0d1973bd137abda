"""A stand-in for vLLM's IPC weight transfer (``ipc`` backend): its HTTP routes and its workers' receive, on CPU.

Run as its own process (``python tests/vllm_ipc_standin.py --workers cpu:0,cpu:1 --port-file F``), as vLLM's
engine is: the handles it opens come from other processes. It does what vLLM 0.28-0.33's
``IPCWeightTransferEngine`` does (``titan_foremoe/rollouts/engines/vllm_api.py``): ``/init_weight_transfer_engine``
takes ``{"init_info": {"packed"}}``; ``/update_weights`` takes ``{"update_info"}`` with ``names``, ``dtype_names``,
``shapes``, ``tensor_sizes`` and ``ipc_handles_pickled`` (base64 pickle of {key: handle}); every worker looks up its
own key (a missing one is refused, as vLLM's ``ValueError``), opens the handle (once per export, kept until
``/finish_weight_update``: vLLM's ``PackedBufferImporter``), splits the first
``sum(tensor_sizes)`` bytes by ``tensor_sizes`` and clones each tensor out (``packed_ipc_consumer``). On CPU the
handle is the CPU form of ``ipc_weights.share``: ``(rebuild_storage_filename, args)``, a shared-memory segment; a
worker keyed by a GPU UUID opens a CUDA handle as vLLM's worker does (``open_handle``: the GPU check's
``fleet_ipc`` stage).
Unknown request fields are refused (vLLM's dataclasses raise on them). ``GET /standin/state``: the buckets'
names, each tensor's dtype, shape and SHA-256 as loaded (every worker's copy must agree), the calls made.
``--die-at B`` (or ``POST /standin/die_at {"bucket": B}``: B buckets from now): the process exits at that
bucket (an engine dying mid-sync). ``/collective_rpc`` ``install_fused_expert_load`` stands for our worker
extension (``vllm_fused_load``): stacked experts under vLLM's fused names (``gate_up_proj`` [E, 2F, D],
``down_proj`` [E, D, F]) are then recorded as the per-expert HF tensors they hold (their digests: the same
checkpoint's), and ``fused`` counts them.

Sleep mode as vLLM 0.28-0.32 serve it (``rollouts/fleet/sleep.py``): ``POST /sleep?level=L`` (0: the scheduler
paused; 1: weights kept on the host, KV dropped; 2: both dropped, so the loaded tensors' digests are forgotten
until they are sent again), ``POST /wake_up?tags=weights&tags=kv_cache`` (none: all; a tag not asleep, or an
engine not asleep, is a no-op as vLLM's warning), ``GET /is_sleeping``. An ``/update_weights`` while the weights
are asleep is refused (vLLM would write into unmapped memory), and so is ``POST /standin/serve`` (a stand-in for
a generate or probe request) while anything sleeps (vLLM would queue it until the wake). Every call is recorded
with its query (``calls``), so the order can be checked.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import pickle
import sys
import threading
from urllib.parse import parse_qs, urlsplit

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sglang_standin import http_server  # noqa: E402

UPDATE_FIELDS = {"names", "dtype_names", "shapes", "ipc_handles", "ipc_handles_pickled", "tensor_sizes"}


def open_handle(handle, key: str) -> torch.Tensor:
    """A worker's opening of its GPU's handle, as vLLM's ``packed_ipc_consumer``: ``key`` a GPU UUID, the
    ``rebuild_cuda_tensor`` args with the device index (position 6) set to the device of that UUID here;
    ``cpu:<rank>``, the shared-memory segment ``(rebuild_storage_filename, args)`` of ``ipc_weights.share``."""
    if key.startswith("cpu:"):
        fn, args = handle
        return torch.empty(0, dtype=torch.uint8).set_(fn(*args))
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = next(i for i in range(torch.cuda.device_count())
                 if str(torch.cuda.get_device_properties(i).uuid) == key)
    args = list(handle)
    args[6] = index
    return rebuild_cuda_tensor(*args)


class IPCStandIn:
    def __init__(self, workers: list[str], die_at: int | None = None):
        self.workers, self.die_at = workers, die_at
        self.lock = threading.Lock()
        self.packed = None
        self.calls: list[str] = []
        self.buckets: list[list[str]] = []
        self.digests: dict[str, list] = {}
        self.fused_installed, self.fused = False, 0
        self.asleep: set[str] = set()  # the pools asleep ("weights", "kv_cache"), vLLM's executor.sleeping_tags
        self.paused = False  # the scheduler (sleep level 0 or any pool asleep)
        self.mapped: dict[str, tuple] = {}  # worker key -> (handle, its buffer): one open per export, as vLLM's
        # PackedBufferImporter (a handle's export pairs with one open; released at finish)

    def update(self, info: dict) -> tuple[int, dict]:
        extra = set(info) - UPDATE_FIELDS
        if extra or not self.packed or info.get("tensor_sizes") is None or "ipc_handles_pickled" not in info:
            return 400, {"error": f"bad update_info (fields {sorted(info)}, packed {self.packed})"}
        if "weights" in self.asleep:
            return 500, {"error": "update_weights while the weights sleep (vLLM: an illegal memory access)"}
        if self.die_at is not None and len(self.buckets) == self.die_at:
            os._exit(3)  # the engine dies mid-sync
        handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
        sizes = [int(n) for n in info["tensor_sizes"]]
        per_worker = []
        for key in self.workers:
            if key not in handles:
                return 500, {"error": f"IPC handle not found for GPU UUID {key}. Available UUIDs: {list(handles)}"}
            if key not in self.mapped or self.mapped[key][0] != handles[key]:
                self.mapped[key] = (handles[key], open_handle(handles[key], key))
            flat = self.mapped[key][1][: sum(sizes)]
            per_worker.append([(n, p.view(getattr(torch, d)).view(s).clone()) for n, d, s, p in zip(
                info["names"], info["dtype_names"], info["shapes"], flat.split(sizes))])
        per_worker = [self.unstack(w) for w in per_worker]
        for name, t in per_worker[0]:
            copies = {hashlib.sha256(w[i][1].view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
                      for w in per_worker for i in range(len(w)) if w[i][0] == name}
            if len(copies) != 1:
                return 500, {"error": f"workers disagree on {name}"}
            self.digests[name] = [str(t.dtype).removeprefix("torch."), list(t.shape), copies.pop()]
        self.buckets.append(list(info["names"]))
        return 200, {}

    def unstack(self, tensors: list) -> list:
        """Stacked experts as the per-expert HF tensors they hold (what the extension's loader takes apart)."""
        out = []
        for name, t in tensors:
            head, _, kind = name.rpartition(".mlp.experts.")
            if kind not in ("gate_up_proj", "down_proj") or not self.fused_installed:
                out.append((name, t))
                continue
            self.fused += 1
            F = t.shape[1] // 2
            for e in range(t.shape[0]):
                pre = f"{head}.mlp.experts.{e}."
                if kind == "down_proj":
                    out.append((pre + "down_proj.weight", t[e].contiguous()))
                else:
                    out += [(pre + "gate_proj.weight", t[e, :F].contiguous()),
                            (pre + "up_proj.weight", t[e, F:].contiguous())]
        return out

    def sleep_routes(self, path: str, query: dict) -> tuple[int, object]:
        """vLLM's ``/sleep``, ``/wake_up``, ``/is_sleeping`` (``EngineCore`` and ``Executor`` semantics)."""
        if path == "/is_sleeping":
            return 200, {"is_sleeping": self.paused or bool(self.asleep)}
        if path == "/sleep":
            level = int((query.get("level") or ["1"])[0])
            self.paused = True
            if level >= 1 and not self.asleep:  # an executor already asleep: a warning, nothing done
                self.asleep = {"weights", "kv_cache"}
                if level == 2:
                    self.digests.clear()  # the weights are gone: only a new full sync defines them
            return 200, ""
        tags = query.get("tags") or None
        if tags is None or not set(tags) - self.asleep:  # vLLM skips the whole call on a tag not asleep
            self.asleep -= set(tags or ("weights", "kv_cache"))
        if not self.asleep:
            self.paused = False
        return 200, ""

    def handle(self, method: str, path: str, body: dict) -> tuple[int, object]:
        with self.lock:
            self.calls.append(path)
            url = urlsplit(path)
            path, query = url.path, parse_qs(url.query)
            if path in ("/sleep", "/wake_up", "/is_sleeping"):
                return self.sleep_routes(path, query)
            if path == "/standin/serve":
                if self.paused or self.asleep:
                    return 503, {"error": f"a request while the engine sleeps ({sorted(self.asleep)})"}
                return 200, {}
            if path == "/health":
                return 200, {}
            if path == "/version":
                return 200, {"version": "0.28.0"}
            if path == "/standin/die_at":  # arm a death: the process exits at that bucket of the next update
                self.die_at = len(self.buckets) + int(body["bucket"])
                return 200, {}
            if path == "/standin/state":
                return 200, {"buckets": self.buckets, "digests": self.digests, "calls": self.calls,
                             "fused": self.fused}
            if path == "/collective_rpc" and body.get("method") == "install_fused_expert_load":
                self.fused_installed = True
                return 200, {"results": [1] * len(self.workers)}
            if path == "/init_weight_transfer_engine":
                info = body.get("init_info") or {}
                if set(info) - {"packed"}:
                    return 400, {"error": f"unknown init_info fields {sorted(set(info) - {'packed'})}"}
                self.packed = bool(info.get("packed"))
                return 200, {}
            if path == "/finish_weight_update":
                self.mapped.clear()
            if path in ("/start_weight_update", "/finish_weight_update", "/reset_prefix_cache"):
                return 200, {}
            if path == "/update_weights":
                return self.update(body.get("update_info") or {})
        return 404, {"detail": "Not Found"}

    def serve(self):
        return http_server(self.handle)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", required=True, help="the keys of the GPUs its workers run on, comma-separated")
    p.add_argument("--port-file", required=True)
    p.add_argument("--die-at", type=int, default=None)
    a = p.parse_args(argv)
    torch.multiprocessing.set_sharing_strategy("file_system")
    httpd = IPCStandIn(a.workers.split(","), a.die_at).serve()
    with open(a.port_file + ".tmp", "w") as f:
        f.write(str(httpd.server_address[1]))
    os.replace(a.port_file + ".tmp", a.port_file)
    httpd.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
