"""The policy's weights in buckets, each gathered once to the rank that sends it (``sync_cost``'s bucketed design).

Every trainer rank walks the state dict in the same order (a collective pass, as ``HFWeightStream``); each entry
is gathered only to the source rank of its bucket (``gather_to``: every rank sends its slice, the others receive
nothing; in two hops over ``RailGroups`` when the trainer spans nodes, so each slice crosses nodes once and no NIC
carries the model), mapped to HF tensors there, and packed into uint8 buckets; vLLM's packed consumer and SGLang's
``flattened_bucket`` loader both read a bucket as the HF tensors' bytes back to back in order (``unpack``).

One sender (vLLM: its transfer group broadcasts from NCCL rank 0 only): every bucket from one source, closed by
vLLM's rule (``sync_cost.bucket_bounds``: on the tensor that takes it past ``bucket_bytes``). Several senders
(SGLang's named update groups, ``sync_cost.sender_groups``): buckets of whole entries (``entry_bucket_bounds``),
dealt round-robin to the groups' sources (``bucket_senders``), so each source gathers and sends ~M / S and each of
its relays receives ~M / S. A vLLM engine fleet runs the one-sender path: one transfer group holds every
engine's workers (``PackedNCCLSender`` with a post per engine, ``sync_cost``'s ``one_group``; a group per engine,
the cost model's ``per_engine``, is a row there only). Sends are pipelined: a source hands its bucket to a sender
thread (a side CUDA stream) and gathers the next while it travels, holding at most two buckets (it waits for its previous send first); a relay
receives the same way. Every rank knows each bucket's source and bounds from the metadata alone, so after each
bucket its source tells every rank whether it goes on (``go``: one small broadcast): a source that failed stops
everyone at the same bucket instead of leaving a relay in a broadcast that never comes.

Cost at Qwen3-30B-A3B (61 GB bf16, 18,867 tensors, 579 state-dict entries), 512 MiB buckets, 16 trainer GPUs:
one sender: 113 buckets, the source receives 60 GB over NVLink (the model less its own slice), each relay every
broadcast byte; four senders (SGLang's default): 146 buckets of whole entries, a source ~15.6 GB, a relay its
group's ~15.6 GB, a GPU of a source's node its rail's remote slices (< 1 GB), every other rank sends its ~1 GB of
slices and receives nothing (``sync_cost``). Two gathers per entry (a header all-gather of 2 x ndim int64, the
padded slices) and one go flag per bucket; memory on a source: the entry being gathered (at most the 0.62 GB
embedding, padded) plus two buckets (one packing, one in flight), each at most ``bucket_bytes`` + its last
tensor (with vLLM's fused expert tensors, ``HFWeightStream(fused=True)``: + a 0.81 GB ``gate_up_proj``, 2.7 GB).

Legend: meta = (HF name, dtype name, shape); b = buckets; S = sender groups.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .sync_cost import bucket_bounds, bucket_senders, entry_bucket_bounds
from .vllm_weights import EVERY_RANK, HFWeightStream, ParamMeta, RailGroups, group_device


def nbytes(m: ParamMeta) -> int:
    return math.prod(m.shape) * getattr(torch, m.dtype).itemsize


def plan(meta: list[ParamMeta], bucket_bytes: int) -> list[list[ParamMeta]]:
    """The buckets a pass yields, from the metadata alone (every rank, nothing gathered)."""
    bounds = bucket_bounds([nbytes(m) for m in meta], bucket_bytes) if meta else [0]
    return [meta[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A bucket: the tensors' bytes back to back (uint8)."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def unpack(flat: torch.Tensor, metas: list[ParamMeta]) -> list[tuple[str, torch.Tensor]]:
    """A bucket's tensors by HF name (views of ``flat``): the receiving side's reading of ``pack``."""
    parts = flat.split([nbytes(m) for m in metas])
    return [(m.name, p.view(getattr(torch, m.dtype)).view(m.shape)) for m, p in zip(metas, parts)]


@dataclass
class Bucket:
    index: int
    metas: list[ParamMeta]
    flat: torch.Tensor | None
    """The packed bytes on the source, None on the other ranks."""
    problem: str | None = None
    """The source's pass disagreed with the plan (its bytes would be split wrongly): not to be sent."""
    src: int = 0
    """The trainer rank that gathers and sends it."""
    sender: int = 0
    """Its sender group (the index into ``BucketStream.sources``)."""


