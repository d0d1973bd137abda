"""The policy's weights into a vLLM engine over NCCL (``[rollout_engine] weight_sync = "nccl"``, GPU only).

vLLM's weight-transfer API (0.28 to 0.33 alike, ``vllm_api``: ``--weight-transfer-config
'{"backend": "nccl"}'`` and ``VLLM_SERVER_DEV_MODE=1``): once, trainer rank 0 (NCCL rank 0, vLLM's own trainer
helper, imported lazily), the relays (the other ranks of its node) and the engine's workers (from ``rank_offset``;
an engine fleet: every engine's workers, server k from ``1 + relays + k * workers``) form one NCCL group
(``POST /init_weight_transfer_engine``). Every step: ``POST /start_weight_update``; ``POST /update_weights`` with
the names (HF naming), dtypes and shapes; the tensors broadcast in that same order;
``POST /finish_weight_update``; ``POST /reset_prefix_cache`` (cached blocks carry the old weights' KV and routes).

What runs (``PackedNCCLSender``, driven by ``weight_buckets.sync_buckets``): vLLM's ``packed`` transfer, the
tensors in buckets (one broadcast each), each state-dict entry gathered to rank 0 only (``gather_to``, in two hops
over ``RailGroups``); its cost per rank is ``sync_cost.py``'s and docs/rollouts_vllm.md's (Qwen3-30B-A3B, 16 + 48
GPUs: 0.45 s modelled with the stacked experts' load). ``NCCLWeightSender`` (one broadcast per tensor, every rank all-gathering every parameter:
61 GB received per rank and 18,867 broadcasts from rank 0 per step at Qwen3-30B-A3B, ``sync_cost``'s ``current``
row) is the base it extends and stays for comparison.

The tensors are exactly the HF export's (``train/hf_export.py``): the model's state dict, experts in logical order
(the caller iterates inside the placement's ``logical()`` layout), each floating tensor cast to the engine dtype,
mapped to HF names by the checkpointer's state-dict adapter (``HFWeightStream``); with ``fused`` (the engine has
``vllm_fused_load``'s extension) each layer's experts as two stacked tensors under vLLM's fused names instead.

Legend: W = the engine's workers; meta = (HF name, dtype name, shape).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import math
import re

import torch
import torch.distributed as dist

from ...distributed import groups
from .errors import EngineError
from .vllm_api import finish_weight_update_body, weight_transfer_init_info, weight_update_info


@dataclass(frozen=True)
class ParamMeta:
    """One tensor as the engine expects it: HF name, dtype name (``torch.<name>``), full shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


def _cast(value, dtype: torch.dtype):
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _full(value):
    """A DTensor's full tensor (collective: an all-gather over its mesh); a plain tensor as is."""
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value


def _is_dtensor(value) -> bool:
    return callable(getattr(value, "to_local", None)) and hasattr(value, "device_mesh")


@dataclass(frozen=True)
class RailGroups:
    """Trainer ranks by node (``per_node`` consecutive ranks) for a gather to any rank in two hops: each rank's
    slice crosses nodes once, to the rank of its own local index on the destination's node (one rail: every
    node's NIC of that index), then that node's ranks hand theirs to the destination over NVLink; no single NIC
    carries the model. ``rail``: this rank's rail, the group of ranks j, j + n, ... (j its local index; the member
    on node k is group rank k); ``node``: this rank's node group (group rank = local index). Made once, on every
    rank, through ``distributed.groups`` (the job's collective timeout)."""

    per_node: int
    rail: object
    node: object

    @classmethod
    def make(cls, world: int, per_node: int) -> "RailGroups | None":
        """None when there is one node (or nodes do not fill): the plain gather is the fast one."""
        if per_node < 1 or world <= per_node or world % per_node:
            return None
        rail = groups.subgroups([list(range(j, world, per_node)) for j in range(per_node)])
        node = groups.subgroups([list(range(k, k + per_node)) for k in range(0, world, per_node)])
        return cls(per_node, rail, node)


EVERY_RANK = -1
"""``gather_to``'s ``dst`` for a tensor whole on every rank (``all_gather_full``)."""


