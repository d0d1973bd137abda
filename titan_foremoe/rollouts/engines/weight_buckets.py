"""The policy's weights in buckets, each gathered once to the rank that sends it (``sync_cost``'s bucketed design).

Every trainer rank walks the state dict in the same order (a collective pass, as ``HFWeightStream``); each entry
is gathered only to the source rank (``gather_to``: every rank sends its slice, the others receive nothing; in two
hops over ``RailGroups`` when the trainer spans nodes, so each slice crosses nodes once and no NIC carries the model),
mapped to HF tensors there, and packed into uint8 buckets by vLLM's rule (``sync_cost.bucket_bounds``: a bucket
closes on the tensor that takes it past ``bucket_bytes``); vLLM's packed consumer and SGLang's
``flattened_bucket`` loader both read a bucket as the HF tensors' bytes back to back in order (``unpack``).
Every rank knows where buckets close from the metadata alone, so after each bucket the source tells every rank
whether it goes on (``go``: one small broadcast): a relay then takes part in that bucket's broadcast, and a source
that failed stops everyone at the same bucket instead of leaving a relay in a broadcast that never comes.

Cost at Qwen3-30B-A3B (61 GB bf16, 18,867 tensors, 579 state-dict entries), R = 64, one engine, 512 MiB buckets:
113 buckets; the source receives 60 GB over NVLink (the model less its own slice), each GPU of its node 6.7 GB of
remote slices over its NIC (forwarded to the source), every other rank sends its ~1 GB of slices and receives
nothing; two gathers per entry (a header all-gather of 2 x ndim int64, the padded slices) and one go
flag per bucket; memory on the source: the entry being gathered (at most the 0.62 GB embedding, padded) plus the
bucket being packed; the sender's broadcasts are ``vllm_weights`` / ``sglang_weights``'.

Legend: meta = (HF name, dtype name, shape); b = buckets.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .sync_cost import bucket_bounds
from .vllm_weights import HFWeightStream, ParamMeta, RailGroups


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


class BucketStream:
    """``HFWeightStream``'s pass (``entries``) in buckets, gathered to ``src`` only (module docstring). Every rank iterates it;
    ``go(ok)`` after each bucket is the source's word to every rank (the iteration stops where it says no)."""

    def __init__(self, stream: HFWeightStream, bucket_bytes: int, src: int, rails: RailGroups | None = None):
        self.stream, self.bucket_bytes, self.src, self.rails = stream, int(bucket_bytes), src, rails
        self.meta = stream.metadata()
        self.buckets = plan(self.meta, self.bucket_bytes)

    def __iter__(self) -> Iterator[Bucket]:
        """Buckets in order; on the source each checked against the plan (a mismatch would split the bytes
        differently on the two sides: an ``EngineError`` naming the tensor)."""
        from .errors import EngineError

        b, i, tensors, problem = 0, 0, [], None
        for metas, values in self.stream.entries(self.src, self.rails):
            for j, m in enumerate(metas):
                want = self.buckets[b][i] if b < len(self.buckets) and i < len(self.buckets[b]) else None
                if values is not None and m != want and problem is None:
                    problem = f"bucketed weight sync: tensor {m} where the plan has {want}"
                if values is not None:
                    tensors.append(values[j])
                i += 1
                if b < len(self.buckets) and i == len(self.buckets[b]):
                    flat = pack(tensors) if values is not None and problem is None else None
                    yield Bucket(b, self.buckets[b], flat, problem)
                    b, i, tensors = b + 1, 0, []
        if b != len(self.buckets) or i:
            raise EngineError(f"bucketed weight sync: the pass made {b} buckets and {i} tensors, the plan "
                              f"{len(self.buckets)} buckets")


class Relay:
    """A trainer rank in an engine's transfer group after the source: it takes part in every bucket's broadcast
    (a ring leaves the node on its NIC too) and drops the bytes."""

    def __init__(self, group):
        self.group = group

    def receive(self, bucket: Bucket) -> None:
        size = sum(nbytes(m) for m in bucket.metas)
        device = getattr(self.group, "device", None)
        buf = torch.empty(size, dtype=torch.uint8, device=device or "cpu")
        stream = torch.cuda.current_stream() if buf.is_cuda else None
        self.group.broadcast(buf, src=0, stream=stream)


def sync_buckets(stream: BucketStream, rank: int, sender=None, relay: Relay | None = None,
                 weight_version: str | None = None) -> str | None:
    """Collective over every trainer rank: one weight update. The source (``sender``: ``begin``, ``send_bucket``,
    ``end``, ``abort``) broadcasts each bucket, a ``relay`` takes part, every rank does the gathers; after each
    bucket the source's ``go`` stops everyone at once if it failed. Returns this rank's error, one line (None: ok)."""
    src, err = stream.src, None
    if rank == src:
        try:
            sender.begin(stream.meta, len(stream.buckets))
        except Exception as e:  # noqa: BLE001 - reported by the caller on every rank
            err = f"{type(e).__name__}: {e}"
    try:
        _walk(stream, rank, sender, relay, err)
    except _Failed as e:
        err = e.line
    except Exception as e:  # noqa: BLE001 - a collective failed under us (a rank died): one line, no agreement
        err = f"{type(e).__name__} in a weight-sync collective (a trainer rank gone?): " + \
            (str(e).strip().splitlines() or [""])[0]
    if rank == src:
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


def _walk(stream: BucketStream, rank: int, sender, relay, err: str | None) -> None:
    """``sync_buckets``' pass: raises ``_Failed`` with this rank's error once the source says stop."""
    src = stream.src
    for bucket in stream:
        if err is None:
            try:
                if rank == src and bucket.problem:
                    raise RuntimeError(bucket.problem)
                if rank == src:
                    sender.send_bucket(bucket.flat, bucket.index, bucket.metas)
                elif relay is not None:
                    relay.receive(bucket)
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {e}"
        if not go(err is None, src):  # the source's word (the others' flag is not read)
            raise _Failed(err or "stopped by the source's failure")
    if err is not None:
        raise _Failed(err)


def go(ok: bool, src: int) -> bool:
    """The source's word after a bucket, on every rank (one int broadcast; True without other ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    from ...distributed import collectives

    return bool(collectives.broadcast(torch.tensor([int(ok)], dtype=torch.int64), src=src).item())
