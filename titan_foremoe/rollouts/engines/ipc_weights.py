"""The policy's weights into a colocated vLLM engine by IPC handles (``[rollout_engine] weight_sync = "ipc"``).

Colocated: the engine's workers run on GPUs of the trainer's first node (rank 0's: the engine rank 0 launches, or
a user-run one there). vLLM's ``ipc`` backend (``vllm_api``: the same worker side in 0.28-0.33) takes, per packed
bucket, one handle per GPU UUID and each worker rebuilds only the handle under its own GPU's UUID, on its own
device: every GPU that hosts a worker must hold the whole bucket itself (a handle keyed by another GPU is refused),
and the bucket must stay valid until ``/update_weights`` returns (the workers clone the tensors out of it first).

So per bucket (``weight_buckets.BucketStream``: the same plan, pack and gathers as the NCCL path): rank 0 gathers
the bucket's state-dict entries (``gather_to``: every slice once, in two hops over rail groups when the trainer
spans nodes) and packs it; it broadcasts the packed bucket to the other ranks of its node over NVLink
(``node``: a group of the IPC sync's own, since this runs on ``sync_buckets``' send thread while the main thread
gathers the next bucket over the rails' groups and the world); every rank of the node exports its copy (``share``: a CUDA IPC handle; on CPU the same bytes in
shared memory, ``file_system`` strategy, for the stand-in engine) and hands the handle to rank 0 (a gather of
small objects); rank 0 posts them in one ``/update_weights``. Rank 0's word after each bucket (``weight_buckets.go``)
moves every rank on (the engine has cloned the bucket out), or stops them all at the same bucket. Each GPU
receives into one buffer of the largest bucket's size, exported once per sync (vLLM's producer does the same: its
workers then open one mapping per sync), freed after the sync.

Cost at Qwen3-30B-A3B (61 GB bf16, 113 buckets of 512 MiB, 579 entries), R = 64, engine on node 0 (n = 8):
rank 0 receives 60 GB (the model less its slice: 6.7 GB per node-0 NIC over IB, the rest NVLink) and sends 61 GB
to its node; every other node-0 rank receives 61 GB over NVLink (vLLM's receiver: every worker's GPU holds every
bucket); the other ranks send their ~1 GB of slices and receive nothing. Collectives: two per entry, three per
bucket (broadcast, handle all-gather, go); engine calls: one per bucket plus four; one NCCL communicator more per
node-0 GPU (the node group). Memory beyond the model: rank 0
the bucket's entries, its packed copy and the exported buffer (3 x 0.71 GB + the 0.62 GB embedding at most), the
others the buffer (0.71 GB: the largest bucket, which closes on the tensor that takes it past 512 MiB).
``sync_cost.colocated_ipc_cost`` charges exactly this, the gathers beside the chain of node broadcasts, posts and
the engine's load (modelled 0.86 s with stacked experts, docs/rollouts_vllm.md).

Legend: meta = (HF name, dtype name, shape); key = a GPU's UUID (``cuda``) or ``cpu:<rank>``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ...distributed import collectives
from ...distributed.ipc_alloc import ipc_shareable
from .errors import EngineError
from .vllm_api import ipc_init_info, ipc_update_info
from .vllm_weights import NCCLWeightSender, ParamMeta
from .weight_buckets import Bucket, BucketStream, go, nbytes, sync_buckets


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
    """Rank 0's side of vLLM's IPC transfer, driven by ``sync_ipc``: ``start`` (``/start_weight_update``), one
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
    """Rank 0 and the other ranks of its node (``node``: their group; None on one rank): each bucket broadcast from
    rank 0 over the node into every rank's one buffer (the size of the largest bucket, exported once per sync as
    vLLM's own producer does: the workers open it once and read each bucket's first bytes), each rank's handle
    gathered to rank 0. Rank 0 wraps the sender (``sync_buckets`` calls its ``send_bucket``), the others act as
    ``sync_buckets``' relay (``receive``). A bucket is overwritten only after rank 0's go (the engine has cloned
    the previous one); ``release`` drops the buffer after the sync."""

    def __init__(self, node, rank: int, sender: IPCSender | None = None, device: torch.device | None = None):
        self.node, self.rank, self.poster, self.device = node, rank, sender, device
        self.buffer: torch.Tensor | None = None
        self.handle: tuple | None = None  # (key, handle) of ``buffer``, or (None, why it could not be exported)
        self.peak_bytes = 0  # the largest buffer held (tests: memory beyond the model)

    sender = 0
    """As ``sync_buckets``' relay: the sender group whose buckets it takes part in (the one source, rank 0)."""

    @property
    def group(self):
        """As ``sync_buckets``' relay: the node group (its ``device``, if any, is where the receive works)."""
        return self.node

    def prepare(self, stream: BucketStream) -> None:
        """Every node rank, before the first bucket: the buffer for the largest bucket of ``stream``'s plan, exported."""
        size = max((sum(nbytes(m) for m in b) for b in stream.buckets), default=0)
        with ipc_shareable(self.device):  # no pidfd_getfd needed by the engine (distributed/ipc_alloc.py)
            self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device or "cpu")
        self.peak_bytes = max(self.peak_bytes, size)
        try:
            self.handle = (device_key(self.buffer), share(self.buffer))
        except Exception as e:  # noqa: BLE001 - rank 0 refuses the first bucket, naming it
            self.handle = (None, f"rank {self.rank}: {type(e).__name__}: {e}")

    def release(self) -> None:
        self.buffer = self.handle = None

    def _exchange(self, size: int) -> list | None:
        """Broadcast (from rank 0) into the buffer's first ``size`` bytes, gather every node rank's handle to rank 0
        (small objects; the same every bucket)."""
        if self.node is not None:
            collectives.broadcast(self.buffer[:size], src=0, group=self.node)
        if self.buffer.is_cuda:  # the bytes are in place before the engine reads them: the export's event was
            torch.cuda.current_stream(self.buffer.device).synchronize()  # recorded once, at ``prepare`` (vLLM's
            # producer drains its stream before each chunk the same way)
        if self.node is None:
            return [self.handle]
        got = collectives.all_gather_objects(self.handle, group=self.node)  # small: one handle a GPU
        return got if self.rank == 0 else None

    # rank 0 (the sender side)
    def send_bucket(self, flat: torch.Tensor, index: int, metas: list[ParamMeta]) -> None:
        self.buffer[: flat.numel()].copy_(flat)
        self.poster.handles = self._exchange(flat.numel())
        self.poster.send_bucket(self.buffer, index, metas)

    def begin(self, meta, buckets):
        self.poster.begin(meta, buckets)

    def end(self, weight_version=None):
        self.poster.end(weight_version)

    def abort(self):
        self.poster.abort()

    # the other ranks of the node (the relay side)
    def receive(self, bucket: Bucket) -> None:
        self._exchange(sum(nbytes(m) for m in bucket.metas))