class BucketStream:
    """``HFWeightStream``'s pass (``entries``) in buckets, each gathered to its source only (module docstring).
    ``src``: the source rank of each sender group (one int: one sender); ``everywhere``: each entry whole on every
    rank instead (``all_gather_full``: the colocated IPC sync, where every GPU holds every bucket). Every rank
    iterates it; ``go(ok, src)`` after each bucket is its source's word to every rank (the iteration stops where it
    says no)."""

    def __init__(self, stream: HFWeightStream, bucket_bytes: int, src: int | list[int] = 0,
                 rails: RailGroups | None = None, everywhere: bool = False):
        self.stream, self.bucket_bytes, self.rails = stream, int(bucket_bytes), rails
        self.sources = [src] if isinstance(src, int) else list(src)
        self.src = self.sources[0]
        entries = stream.entry_metadata()
        self.meta = [m for e in entries for m in e]
        if len(self.sources) == 1:
            self.buckets = plan(self.meta, self.bucket_bytes)
            self.bucket_sender = np.zeros(len(self.buckets), np.int64)
            self.entry_dst: int | list[int] = EVERY_RANK if everywhere else self.src  # ipc: every rank packs it
        else:  # whole entries per bucket: each entry gathered to one source
            bounds = entry_bucket_bounds([sum(nbytes(m) for m in e) for e in entries], self.bucket_bytes)
            self.buckets = [[m for e in entries[a:b] for m in e] for a, b in zip(bounds[:-1], bounds[1:])]
            self.bucket_sender = bucket_senders(len(self.buckets), len(self.sources))
            self.entry_dst = np.repeat([self.sources[k] for k in self.bucket_sender], np.diff(bounds)).tolist()

    def bucket_src(self, b: int) -> int:
        return self.sources[int(self.bucket_sender[b])]

    def __iter__(self) -> Iterator[Bucket]:
        """Buckets in order; on the source each checked against the plan (a mismatch would split the bytes
        differently on the two sides: an ``EngineError`` naming the tensor)."""
        from .errors import EngineError

        b, i, tensors, problem = 0, 0, [], None
        for metas, values in self.stream.entries(self.entry_dst, self.rails):
            for j, m in enumerate(metas):
                want = self.buckets[b][i] if b < len(self.buckets) and i < len(self.buckets[b]) else None
                if values is not None and m != want and problem is None:
                    problem = f"bucketed weight sync: tensor {m} where the plan has {want}"
                if values is not None:
                    tensors.append(values[j])
                i += 1
                if b < len(self.buckets) and i == len(self.buckets[b]):
                    flat = pack(tensors) if tensors and problem is None else None
                    yield Bucket(b, self.buckets[b], flat, problem, self.bucket_src(b), int(self.bucket_sender[b]))
                    b, i, tensors = b + 1, 0, []
        if b != len(self.buckets) or i:
            raise EngineError(f"bucketed weight sync: the pass made {b} buckets and {i} tensors, the plan "
                              f"{len(self.buckets)} buckets")


