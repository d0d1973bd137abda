"""The checked backend: CUDA's stream semantics executed on CPU and checked by torch's sanitizer analysis.

Why: no GPU runs our CUDA path, so its ordering (side stream, waits, events, ``record_stream``, collectives
on their own streams, ``work.wait()``) is executed here on emulated streams, in program order, and every
aten op is checked as CUDA would run it.

How:
* a ``TorchDispatchMode`` tags each aten op with the emulated current stream and feeds its reads and
  writes to torch's vector-clock analysis (``torch.cuda._sanitizer.StreamSynchronizations``); conflicts are
  found per byte range of a storage (torch's sanitizer keys by ``data_ptr``, which misses a write to rows
  ``n..`` of a buffer read from row 0);
* collectives (``c10d.*``) run on one emulated stream per process group that waits for the issuing stream;
  ``Work.wait()`` makes the current stream wait for it; functional collectives the same via ``wait_tensor``;
* device-ness is tracked honestly: a storage is a device storage when a device op or a factory op made it
  (outside ``host_code``) or the module moved it there (``to_device``); ``torch.tensor``/``from_numpy``
  data and ``host_empty`` buffers are host storages. A device op given a host tensor (not a 0-d scalar) is
  counted with its call site (``counts``): on CUDA it raises unless that tensor is made on the device there;
* a device storage freed while another stream's access is not ordered before its allocation stream, and
  that stream is not ``record_stream``-ed, is reported (the caching allocator would hand it out again);
* host syncs (``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero``, boolean indexing, event/stream/device
  ``synchronize``, pageable uploads, device-to-host copies) are counted by kind and call site; inside
  ``strict`` they raise.

The modes that see each op (and ``sync_kind``, ``call_site``) are in ``checked_mode.py``; this module holds
the state they feed (streams, events, storages, counts) and its verdicts.

Cost: tens of µs of Python per aten op and a finalizer per storage: a debug mode (CI runs a few RL steps).
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.cuda._sanitizer import StreamSynchronizations

from .checked_mode import _Factories, _Mode, _plain, call_site, sync_kind  # noqa: F401 (sync_kind: imported from here)
from .device import Plain
from .issue_order import IssueOrder

aten = torch.ops.aten
COMPUTE = 0  # the emulated default stream (torch's sanitizer's DEFAULT_STREAM_ID)


class StreamError(RuntimeError):
    """A stream-ordering fault the checked backend found (the sanitizer's verdict)."""


class HostSyncError(RuntimeError):
    """A host read of a device tensor inside a ``strict`` region."""


@dataclass
class _Access:
    write: bool
    seq: int
    stream: int
    lo: int
    hi: int
    op: str
    site: str


@dataclass
class _Storage:
    device: bool
    pinned: bool = False
    alloc_stream: int = COMPUTE
    record_streams: set = field(default_factory=set)
    accesses: list = field(default_factory=list)


class _Stream:
    """An emulated CUDA stream: an id in the sanitizer's vector clocks."""

    def __init__(self, b: "Checked", sid: int, name: str):
        self.b, self.id, self.name = b, sid, name

    def wait_event(self, ev: "_Event") -> None:
        self.b.syncs.stream_wait_for_event(self.id, ev.id)

    def wait_stream(self, other: "_Stream") -> None:
        ev = self.b.event()
        ev.record(other)
        self.wait_event(ev)

    def synchronize(self) -> None:
        self.b.host_sync("stream.synchronize")
        self.b.syncs.all_streams_wait_for_stream(self.id)

    def __repr__(self):
        return f"stream {self.id} ({self.name})"


class _Event:
    def __init__(self, b: "Checked", eid: int):
        self.b, self.id, self.t, self.stream = b, eid, None, None
        b.syncs.create_event(eid)

    def record(self, stream: _Stream | None = None) -> None:
        stream = stream or self.b.cur
        self.b.syncs.record_state(self.id, stream.id)
        self.t, self.stream = _now(), stream

    def query(self) -> bool:
        """Non-blocking on CUDA: no sync counted (the emulated work is done)."""
        return True

    def synchronize(self) -> None:
        self.b.host_sync("event.synchronize")
        self.b.syncs.all_streams_wait_for_event(self.id)

    def elapsed_ms(self, end: "_Event") -> float:
        return (end.t - self.t) * 1e3


def _now() -> float:
    import time

    return time.perf_counter()


class Checked(Plain):
    name = "checked"
    host_is_device = False  # CUDA's program: host and device tensors are kept apart

    def __init__(self):
        self.syncs = StreamSynchronizations()
        self.seq = 0
        self._ids = itertools.count(1)
        self.streams = {COMPUTE: _Stream(self, COMPUTE, "compute")}
        self.cur = self.streams[COMPUTE]
        self.storages: dict[int, _Storage] = {}  # id(storage object) -> its record
        self.strict_where: str | None = None
        self.host_depth = 0
        self.expected: list[str] = []  # reasons of the enclosing ``expected_sync`` blocks
        self.observers: list = []  # fn(kind, site, strict region or None) on every host sync (the census)
        self.counts = collections.Counter()  # (kind, site) -> host syncs / pageable moves / findings
        self.findings: list[str] = []  # reported faults (raised at once; kept for the summary)
        self._deferred: list[str] = []  # faults found in finalizers: raised at the next op
        self._coll_streams: dict[object, _Stream] = {}
        self._work_events: dict[int, tuple[object, _Event]] = {}  # id(Work) -> (Work, its completion event)
        self._tensor_events: dict[int, _Event] = {}  # storage ptr of a functional collective's output
        self.issue_order = IssueOrder()  # NCCL's order across communicators over the same ranks (issue_order.py)
        self._mode = _Mode(self)
        self._patched: list[tuple[object, str, object]] = []
        self._thread = threading.get_ident()

    # -- streams and events ---------------------------------------------------------------------------
    def current_stream(self, device=None):
        return self.cur

    def new_stream(self, device=None, name: str = "side"):
        sid = next(self._ids)
        self.syncs.create_stream(sid)
        self.streams[sid] = s = _Stream(self, sid, name)
        return s

    @contextmanager
    def use_stream(self, stream):
        prev, self.cur = self.cur, stream
        try:
            yield
        finally:
            self.cur = prev

    def event(self, enable_timing: bool = False):
        return _Event(self, next(self._ids))

    def record_stream(self, t: torch.Tensor, stream) -> None:
        info = self._info(t)
        if info is not None:
            info.record_streams.add(stream.id)

    def synchronize(self, device=None) -> None:
        self.host_sync("device.synchronize")
        self.syncs.sync_all_streams()

    # -- host <-> device ----------------------------------------------------------------------------------
    def host_empty(self, shape, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
        with self._mode.paused():
            t = torch.empty(shape, dtype=dtype)
        self._register(t, device=False, pinned=pinned)
        return t

    def to_device(self, t: torch.Tensor, device) -> torch.Tensor:
        info = self._info(t)
        if info is not None and info.device:
            raise StreamError(f"to_device of a tensor already on the device at {call_site()}")
        if info is None or not info.pinned:
            self.host_sync("pageable upload")
        with self._mode.paused():
            out = t.clone()
        self._register(out, device=True)
        self._access(out, write=True, op="memcpy HtoD", stream=self.cur)
        return out

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        if self.is_device(t):
            self._access(t, write=False, op="memcpy DtoH", stream=self.cur)
            self.host_sync("to_host")
            self.syncs.all_streams_wait_for_stream(self.cur.id)
        with self._mode.paused():
            out = t.detach().clone()
        self._register(out, device=False)
        return out

    def host_sync(self, kind: str) -> None:
        """A host read of the device: counted; inside ``strict`` an error naming the call site."""
        site = call_site()
        if self.expected:
            kind = f"expected ({self.expected[-1]}): {kind}"
        self.counts[(kind, site)] += 1
        for fn in self.observers:
            fn(kind, site, self.strict_where)
        if self.strict_where is not None and not self.expected:
            raise HostSyncError(f"host sync inside {self.strict_where}: {kind} at {site} "
                                "(the checked backend's strict mode: nothing may wait for the device here)")

    @contextmanager
    def strict(self, where: str):
        prev, self.strict_where = self.strict_where, where
        try:
            yield
        finally:
            self.strict_where = prev
        if prev is None:  # a stage boundary, reached by every rank: compare the collectives' issue order
            with self._mode.paused():
                self.issue_order.check(where)

    @contextmanager
    def expected_sync(self, reason: str):
        self.expected.append(reason)
        try:
            yield
        finally:
            self.expected.pop()

    @contextmanager
    def host_code(self):
        self.host_depth += 1
        try:
            yield
        finally:
            self.host_depth -= 1

    def summary(self) -> dict[str, int]:
        """Host syncs (and host tensors in device ops) counted so far, by kind (``counts`` has the sites)."""
        out = collections.Counter()
        for (kind, _), n in self.counts.items():
            out[kind] += n
        return dict(out.most_common())

    # -- activation --------------------------------------------------------------------------------------
    def __enter__(self):
        self._patch()
        self._factories = _Factories(self)
        self._factories.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._factories.__exit__(*exc)
        self._unpatch()

    def _storage_becomes_device(self, t: torch.Tensor) -> None:
        info = self._info(t)
        if info is not None:
            info.device = True
        else:
            self._register(t, device=True)

    def _patch(self) -> None:
        b = self

        def reading(name):
            orig = getattr(torch.Tensor, name)

            def f(t, *a, **k):
                if b._active() and b.is_device(t):
                    b._access(t, write=False, op=f"Tensor.{name}", stream=b.cur)
                    b.host_sync(name)
                    b.syncs.all_streams_wait_for_stream(b.cur.id)
                    if name == "cpu":
                        return b.to_host(t) if not a and not k else orig(t, *a, **k)
                return orig(t, *a, **k)
            return orig, f

        for name in ("tolist", "numpy", "cpu"):
            orig, f = reading(name)
            self._patched.append((torch.Tensor, name, orig))
            setattr(torch.Tensor, name, f)

        def host_born(name):  # tensors over host data (numpy arrays, buffers, lists) are host tensors
            orig = getattr(torch, name)

            def f(data, *a, **k):
                out = orig(data, *a, **k)
                if not isinstance(data, torch.Tensor) and b._active():
                    b._register(out, device=False)
                return out
            return orig, f

        for name in ("from_numpy", "as_tensor", "asarray", "frombuffer"):
            orig, f = host_born(name)
            self._patched.append((torch, name, orig))
            setattr(torch, name, f)
        Work = torch._C._distributed_c10d.Work
        orig_wait = Work.wait

        def wait(work, *a, **k):
            out = orig_wait(work, *a, **k)
            got = b._work_events.pop(id(work), None)
            if got is not None and got[0] is work:
                b.cur.wait_event(got[1])
            return out

        self._patched.append((Work, "wait", orig_wait))
        Work.wait = wait

    def _unpatch(self) -> None:
        for obj, name, orig in reversed(self._patched):
            setattr(obj, name, orig)
        self._patched = []

    def _active(self) -> bool:
        return threading.get_ident() == self._thread and self._mode.on

    # -- storages ------------------------------------------------------------------------------------------
    @staticmethod
    def _key(t: torch.Tensor) -> int:
        """A storage's identity: its Python object (torch keeps one per storage while it lives), not its address,
        which moves when FSDP resizes an unsharded storage to 0 and back."""
        try:
            return id(t.untyped_storage())
        except (RuntimeError, NotImplementedError):  # no storage of its own (a subclass, an invalid storage)
            return 0

    def _info(self, t: torch.Tensor) -> _Storage | None:
        t = _plain(t)
        return None if t is None else self.storages.get(self._key(t))

    def is_device(self, t) -> bool:
        """A device tensor: made or moved there, or of a storage never seen being made (torch's internals under
        a tensor subclass, e.g. DTensor's and FSDP's, run below this mode); host-born tensors are registered."""
        t = _plain(t)
        if t is None:
            return False
        info = self.storages.get(self._key(t))
        return info.device if info is not None else True

    def is_device_tensor(self, t) -> bool:
        """Registered as a device tensor (not merely unseen: data the caller hands over as host data)."""
        info = self._info(t)
        return info is not None and info.device

    def _register(self, t: torch.Tensor, device: bool, pinned: bool = False) -> None:
        t = _plain(t)
        if t is None:
            return
        try:
            s = t.untyped_storage()
            if s.data_ptr() == 0:  # nothing to race on
                return
        except (RuntimeError, NotImplementedError):  # no storage of its own (a subclass, an invalid storage)
            return
        key = id(s)
        if key in self.storages:
            return
        self.storages[key] = _Storage(device, pinned, self.cur.id)
        weakref.finalize(s, self._freed, key)

    def adopt(self, tensors) -> None:
        """Register existing tensors (a model's parameters, an optimizer's state) as device tensors."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                local = getattr(t, "_local_tensor", t)
                self._register(local, device=True)

    def _freed(self, key: int) -> None:
        info = self.storages.pop(key, None)
        if info is None or not info.device:
            return
        for a in info.accesses:
            if a.stream == info.alloc_stream or a.stream in info.record_streams:
                continue
            if not self.syncs.is_ordered_after(info.alloc_stream, a.seq, a.stream):
                self._deferred.append(
                    f"a device tensor (allocated on {self.streams[info.alloc_stream]}) was freed while "
                    f"{self.streams.get(a.stream, a.stream)} may still use it ({'write' if a.write else 'read'} by "
                    f"{a.op} at {a.site}) and it was not record_stream-ed for that stream: the caching allocator "
                    "may hand its memory out again before that stream is done")
                return

    # -- accesses -------------------------------------------------------------------------------------------
    def _access(self, t: torch.Tensor, write: bool, op: str, stream: _Stream, site: str | None = None) -> None:
        t = _plain(t)
        info = self._info(t)
        if info is None or not info.device or t.numel() == 0:
            return
        es = t.element_size()
        lo = t.storage_offset() * es
        hi = lo + es * (1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())))
        self.seq += 1
        self.syncs.update_seq_num(stream.id, self.seq)
        site = site or call_site()
        keep = []
        for a in info.accesses:
            overlap = a.lo < hi and lo < a.hi
            if overlap and (write or a.write) and a.stream != stream.id and \
                    not self.syncs.is_ordered_after(stream.id, a.seq, a.stream):
                raise StreamError(
                    f"CUDA sanitizer (checked backend): unsynchronized {'write' if write else 'read'} of a device "
                    f"tensor (bytes {lo}..{hi} of a storage) by {op} on {stream} at {site}, while "
                    f"{'a write' if a.write else 'a read'} by {a.op} on {self.streams.get(a.stream, a.stream)} at "
                    f"{a.site} is not ordered before it (no wait_stream / wait_event / work.wait between them)")
            # a write covering an access by any stream, or a same-stream read covering a read, supersedes it
            if overlap and lo <= a.lo and a.hi <= hi and (write or (not a.write and a.stream == stream.id)):
                continue
            keep.append(a)
        keep.append(_Access(write, self.seq, stream.id, lo, hi, op, site))
        info.accesses = keep

    def raise_deferred(self) -> None:
        if self._deferred:
            msg, self._deferred = self._deferred[0], []
            self.findings.append(msg)
            raise StreamError(f"CUDA sanitizer (checked backend): {msg}")

    def _collective_stream(self, key) -> _Stream:
        s = self._coll_streams.get(key)
        if s is None:
            s = self._coll_streams[key] = self.new_stream(name=f"collectives {key}")
        return s



@contextmanager
def checking():
    """Within: a fresh checked backend is installed and active (tests, the self-test); yields it."""
    from . import device as dev

    b = Checked()
    old = dev.set_backend(b)
    try:
        with b:
            yield b
    finally:
        dev.set_backend(old)
