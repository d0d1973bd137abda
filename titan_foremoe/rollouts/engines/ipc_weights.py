"""The policy's weights into the colocated vLLM engines by IPC handles (``[rollout_engine] weight_sync = "ipc"``).

Colocated: engine k's workers run on the GPUs of its block (``fleet.layout.engine_layout(colocated=True)``: ``g``
consecutive GPUs inside one node, its source the block's first rank, which launched it). vLLM's ``ipc`` backend
(``vllm_api``: the same worker side in 0.28-0.33) takes, per packed bucket, one handle per GPU UUID and each worker
rebuilds only the handle under its own GPU's UUID, on its own device: every GPU that hosts a worker must hold the
whole bucket itself, and the bucket must stay valid until ``/update_weights`` returns (the workers clone the
tensors out of it first; vLLM's ``PackedBufferImporter`` keeps one mapping per export, so each GPU exports one
buffer per sync and every bucket is written into it).

So every node's engines are fed from their own node's GPUs, all at once (``sync_ipc``): every rank gets each
state-dict entry whole (``vllm_weights.all_gather_full``: an all-gather over its rail, so each slice crosses into
every other node once, over that node's NIC of its rail, then over its node's NVLink) and packs the bucket
(``weight_buckets.BucketStream(everywhere=True)``: the same plan as the NCCL path); once the engines have cloned
the previous bucket, every rank copies the bucket into its exported buffer, and once every copy is in place each
engine's source posts its block's handles (gathered once per sync) in one ``/update_weights``. Two one-int
all-reduces per bucket carry that order and stop every rank at the same bucket after any failure (the lowest
failing rank named). Every collective runs on the calling thread, in one order on every rank; the sources' HTTP
posts run on a thread of their own, beside the next bucket's gathers (no relay thread, no device stream of its
own, no node broadcast beside the gathers: issue 45's risk of two threads issuing NCCL collectives over
overlapping ranks in different orders is gone by construction).

Cost at Qwen3-30B-A3B (61 GB bf16, 113 buckets of 512 MiB, 579 entries), R = 64, an engine of 8 GPUs per node:
every rank receives 60 GB (the model less its slice): 6.7 GB of it over its NIC (its rail's slices of the other
7 nodes, M / 8 x 7 / 8), the rest over NVLink, and sends as much (ring all-gathers). The sync is the engines'
chain, modelled 0.66 s (113 posts and the stacked-expert load; the gathers 0.17 s beside it) at R = 64, 256 and
1024 alike (H100 links, ``tests/test_weight_sync_cost.py``'s setting); the NIC bytes grow to 7.6 GB at 1024.
Collectives: three per entry (header, rail, node all-gathers), two per bucket, one handle gather per sync; engine
calls: one per bucket and engine plus four. Memory beyond the model, every rank: the entry being gathered (at
most the 0.62 GB embedding, padded), its packed bucket and the exported buffer (2 x 0.71 GB: the largest bucket,
which closes on the tensor that takes it past 512 MiB): 1.9 GiB. ``sync_cost.colocated_ipc_cost`` charges exactly
this, the gathers beside the chain of posts and the engines' load, the same for any number of nodes.

Legend: meta = (HF name, dtype name, shape); key = a GPU's UUID (``cuda``) or ``cpu:<rank>``; g GPUs per engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ...distributed import collectives, groups
from ...distributed.ipc_alloc import ipc_shareable
from .errors import EngineError
from .vllm_api import ipc_init_info, ipc_update_info
from .vllm_weights import NCCLWeightSender, ParamMeta
from .weight_buckets import BucketStream, nbytes


def device_key(t: torch.Tensor) -> str:
    """The key vLLM's worker looks its handle up by: its physical GPU's UUID; ``cpu:<rank>`` on CPU."""
    if t.is_cuda:
        return str(torch.cuda.get_device_properties(t.device.index).uuid)
    return f"cpu:{dist.get_rank() if dist.is_initialized() else 0}"


def share(flat: torch.Tensor) -> tuple:
    """A handle of ``flat`` another process on this node opens without a copy: CUDA, ``reduce_tensor``'s
    ``rebuild_cuda_tensor`` args (vLLM's form); CPU, ``(rebuild_storage_filename, args)`` of its storage moved to
    shared memory (the ``file_system`` strategy: a named segment, picklable). The caller keeps ``flat`` alive
    until the engine has read it."""
    from torch.multiprocessing import reductions

    if flat.is_cuda:
        return reductions.reduce_tensor(flat)[1]
    import torch.multiprocessing as mp

    if mp.get_sharing_strategy() != "file_system":
        mp.set_sharing_strategy("file_system")
    flat.share_memory_()
    return reductions.reduce_storage(flat.untyped_storage())


class IPCSender(NCCLWeightSender):
    """An engine source's side of vLLM's IPC transfer, driven by ``sync_ipc``: ``start`` (``/start_weight_update``), one
    ``/update_weights`` per bucket with every node GPU's handle of it, ``end`` (finish, prefix-cache reset: the
    NCCL sender's). ``post(path, body)``: the engine client's POST."""

    def __init__(self, post: Callable[[str, dict | None], object]):
        self.post, self.updates, self.group = post, 0, None
        self.init_info = ipc_init_info()
        self.handles: list | None = None  # this bucket's (key, handle) of every node rank, set by ``IPCNode``

    def init(self) -> None:
        self.post("/init_weight_transfer_engine", {"init_info": dict(self.init_info)})
        self.group = "ipc"  # no data-plane rendezvous: the handles travel in the HTTP calls

    def start(self) -> None:
        if self.group is None:
            raise EngineError("IPC weight sender used before init()")
        self.post("/start_weight_update", None)

    def begin(self, meta: list[ParamMeta], buckets: int) -> None:
        """``sync_buckets``' start: already done by ``start`` (agreed on every rank before the first bucket)."""

    def send_bucket(self, flat: torch.Tensor, index: int, metas: list[ParamMeta]) -> None:
        missing = [str(h) for k, h in self.handles if k is None]  # a rank that could not export its buffer
        if missing:
            raise EngineError(f"IPC weight sync: bucket {index} not exported on every GPU of the node: {missing[0]}")
        update = ipc_update_info([m.name for m in metas], [m.dtype for m in metas], [list(m.shape) for m in metas],
                                 dict(self.handles), [nbytes(m) for m in metas])
        self.post("/update_weights", {"update_info": update})  # returns once every worker has loaded the bucket

    def end(self, weight_version: str | None = None) -> None:
        self._finish(weight_version)

    def abort(self) -> None:
        pass


class IPCNode:
    """This rank's part of its engine's IPC transfer: the one buffer of the largest bucket's size every bucket is
    copied into (exported once per sync, as vLLM's own producer does: the workers open it once and read each
    bucket's first bytes), its handle, and on the engine's source the sender that posts every block GPU's handle.
    ``block``: the group of the engine's GPUs (the layout slot's ``members``; None for a one-GPU engine). A
    bucket is overwritten only after its source has said the engine cloned the previous one; ``release`` drops the
    buffer after the sync."""

    def __init__(self, block, rank: int, sender: IPCSender | None = None, device: torch.device | None = None):
        self.block, self.rank, self.poster, self.device = block, rank, sender, device
        self.buffer: torch.Tensor | None = None
        self.handle: tuple | None = None  # (key, handle) of ``buffer``, or (None, why it could not be exported)
        self.peak_bytes = 0  # the largest buffer held (tests: memory beyond the model)

    @property
    def is_source(self) -> bool:
        return self.poster is not None

    def prepare(self, stream: BucketStream) -> None:
        """Every block rank, before the first bucket: the buffer for the largest bucket of ``stream``'s plan,
        exported, and every block GPU's handle on the source (one small all-gather over the block, once a sync)."""
        size = max((sum(nbytes(m) for m in b) for b in stream.buckets), default=0)
        with ipc_shareable(self.device):  # no pidfd_getfd needed by the engine (distributed/ipc_alloc.py)
            self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device or "cpu")
        self.peak_bytes = max(self.peak_bytes, size)
        try:
            self.handle = (device_key(self.buffer), share(self.buffer))
        except Exception as e:  # noqa: BLE001 - the source refuses the first bucket, naming it
            self.handle = (None, f"rank {self.rank}: {type(e).__name__}: {e}")
        got = [self.handle] if self.block is None else collectives.all_gather_objects(self.handle, group=self.block)
        if self.poster is not None:
            self.poster.handles = got

    def fill(self, flat: torch.Tensor) -> None:
        """Bucket ``flat`` (this rank's own packed copy) into the exported buffer, in place before the engine reads
        it: on CUDA the copy's stream is drained (the export's event was recorded once, at ``prepare``; vLLM's
        producer drains its stream before each chunk the same way)."""
        self.buffer[: flat.numel()].copy_(flat)
        if self.buffer.is_cuda:
            torch.cuda.current_stream(self.buffer.device).synchronize()

    def release(self) -> None:
        self.buffer = self.handle = None