class _Pipe:
    """One send (or receive) in flight beside the gathers: ``put(fn, tensor)`` first waits for the previous one
    (at most two buckets held: the one travelling, the one being packed), then runs ``fn(tensor)`` on a worker
    thread, on a side CUDA stream that waits for the tensor's packing. Returns the previous one's error. After a
    failure its source's go flag stops every rank; a relay's receive left waiting ends at its group's timeout."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.pending: Future | None = None
        self.side = None

    def put(self, fn, tensor: torch.Tensor | None, device: torch.device | None = None) -> str | None:
        """``device``: where ``fn`` works when ``tensor`` is None (a relay's receive buffer). Nothing more is
        started after a failure."""
        err = self.wait()
        if err is not None:
            return err
        device = tensor.device if tensor is not None else device
        ready = None
        if device is not None and torch.device(device).type == "cuda":
            self.side = self.side or torch.cuda.Stream(device=device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))  # the bucket's packing (and the gathers) on that device
        self.pending = self.pool.submit(self._run, fn, tensor, ready)
        return err

    def _run(self, fn, tensor, ready) -> None:
        if ready is None:
            return fn(tensor)
        with torch.cuda.stream(self.side):
            self.side.wait_event(ready)
            if tensor is not None:
                tensor.record_stream(self.side)  # the caching allocator keeps it until the side stream is done
            fn(tensor)
            self.side.synchronize()

    def wait(self) -> str | None:
        done, self.pending = self.pending, None
        if done is None:
            return None
        try:
            done.result()
        except Exception as e:  # noqa: BLE001 - the caller reports it in one line
            return f"{type(e).__name__}: {e}"
        return None

    def close(self) -> None:
        self.pool.shutdown(wait=False)  # a failed broadcast may leave its thread blocked: never join it


class Relay:
    """A trainer rank in a sender group's transfer group after its source: it takes part in each of that group's
    broadcasts (a ring leaves the node on its NIC too) and drops the bytes. ``sender``: the group's index;
    ``received``: bytes received so far (what the tests count). ``device``: the group's (``group_device``: a
    disabled NCCL group is refused here, at the join); the receive buffer and the stream NCCL runs on are that
    device's, whatever the calling thread's current device (the pipe's worker thread starts on device 0)."""

    def __init__(self, group, sender: int = 0):
        self.group, self.sender, self.received = group, sender, 0
        self.device = group_device(group)

    def receive(self, bucket: Bucket) -> None:
        size = sum(nbytes(m) for m in bucket.metas)
        buf = torch.empty(size, dtype=torch.uint8, device=self.device or "cpu")
        stream = torch.cuda.current_stream(buf.device) if buf.is_cuda else None  # the pipe's side stream there
        self.group.broadcast(buf, src=0, stream=stream)
        self.received += size


def sync_buckets(stream: BucketStream, rank: int, sender=None, relay: Relay | None = None,
                 weight_version: str | None = None) -> str | None:
    """Collective over every trainer rank: one weight update. Each source (``sender`` on its rank: ``begin``,
    ``send_bucket``, ``end``, ``abort``) sends its buckets, a ``relay`` takes part in its group's, both pipelined
    with the gathers (``_Pipe``); every rank does the gathers; after each bucket its source's ``go`` stops everyone
    at once if it failed. Returns this rank's error, one line (None: ok)."""
    is_src, err = rank in stream.sources, None
    if is_src:
        try:
            sender.begin(stream.meta, len(stream.buckets))
        except Exception as e:  # noqa: BLE001 - reported by the caller on every rank
            err = f"{type(e).__name__}: {e}"
    pipe = _Pipe() if is_src or relay is not None else None
    try:
        _walk(stream, rank, sender, relay, err, pipe)
    except _Failed as e:
        err = e.line
    except Exception as e:  # noqa: BLE001 - a collective failed under us (a rank died): one line, no agreement
        err = f"{type(e).__name__} in a weight-sync collective (a trainer rank gone?): " + \
            (str(e).strip().splitlines() or [""])[0]
    if pipe is not None:
        last = pipe.wait() if err is None else None  # after a failure a send may never end: not waited for
        err = err or last
        pipe.close()
    if is_src:
        try:
            if err is None:
                sender.end(weight_version)
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        finally:
            sender.abort()
    return err


class _Failed(Exception):
    def __init__(self, line: str):
        self.line = line


def _walk(stream: BucketStream, rank: int, sender, relay, err: str | None, pipe: _Pipe | None) -> None:
    """``sync_buckets``' pass: raises ``_Failed`` with this rank's error once a bucket's source says stop."""
    for bucket in stream:
        if err is None:
            try:
                if rank == bucket.src and bucket.problem:
                    raise RuntimeError(bucket.problem)
                if rank == bucket.src:
                    err = pipe.put(lambda flat, b=bucket: sender.send_bucket(flat, b.index, b.metas), bucket.flat)
                elif relay is not None and relay.sender == bucket.sender:
                    err = pipe.put(lambda _, b=bucket: relay.receive(b), None, relay.device)
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {e}"
        if not go(err is None, bucket.src):  # the source's word (the others' flag is not read)
            raise _Failed(err or f"stopped by the failure of rank {bucket.src} (a source)")
    if err is not None:
        raise _Failed(err)


def go(ok: bool, src: int) -> bool:
    """The source's word after a bucket, on every rank (one int broadcast; True without other ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    from ...distributed import collectives

    return bool(collectives.broadcast(torch.tensor([int(ok)], dtype=torch.int64), src=src).item())