def gather_to(value, dst: int, rails: RailGroups | None = None):
    """Collective over every rank: ``value``'s full tensor on rank ``dst``, None elsewhere (``dst = EVERY_RANK``:
    on every rank, ``all_gather_full``). A DTensor's slices travel once, to ``dst`` only (an all-gather of each
    slice's shape and offset, then a gather of the slices padded to the largest: in two hops over ``rails`` when
    given); a plain tensor is whole on every rank already. Partial placements or a mesh smaller than the world
    fall back to ``full_tensor`` (an all-gather)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = dst in (rank, EVERY_RANK)
    if not _is_dtensor(value):
        return value if mine else None
    mesh, placements = value.device_mesh, value.placements
    if any(p.is_partial() for p in placements) or mesh.size() != dist.get_world_size():
        full = _full(value)
        return full if mine else None
    local, headers, padded = _padded_slice(value)
    world = dist.get_world_size()
    if dst == EVERY_RANK:
        return _assemble(value, local, headers, padded, _all_gather_slices(padded, world, rails))
    if rails is None:
        parts = [torch.empty_like(padded) for _ in headers] if rank == dst else None
        dist.gather(padded, parts, dst=dst)
    else:  # hop 1: to this rank's rail member on dst's node; hop 2: that node's ranks to dst
        n, home = rails.per_node, dst // rails.per_node
        on_home = rank // n == home
        mine = [torch.empty_like(padded) for _ in range(world // n)] if on_home else None
        dist.gather(padded, mine, group_dst=home, group=rails.rail)
        parts = None
        if on_home:
            rail = torch.cat(mine)
            got = [torch.empty_like(rail) for _ in range(n)] if rank == dst else None
            dist.gather(rail, got, group_dst=dst % n, group=rails.node)
            if rank == dst:
                parts = _rail_parts(got, padded.numel(), n, world)
    if rank != dst:
        return None
    return _assemble(value, local, headers, padded, parts)


def all_gather_full(value, rails: RailGroups | None = None):
    """Collective over every rank: ``value``'s full tensor on every rank, each slice crossing nodes once per
    node: an all-gather over this rank's rail (its NIC receives the rail's slices of the other nodes, M / n x
    (nodes - 1) / nodes of the model per NIC), then over its node (NVLink: the node's rails). Without ``rails``
    one all-gather over the world."""
    return gather_to(value, EVERY_RANK, rails)


def _padded_slice(value):
    """This rank's slice flattened and padded to the largest, and every rank's (shape, offset) header (one
    all-gather of 2 x ndim int64)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    local = value.to_local().contiguous()
    header = torch.tensor([*shape, *offset], dtype=torch.int64, device=local.device)
    headers = [torch.empty_like(header) for _ in range(dist.get_world_size())]
    dist.all_gather(headers, header)
    nd = len(value.shape)
    padded = torch.zeros(max(math.prod(h[:nd].tolist()) for h in headers), dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local.view(-1)
    return local, headers, padded


def _rail_parts(got: list[torch.Tensor], numel: int, n: int, world: int) -> list[torch.Tensor]:
    """Every global rank's padded slice out of its node's rails (global rank r: rail r % n, position r // n)."""
    return [got[r % n][(r // n) * numel:(r // n + 1) * numel] for r in range(world)]


def _all_gather_slices(padded: torch.Tensor, world: int, rails: RailGroups | None) -> list[torch.Tensor]:
    if rails is None:
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        return parts
    n = rails.per_node
    mine = [torch.empty_like(padded) for _ in range(world // n)]
    dist.all_gather(mine, padded, group=rails.rail)
    rail = torch.cat(mine)
    got = [torch.empty_like(rail) for _ in range(n)]
    dist.all_gather(got, rail, group=rails.node)
    return _rail_parts(got, padded.numel(), n, world)


def _assemble(value, local, headers, padded, parts) -> torch.Tensor:
    nd = len(value.shape)
    full = torch.empty(tuple(value.shape), dtype=local.dtype, device=local.device)
    for h, part in zip(headers, parts):
        shp, off = h[:nd].tolist(), h[nd:].tolist()
        full[tuple(slice(o, o + s) for o, s in zip(off, shp))] = part[: math.prod(shp)].view(shp)
    return full


EXPERT_HF = re.compile(r"^(?P<head>.+)\.mlp\.experts\.(?P<e>\d+)\.(?P<kind>gate|up|down)_proj\.weight$")


def expert_kind(names: list[str]) -> tuple[str, str] | None:
    """``(layer head, gate|up|down)`` when ``names`` are one layer's per-expert HF tensors of one kind, experts
    0..E-1 in order (what the adapter makes of one stacked entry); else None."""
    found = [EXPERT_HF.match(n) for n in names]
    if not found or not all(found) or [int(m["e"]) for m in found] != list(range(len(found))):
        return None
    heads, kinds = {m["head"] for m in found}, {m["kind"] for m in found}
    return (heads.pop(), kinds.pop()) if len(heads) == len(kinds) == 1 else None


class HFWeightStream:
    """The policy's weights as HF ``(name, tensor)`` pairs, one parameter gathered at a time (module docstring).

    ``state_dict``: the model's state dict (called at every pass); ``adapter``: the checkpointer's
    ``sd_adapter`` (``to_hf`` maps one of our entries to its HF entries: a grouped expert tensor to E per-expert
    tensors); ``layout``: a fresh context in which the experts are in logical order (the placement's
    ``logical()``), entered for the whole pass.

    ``fused`` (vLLM with ``vllm_fused_load``'s worker extension): each MoE layer's experts go as vLLM's fused
    checkpoint tensors instead, ``<layer>.mlp.experts.gate_up_proj`` ``[E, 2F, D]`` (our stacked w1 and w3
    entries, one "entry" together: concatenated, never split per expert) and ``.down_proj`` ``[E, D, F]`` (our
    stacked w2 as is): 2 tensors per layer instead of 3E, which the extension loads with 3 loader calls (96 HF
    tensors instead of 18,432 at Qwen3-30B-A3B; the largest, gate_up, 805 MB in bf16).
    """

    def __init__(self, state_dict: Callable[[], dict], adapter, dtype: torch.dtype,
                 layout: Callable[[], AbstractContextManager] = nullcontext, fused: bool = False):
        self.state_dict, self.adapter, self.dtype, self.layout = state_dict, adapter, dtype, layout
        self.fused = fused
        self._kinds: dict[str, tuple[str, str] | None] = {}  # state-dict key -> ``expert_kind`` of its HF names

    def _meta(self, value: torch.Tensor) -> torch.Tensor:
        dtype = self.dtype if value.is_floating_point() else value.dtype
        return torch.empty(tuple(value.shape), dtype=dtype, device="meta")

    def _kind(self, key: str, value: torch.Tensor) -> tuple[str, str] | None:
        """``expert_kind`` of the HF tensors ``key`` maps to (from meta tensors; once per key: a pass asks for
        each key's kind twice, to group the entries and to map them)."""
        if key not in self._kinds:
            self._kinds[key] = expert_kind(list(self.adapter.to_hf({key: self._meta(value)})))
        return self._kinds[key]

    def entry_keys(self, sd: dict) -> list[list[str]]:
        """The pass's entries: state-dict keys gathered together, in state-dict order; one key each, except under
        ``fused`` a layer's gate and up experts (one entry where the first of them stands)."""
        keys = [k for k, v in sd.items() if isinstance(v, torch.Tensor)]
        if not self.fused:
            return [[k] for k in keys]
        out, gate_up = [], {}
        for k in keys:
            kind = self._kind(k, sd[k])
            if kind is None or kind[1] == "down":
                out.append([k])
            elif kind[0] in gate_up:
                gate_up[kind[0]].append(k)
            else:
                gate_up[kind[0]] = [k]
                out.append(gate_up[kind[0]])  # filled in place by its partner
        return out

    def to_hf(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One entry's HF tensors (meta or real): the adapter's, or under ``fused`` a layer's stacked experts as
        vLLM's fused names (gate rows, then up rows)."""
        if self.fused:
            kinds = {k: self._kind(k, v) for k, v in values.items()}
            by_kind = {kind[1]: values[k] for k, kind in kinds.items() if kind is not None}
            heads = {kind[0] for kind in kinds.values() if kind is not None}
            if len(heads) == 1 and len(by_kind) == len(values):
                head = heads.pop()
                if set(by_kind) == {"gate", "up"}:
                    return {head + ".mlp.experts.gate_up_proj": torch.cat([by_kind["gate"], by_kind["up"]], 1)}
                if set(by_kind) == {"down"}:
                    return {head + ".mlp.experts.down_proj": by_kind["down"]}
        out = {}
        for k, v in values.items():
            out.update(self.adapter.to_hf({k: v}))
        return out

    def metadata(self) -> list[ParamMeta]:
        """What a pass yields, in order, from the global shapes (meta tensors: nothing gathered or allocated)."""
        return [m for entry in self.entry_metadata() for m in entry]

    def entry_metadata(self) -> list[list[ParamMeta]]:
        """``metadata`` per entry (one gather per state-dict key of it)."""
        sd = self.state_dict()
        return [_metas(self.to_hf({k: self._meta(sd[k]) for k in keys})) for keys in self.entry_keys(sd)]

    def entries(self, dst: int | list[int], rails: RailGroups | None = None
                ) -> Iterator[tuple[list[ParamMeta], list[torch.Tensor] | None]]:
        """Collective on every rank: per entry, its HF tensors' metadata and, on its destination rank only
        (``dst``, ``dst[k]`` for entry k, or ``EVERY_RANK``), the tensors (cast, gathered there alone:
        ``gather_to``, over ``rails`` when given); None elsewhere."""
        with self.layout():
            sd = self.state_dict()
            for k, keys in enumerate(self.entry_keys(sd)):
                to = dst if isinstance(dst, int) else dst[k]
                full = {key: gather_to(_cast(sd[key], self.dtype), to, rails) for key in keys}
                if any(v is None for v in full.values()):
                    yield _metas(self.to_hf({key: self._meta(sd[key]) for key in keys})), None
                else:
                    hf = self.to_hf(full)
                    yield _metas(hf), list(hf.values())

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective on every rank: cast (halves the gather for fp32 masters in bf16), gather, map to HF."""
        with self.layout():
            sd = self.state_dict()
            for keys in self.entry_keys(sd):
                yield from self.to_hf({key: _full(_cast(sd[key], self.dtype)) for key in keys}).items()


def _metas(hf: dict) -> list[ParamMeta]:
    return [ParamMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in hf.items()]


class NCCLWeightSender:
    """Trainer side of vLLM's NCCL weight transfer, driven over the engine's HTTP routes (module docstring).

    ``post(path, body)``: the engine client's POST (``VLLMClient.post``); ``open_group(init)``: joins the
    transfer group as NCCL rank 0 and returns the communicator (default: vLLM's ``nccl_common.trainer_init``,
    CUDA only); ``stream()``: the CUDA stream broadcasts are enqueued on. Only rank 0 builds one.
    """

    update_route = "vLLM /update_weights"

    def __init__(self, post: Callable[[str, dict | None], object], *, master_address: str, master_port: int,
                 engine_workers: int, open_group: Callable[[dict], object] | None = None,
                 stream: Callable[[], object] | None = None):
        self.post, self.workers = post, engine_workers
        self.init_info = weight_transfer_init_info(master_address, master_port, engine_workers)
        self.open_group = open_group or _vllm_trainer_init
        self.stream = stream or (lambda: torch.cuda.current_stream())
        self.group = None
        self.updates = 0

    def init(self) -> None:
        """Rank 0 and the engine's workers meet in the transfer group: the workers block in the POST until the
        trainer joins, so the POST runs on a side thread while rank 0 joins."""
        with ThreadPoolExecutor(max_workers=1) as pool:
            done = pool.submit(self.post, "/init_weight_transfer_engine", {"init_info": dict(self.init_info)})
            self.group = self.open_group(dict(self.init_info))
            done.result()

    def send(self, meta: list[ParamMeta], pairs: Iterable[tuple[str, torch.Tensor]],
             weight_version: str | None = None) -> None:
        """One weight update: start, update (``meta``) while broadcasting ``pairs`` in the same order, finish
        (labelled ``weight_version``: vLLM 0.32+ name it in every choice's ``weight_versions``), reset the prefix
        cache. On any error the rest of ``pairs`` is still drawn (the other ranks' gathers complete, nobody hangs)
        and the error is raised after."""
        it = iter(pairs)
        try:
            if self.group is None:
                raise EngineError("NCCL weight sender used before init()")
            self.post("/start_weight_update", None)
            update = weight_update_info([m.name for m in meta], [m.dtype for m in meta], [m.shape for m in meta])
            pool = ThreadPoolExecutor(max_workers=1)
            try:
                done = pool.submit(self.post, "/update_weights", {"update_info": update})
                self._broadcast(meta, it, done)
                done.result()  # the engine has loaded every tensor
            finally:
                pool.shutdown(wait=False)  # a failed broadcast leaves the engine blocked in NCCL: never join it
            self._finish(weight_version)
        except BaseException:
            for _ in it:  # keep the other ranks' gathers company
                pass
            raise

    def _finish(self, weight_version: str | None) -> None:
        """End an update: finish it (labelled ``weight_version``), reset the prefix cache (its blocks carry the old
        weights' KV and routes), count it."""
        self.post("/finish_weight_update", finish_weight_update_body(weight_version))
        out = self.post("/reset_prefix_cache", None)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError("vLLM /reset_prefix_cache refused (requests still running?): cached blocks "
                              "would keep the old weights' KV and routes")
        self.updates += 1

    def _broadcast(self, meta: list[ParamMeta], it: Iterator[tuple[str, torch.Tensor]], done) -> None:
        """Each tensor checked against what the engine was told (a mismatch would split the stream differently on
        the two sides: a hang or garbage weights), then broadcast from rank 0."""
        stream = self.stream()
        device = group_device(self.group)  # PyNcclCommunicator sends from its own CUDA device only
        sent = 0
        for name, tensor in it:
            if done.done():  # the engine refused the update before any NCCL call: it will never receive
                done.result()
                raise EngineError(f"{self.update_route} returned before receiving the weights")
            want = meta[sent] if sent < len(meta) else None
            got = ParamMeta(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
            if got != want:
                raise EngineError(f"NCCL weight sync: tensor {sent} is {got}, the engine was told {want}")
            if device is not None and tensor.device != device:
                tensor = tensor.to(device)
            self.group.broadcast(tensor.contiguous(), src=0, stream=stream)
            sent += 1
        if sent != len(meta):
            raise EngineError(f"NCCL weight sync: sent {sent} tensors, the engine expects {len(meta)}")


class PackedNCCLSender(NCCLWeightSender):
    """The source rank's side of vLLM's packed NCCL transfer (``weight_buckets``): the group is this rank (NCCL
    rank 0), ``relays`` more trainer ranks, then the engine's workers; one ``/update_weights`` names every tensor,
    then each bucket is one broadcast of its packed bytes, which vLLM's packed consumer splits by the same rule
    (``packed_buffer_size_bytes = bucket_bytes``). Driven bucket by bucket: ``begin``, ``send_bucket``, ``end``.

    ``post`` a list (an engine fleet, ``one_group``): several servers in the ONE group, server k's workers from
    rank ``1 + relays + k * engine_workers`` (``init_infos[k]``); every route is posted to every server at once
    (their ``/init_weight_transfer_engine`` all rendezvous with rank 0, their ``/update_weights`` all block in the
    same broadcasts), so each bucket is gathered to this rank and broadcast once for all of them. A dead server
    breaks the group for all: the caller makes a new one of the survivors (``sources/streamed.py``)."""

    def __init__(self, post: Callable[[str, dict | None], object] | list, *, master_address: str, master_port: int,
                 engine_workers: int, bucket_bytes: int, relays: int = 0,
                 open_group: Callable[[dict], object] | None = None, stream: Callable[[], object] | None = None):
        self.posts = list(post) if isinstance(post, (list, tuple)) else [post]
        super().__init__(self.posts[0], master_address=master_address, master_port=master_port,
                         engine_workers=engine_workers, open_group=open_group, stream=stream)
        K = len(self.posts)
        self.init_infos = [weight_transfer_init_info(master_address, master_port, engine_workers, 1 + relays,
                                                     bucket_bytes, engine=k, engines=K) for k in range(K)]
        self.init_info = self.init_infos[0]  # rank 0's and the relays' rendezvous (the whole group's world size)
        self._pool = self._done = None

    def _each(self, path: str, bodies: list | None = None) -> list:
        """``path`` posted to every server at once (``bodies[k]`` to server k); every answer, or the first error
        (each names its server's URL)."""
        if len(self.posts) == 1:
            return [self.posts[0](path, bodies[0] if bodies else None)]
        with ThreadPoolExecutor(max_workers=len(self.posts)) as pool:
            done = [pool.submit(p, path, bodies[k] if bodies else None) for k, p in enumerate(self.posts)]
            return [d.result() for d in done]

    def init(self) -> None:
        """Rank 0 and every server's workers meet in the group: the servers block in their POSTs until the
        trainer joins, so the POSTs run on side threads while rank 0 joins."""
        pool = ThreadPoolExecutor(max_workers=len(self.posts))
        try:
            done = [pool.submit(p, "/init_weight_transfer_engine", {"init_info": dict(i)})
                    for p, i in zip(self.posts, self.init_infos)]
            self.group = self.open_group(dict(self.init_info))
            for d in done:
                d.result()
        finally:
            pool.shutdown(wait=False)  # a server that failed leaves the others blocked in NCCL: never join them

    def begin(self, meta: list[ParamMeta], buckets: int) -> None:
        if self.group is None:
            raise EngineError("NCCL weight sender used before init()")
        self._each("/start_weight_update")
        update = weight_update_info([m.name for m in meta], [m.dtype for m in meta], [m.shape for m in meta])
        self._pool = ThreadPoolExecutor(max_workers=len(self.posts))
        self._done = [self._pool.submit(p, "/update_weights", {"update_info": update}) for p in self.posts]

    def send_bucket(self, flat: torch.Tensor, index: int, metas: list[ParamMeta]) -> None:
        for done in self._done:
            if done.done():  # a server refused the update before receiving: it will never receive
                done.result()
                raise EngineError(f"{self.update_route} returned before receiving bucket {index}")
        device = group_device(self.group)
        self.group.broadcast(flat if device is None else flat.to(device), src=0, stream=self.stream())

    def end(self, weight_version: str | None = None) -> None:
        try:
            for done in self._done:
                done.result()  # every server has loaded every bucket
        finally:
            self.abort()
        self._finish(weight_version)

    def _finish(self, weight_version: str | None) -> None:
        """Every server: finish (labelled ``weight_version``), reset its prefix cache; counted once."""
        self._each("/finish_weight_update", [finish_weight_update_body(weight_version)] * len(self.posts))
        for out in self._each("/reset_prefix_cache"):
            if isinstance(out, dict) and out.get("success") is False:
                raise EngineError("vLLM /reset_prefix_cache refused (requests still running?): cached blocks "
                                  "would keep the old weights' KV and routes")
        self.updates += 1

    def abort(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)  # a failed broadcast leaves the engine blocked in NCCL: never join it
        self._pool = None


def group_device(group) -> torch.device | None:
    """The device a weight-transfer group sends and receives on: vLLM's ``PyNcclCommunicator`` works on its
    ``device`` only (its broadcast asserts it; an int is a CUDA index) and sets it only once NCCL is up. One that
    disabled itself (one rank, ``VLLM_DISABLE_PYNCCL``, no NCCL library) has none and its broadcast returns
    without moving a byte: refused in one line, not taken for a host group. None: a host group (gloo stand-ins)."""
    if getattr(group, "disabled", False):
        raise EngineError("weight sync: the engine's NCCL transfer group is disabled on this rank (one rank, "
                          "VLLM_DISABLE_PYNCCL or no NCCL library): its broadcasts would move nothing")
    device = getattr(group, "device", None)
    if device is None:
        return None
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def vllm_relay_group(init_info: dict, rank: int):
    """A relay's side of the transfer group (trainer rank ``rank`` of it, 1 <= rank < rank_offset): vLLM's own
    stateless group and NCCL communicator on the current CUDA device, as its ``trainer_init`` makes rank 0's."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    pg = StatelessProcessGroup.create(host=init_info["master_address"], port=init_info["master_port"], rank=rank,
                                      world_size=init_info["world_size"])
    return PyNcclCommunicator(pg, device=torch.cuda.current_device())


def _vllm_trainer_init(init_info: dict):
    """vLLM's trainer-side helper: a stateless NCCL group with rank 0 on the current CUDA device."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init(init_info)