def sync_ipc(stream: BucketStream, rank: int, node: IPCNode | None, weight_version: str | None = None) -> str | None:
    """Collective over every trainer rank: one weight update (module docstring). ``node``: this rank's
    ``IPCNode`` (rank 0 and its node's ranks; None on other nodes). Rank 0 starts the update and every rank
    agrees on it before the first bucket (a refused start stops everyone there); returns this rank's error in one
    line (None: ok)."""
    err = None
    if rank == 0:
        try:
            node.poster.start()
        except Exception as e:  # noqa: BLE001 - reported by the caller on every rank
            err = f"{type(e).__name__}: {e}"
    try:
        ok = go(err is None, 0)
    except Exception as e:  # noqa: BLE001 - a rank is gone before the first bucket
        return f"{type(e).__name__} in a weight-sync collective (a trainer rank gone?): " + \
            (str(e).strip().splitlines() or [""])[0]
    if not ok:
        if node is not None and node.poster is not None:
            node.poster.abort()
        return err or "stopped by the failure of rank 0 (a source)"
    if node is not None:
        node.prepare(stream)
    try:
        return sync_buckets(stream, rank, sender=node if rank == 0 else None,
                            relay=node if rank != 0 else None, weight_version=weight_version)
    finally:
        if node is not None:
            node.release()
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()  # the engine has released the exported copies
