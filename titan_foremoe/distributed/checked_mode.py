"""The checked backend's eyes: the modes that see each aten op, factory call and collective, and the helpers
that read them (which storage, which bytes, which call site, which host sync).

Why a module of its own: ``checked.py`` keeps the state (emulated streams and events, storages and their
accesses, the counts) and the verdicts; this module only translates torch's calls into that state's calls,
and imports nothing of ``checked.py`` (the backend is handed in as ``b``), so the dependency goes one way.

* ``_Factories`` (a ``TorchFunctionMode``): where a factory call or ``Tensor.to`` puts its tensor, as CUDA would;
* ``_Mode`` (a ``TorchDispatchMode``): each aten op's reads, writes and views on the emulated current stream;
  ``c10d`` / functional collectives on their process group's stream, with their ``Work`` / ``wait_tensor``;
* ``sync_kind``: the ops whose output size or value the host must know on CUDA (a host sync);
* ``call_site``: ``file:line`` of the project's frame that made the call (this module's and ``checked.py``'s
  frames skipped).

Cost: tens of µs of Python per aten op (the schema walk and the byte-range check): a debug mode.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_HERE = os.path.dirname(os.path.abspath(__file__))


def _find_spec(name: str):
    try:  # torchtitan may be absent or refuse to import (the GPU check runs without it)
        return importlib.util.find_spec(name)
    except Exception:
        return None

# the project's and torchtitan's install folders: a name match would also take torch's frames for ours when the
# virtual environment sits under a folder called titan_foremoe (CI's cache)
_PROJECT = tuple(spec.submodule_search_locations[0] + os.sep
                 for spec in map(_find_spec, ("titan_foremoe", "torchtitan")) if spec is not None)
_SKIP_FILES = (os.path.join(_HERE, "checked.py"), os.path.join(_HERE, "checked_mode.py"),
               os.path.join(_HERE, "device.py"), os.path.join(_HERE, "uploads.py"))
_ALWAYS_SYNC = {"_local_scalar_dense": "item", "nonzero": "nonzero", "masked_select": "masked_select",
                "equal": "equal", "bincount": "bincount", "_unique": "unique", "_unique2": "unique",
                "unique_dim": "unique", "unique_consecutive": "unique"}


def sync_kind(func, args, kwargs) -> str | None:
    """The kind of host sync this aten op makes on CUDA, or None (ops whose output size or value the host
    must know: ``.item()``, ``nonzero``, boolean indexing, ``repeat_interleave`` without ``output_size``...)."""
    name = func._overloadpacket.__name__
    if name in _ALWAYS_SYNC:
        return _ALWAYS_SYNC[name]
    if name in ("index", "_index_put_impl_", "index_put", "index_put_"):
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
            return "index_put(bool)" if "put" in name else "index(bool)"
    if name == "repeat_interleave" and kwargs.get("output_size") is None and not (
            len(args) > 3 and args[3] is not None) and isinstance(args[0], torch.Tensor) and (
            func.__name__ != "repeat_interleave.self_int"):
        if len(args) > 1 and isinstance(args[1], torch.Tensor) or func.__name__ == "repeat_interleave.Tensor":
            return "repeat_interleave"
    return None


def call_site(skip: tuple[str, ...] = _SKIP_FILES) -> str:
    """``file:line`` of the innermost frame in this project or torchtitan (else the innermost non-torch one),
    with the autograd node when called in backward (where the Python stack ends at ``.backward()``)."""
    f = sys._getframe(1)
    site = fallback = None
    while f is not None and site is None:
        name = f.f_code.co_filename
        if not name.endswith(skip):
            root = next((p for p in _PROJECT if name.startswith(p)), None)
            if root is not None:
                site = f"{os.path.basename(root.rstrip(os.sep))}/{name[len(root):]}:{f.f_lineno}"
            elif fallback is None and os.sep + "torch" + os.sep not in name:
                fallback = f"{os.path.basename(name)}:{f.f_lineno}"
        f = f.f_back
    node = torch._C._current_autograd_node()
    return (site or fallback or "?") + (f" (backward of {node.name()})" if node is not None else "")


_FACTORIES = {getattr(torch, n) for n in ("arange", "zeros", "ones", "empty", "full", "rand", "randn", "randint",
                                          "randperm", "eye", "linspace", "empty_strided", "tensor", "as_tensor")}


class _Factories(TorchFunctionMode):
    """Where a factory call puts its tensor, as CUDA would: without ``device=`` on the host (a CUDA program's
    ``torch.arange(n)`` is a CPU tensor), with it on the device (``torch.tensor(data, device=)``: a pageable
    upload). The dispatch mode below sees every call with the device already filled in."""

    def __init__(self, b: "Checked"):
        super().__init__()
        self.b = b

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and self.b._active():
            return self._to(func, args, kwargs)
        if func not in _FACTORIES or not self.b._active():
            return func(*args, **kwargs)
        if kwargs.get("device") is None:
            with self.b.host_code():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor) and not isinstance(args[0] if args else None, torch.Tensor):
            self.b.host_sync("pageable upload")  # host data to the device, from pageable memory
            self.b._storage_becomes_device(out)
        return out

    def _to(self, func, args, kwargs):
        """``host_tensor.to(device)`` is an upload on CUDA (a no-op on CPU): its result is a device tensor (a
        copy here), a host sync unless pinned and non-blocking. The target ``"cpu"`` written as a string is
        taken for the host (``.to("cpu")``), a ``torch.device`` for the job's device (``.to(self.device)``)."""
        t = args[0]
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        out = func(*args, **kwargs)
        if not isinstance(target, torch.device) or self.b.is_device(t) or _plain(t) is None:
            return out
        info = self.b._info(t)
        if not (kwargs.get("non_blocking") and info is not None and info.pinned):
            self.b.host_sync("pageable upload")
        if out is t or self.b._key(_plain(out)) == self.b._key(_plain(t)):
            with self.b._mode.paused():
                out = out.clone()
        self.b._register(out, device=True)
        self.b._access(out, True, "memcpy HtoD", self.b.cur)
        return out