def ipc_node(layout, rank: int, world: int, device: torch.device | None = None) -> IPCNode | None:
    """Collective over the world, once: the block group of every colocated engine of ``layout``
    (``fleet.layout.engine_layout(colocated=True)``; the ranks no engine holds in groups of one) and this rank's
    ``IPCNode`` (None when no engine's block holds it). The engine's source sets ``poster`` once it has connected."""
    parts = [list(e.members) for e in layout.engines]
    held = {r for p in parts for r in p}
    parts += [[r] for r in range(world) if r not in held]
    group = groups.subgroups(parts) if world > 1 else None
    slot = next((e for e in layout.engines if rank in e.members), None)
    if slot is None:
        return None
    return IPCNode(group if len(slot.members) > 1 else None, rank, device=device)


def _stop_line(failed: int, sources: Sequence[int]) -> str:
    return f"stopped by the failure of rank {failed}" + (" (a source)" if failed in sources else "")


def _first_failed(err: str | None, rank: int) -> int:
    """Collective (one int all-reduce over the world): the lowest rank with an error, or -1."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rank if err is not None else -1
    world = dist.get_world_size()
    t = torch.tensor([world - rank if err is not None else 0], dtype=torch.int64)
    got = int(collectives.all_reduce(t, collectives.ReduceOp.MAX).item())
    return world - got if got else -1


def sync_ipc(stream: BucketStream, rank: int, node: IPCNode | None, weight_version: str | None = None,
             sources: Sequence[int] = (0,)) -> str | None:
    """Collective over every trainer rank: one weight update of every colocated engine at once (module
    docstring). ``stream``: built with ``everywhere=True`` (every rank packs every bucket); ``node``: this rank's
    ``IPCNode`` (None on a rank that hosts no engine worker); ``sources``: the engines' source ranks. Every
    collective runs on the calling thread, in the same order on every rank; only the sources' HTTP posts run on a
    thread of their own. Returns this rank's error in one line (None: ok)."""
    err, pool, pending = None, None, None
    is_src = node is not None and node.is_source
    if is_src:
        try:
            node.poster.start()
        except Exception as e:  # noqa: BLE001 - reported by the caller on every rank
            err = f"{type(e).__name__}: {e}"
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ipc-post")

    def wait() -> str | None:
        nonlocal pending
        done, pending = pending, None
        if done is None:
            return None
        try:
            done.result()
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None

    def agree() -> None:
        failed = _first_failed(err, rank)
        if failed >= 0:
            raise _Stop(err or _stop_line(failed, sources))

    try:
        agree()  # every start accepted before anything is gathered
        if node is not None:
            node.prepare(stream)
        for bucket in stream:  # the gathers of bucket b + 1 run while the engines load bucket b
            if bucket.problem and err is None:
                err = bucket.problem
            if is_src:
                err = err or wait()  # the engine has cloned the previous bucket out of the buffer
            agree()
            if node is not None:
                try:
                    node.fill(bucket.flat)
                except Exception as e:  # noqa: BLE001
                    err = f"{type(e).__name__}: {e}"
            agree()  # every block GPU holds the bucket: its source may post it
            if is_src:
                pending = pool.submit(node.poster.send_bucket, node.buffer, bucket.index, bucket.metas)
        if is_src:
            err = err or wait()
            if err is None:
                try:
                    node.poster.end(weight_version)
                except Exception as e:  # noqa: BLE001
                    err = f"{type(e).__name__}: {e}"
        return err
    except _Stop as e:
        return e.line
    except Exception as e:  # noqa: BLE001 - a collective failed under us (a rank died): one line, no agreement
        return f"{type(e).__name__} in a weight-sync collective (a trainer rank gone?): " + \
            (str(e).strip().splitlines() or [""])[0]
    finally:
        if pool is not None:
            pool.shutdown(wait=False)  # a post left hanging by a dead engine ends at its HTTP timeout
        if node is not None:
            if node.poster is not None:
                node.poster.abort()
            node.release()
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()  # the engine has released the exported copies


class _Stop(Exception):
    def __init__(self, line: str):
        self.line = line