class _Mode(TorchDispatchMode):
    """Tags each aten op with the emulated current stream (see ``Checked``)."""

    def __init__(self, b: "Checked"):
        super().__init__()
        self.b = b
        self.on = False

    def __enter__(self):
        self.on = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.on = False
        return super().__exit__(*exc)

    @contextmanager
    def paused(self):
        prev, self.on = self.on, False
        try:
            with torch.utils._python_dispatch._disable_current_modes():
                yield
        finally:
            self.on = prev

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        b = self.b
        if not self.on:
            return func(*args, **kwargs)
        b.raise_deferred()
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional"):
            return self._collective(func, args, kwargs)
        name = func._overloadpacket.__name__
        # scalar_tensor: the 0-d tensor the binding wraps a Python number in (``torch.where(m_BL, x_BL, 0)``),
        # a host scalar on CUDA too, which every op takes beside host or device tensors
        if name in ("lift_fresh", "lift_fresh_copy", "record_stream", "scalar_tensor"):
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                b._register(out, device=False)
            return out
        reads, writes, views = [], [], []
        schema = func._schema
        for t in pytree.tree_leaves((args, kwargs)):  # a functional collective's result waits at first use
            if type(t).__name__ == "AsyncCollectiveTensor":
                ev = b._tensor_events.pop(b._key(_plain(t)), None)
                if ev is not None:
                    b.cur.wait_event(ev)
        for arg, value in _zip_schema(schema, args, kwargs):
            is_write = arg.alias_info is not None and arg.alias_info.is_write
            view_base = arg.alias_info is not None and not is_write  # a view's base: metadata only, no access
            for t in pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor):
                    (views if view_base else writes if is_write else reads).append(t)
        tensors = [t for t in reads + writes + views if _plain(t) is not None]  # a meta tensor is only a shape
        device_in = [t for t in tensors if b.is_device(t)]
        host_in = [t for t in tensors if not b.is_device(t) and t.dim() > 0 and t.numel() > 0]
        if name == "copy_" and len(args) >= 2:
            return self._copy(func, args, kwargs)
        if not device_in and (tensors or b.host_depth):
            out = func(*args, **kwargs)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    b._register(t, device=False)
            return out
        if host_in:  # on CUDA this op raises, unless the tensor was made on the device there (listed, not raised)
            b.counts[(f"host tensor in a device op ({func})", call_site())] += 1
        kind = sync_kind(func, args, kwargs)
        if kind is not None:
            b.host_sync(kind)
            b.syncs.all_streams_wait_for_stream(b.cur.id)
        out = func(*args, **kwargs)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in outs:
            b._register(t, device=True)
        site = call_site()
        op = str(func)
        written = {id(t) for t in writes}
        for t in reads:
            if id(t) not in written:
                b._access(t, False, op, b.cur, site)
        for t in writes:
            b._access(t, True, op, b.cur, site)
        for t in outs:
            if id(t) not in written and not _is_view(func):
                b._access(t, True, op, b.cur, site)
        return out

    def _copy(self, func, args, kwargs):
        b = self.b
        dst, src = args[0], args[1]
        d_dev, s_dev = b.is_device(dst), b.is_device(src)
        site = call_site()
        if d_dev and not s_dev and src.dim() > 0:
            info = b._info(src)
            if info is None or not info.pinned:
                b.host_sync("pageable upload")
            out = func(*args, **kwargs)
            b._access(dst, True, "memcpy HtoD", b.cur, site)
            return out
        if s_dev and not d_dev:
            b._access(src, False, "memcpy DtoH", b.cur, site)
            b.host_sync("memcpy DtoH")
            b.syncs.all_streams_wait_for_stream(b.cur.id)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if d_dev:
            b._access(src, False, str(func), b.cur, site)
            b._access(dst, True, str(func), b.cur, site)
        return out

    def _collective(self, func, args, kwargs):
        b = self.b
        name = func._overloadpacket.__name__
        if name == "_wrap_tensor_autograd":  # bookkeeping of a functional collective's result: no device work
            return func(*args, **kwargs)
        if name == "wait_tensor":
            out = func(*args, **kwargs)
            t = _plain(args[0])
            ev = b._tensor_events.pop(b._key(t), None) if t is not None else None
            if ev is not None:
                b.cur.wait_event(ev)
            return out
        reads, writes, key, ref = [], [], None, None
        for arg, value in _zip_schema(func._schema, args, kwargs):
            # c10d's schemas mark no writes: outputs, and in-place ``tensors`` (but a send's), are written
            is_write = arg.name.startswith("output") or arg.name == "tensors" and name != "send"
            for t in pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor):
                    (writes if is_write else reads).append(t)
                elif isinstance(t, torch.ScriptObject) and key is None:
                    key = _group_key(t)
                    ref = t if key is not None else None
                elif isinstance(t, str) and arg.name == "group_name":
                    key = ref = t
        site = call_site()
        if ref is not None:  # host ones too: which ones NCCL runs on a GPU is not known here (an object
            b.issue_order.record(ref, key, name, b.cur.name, site)  # collective's source is on the host here)
        if not any(b.is_device(t) for t in reads + writes):
            out = func(*args, **kwargs)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    b._register(t, device=False)
            return out
        stream = b._collective_stream(key)
        stream.wait_stream(b.cur)  # NCCL's stream waits for the issuing stream
        out = func(*args, **kwargs)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in outs:
            b._register(t, device=True)
        written = {id(t) for t in writes}
        for t in reads:
            if id(t) not in written:
                b._access(t, False, str(func), stream, site)
        for t in writes + [t for t in outs if id(t) not in written]:
            b._access(t, True, str(func), stream, site)
        for t in reads + writes + outs:  # c10d keeps its tensors safe for its stream (recordStream / stashing)
            b.record_stream(t, stream)
        done = b.event()
        done.record(stream)
        sync = dict((a.name, v) for a, v in _zip_schema(func._schema, args, kwargs)).get("async_op", True) is False
        if sync:  # a blocking collective: c10d makes the current stream wait for it before returning
            b.cur.wait_event(done)
        for w in pytree.tree_leaves(out):
            if isinstance(w, torch.ScriptObject):
                work = torch._C._distributed_c10d.Work.unbox(w)
                b._work_events[id(work)] = (work, done)
        if func.namespace == "_c10d_functional":
            for t in outs:
                b._tensor_events[b._key(_plain(t))] = done
        return out


def _plain(t) -> torch.Tensor | None:
    """The storage-backed CPU tensor behind ``t`` (a DTensor's local shard, a functional collective's
    result), or None."""
    while isinstance(t, torch.Tensor) and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        inner = getattr(t, "_local_tensor", None)
        if inner is None:
            inner = getattr(t, "elem", None)
        if inner is None or inner is t:
            break
        t = inner
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_sparse or t.is_meta:
        return None
    return t


def _group_key(obj) -> object:
    try:
        return id(torch._C._distributed_c10d.ProcessGroup.unbox(obj))
    except Exception:  # not a process group (a Work, options)
        return None


def _is_view(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _zip_schema(schema, args, kwargs):
    pos = schema.arguments[: len(args)]
    yield from zip(pos, args)
    for a in schema.arguments[len(args):]:
        if a.name in kwargs:
            yield a, kwargs[a.name]
