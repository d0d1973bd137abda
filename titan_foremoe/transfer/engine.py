"""Replica weights moved ahead of use, and their gradients returned to the owners: executes compiled lists.

Each MoE layer has two *banks* (``banks.py``) used by alternating micro-steps. While micro-step m runs its
backward, the weights micro-step m+1 needs are already travelling into the other bank: one asynchronous
uneven all-to-all per layer over the EP group, waited on only when that layer's experts first run
(``wait``). The all-to-all's output IS the bank: the tables number bank rows in arrival order (direct
receives first, then the host lane's rows, then the replicas that stay), so each lane lands in one
contiguous run of the packed bank (``banks.py``) and no received row is copied a second time. A replica
that stays is copied locally from the other bank (one copy, straight into its run). Owned experts are never copied:
they are read straight from the rank's DTensor shard. What to send, receive and keep comes from the
rank's ``LayerTransfers`` (compiled ahead of the stage by ``placement/tables.py``); the engine derives no
schedule, it only checks that the tables were compiled for the weights it holds (``stale``).

Backward: ``ReplicaWeights`` makes the bank rows a function of the owners' shards, so every replica's
gradient goes back to its owner (one all-to-all per layer). Without a ``grad_sink`` the return blocks
and autograd sums it into the owner's gradient. With one (set by the placement runtime) the all-to-all is
issued asynchronously in the layer's backward and the owners' sums are added into the sink's parameter
gradients (FSDP's unsharded, full EP-local gradients) on the landing stream as soon as the owner's own
gradient is accumulated (``land_async``, started by ``landing.LandingWatch``'s hooks), while the compute
stream goes on; ``finish_gradients`` (the runtime: when backward reaches the transformer block's input,
before FSDP's reduce-scatter of that block) makes the compute stream wait for the landing's event, or, where
nothing started it, waits for the return and lands on the compute stream itself.
Buffers: one received gradient tensor per layer in flight (rows returned to this rank).

Two lanes, chosen per move by the cost model (``path = "auto"``) or forced:

* **direct**: the holder sends the weights over the collective backend (NCCL on GPU, gloo on CPU).
* **host** (CPU-assisted): after each optimizer step every owner stages *its own* experts in host memory
  (O(own experts) per rank, never O(all experts)); a move is an asynchronous gloo exchange of just the moved
  rows from the owners' host copies, issued ahead like the direct lane, into pinned memory (CUDA); at first
  use (``wait``) one non-blocking host-to-device copy lands them in their run of the bank. On CPU the
  exchange writes straight into the bank.

Streams, events, pinned buffers and ``record_stream`` go through ``distributed/device.py``: on CUDA torch's,
on CPU either no-ops (``plain``) or the checked backend, which runs this very program on emulated streams
under torch's sanitizer analysis. The side stream waits for the compute stream before it reads; every
device tensor it uses that the compute stream allocated is ``record_stream``-ed for it (the bank, the other
bank, the index tensors), so a free on the compute stream never hands the memory out while the side stream
still uses it; the compute stream waits for the side stream's event at first use (``wait``).

Timing (``stats.exposed_s``, ``seconds_by_path["direct"]``): on NCCL ``work.wait()`` returns at once, so waits
are timed by events on the compute stream (``timing.ExposedTimer``), resolved by ``take_stats`` without
draining (``drain=True`` once per optimizer step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..distributed import device as dev
from ..distributed.uploads import upload_one
from ..models.slot_gemm import InPlaceSplit, SlotWeights
from .autograd import ReplicaWeights
from .banks import LayerBanks, grad_rows, pack_rows, unpack_rows
from .host_key import HostKey
from .landing import LandingWatch
from .schedule import Exchange, LayerTransfers
from .stats import TransferStats
from .timing import ExposedTimer


@dataclass
class _Pending:
    works: list
    direct_rows: int  # rows the direct lane's all-to-all writes into the bank (``packed[:direct_rows]``)
    bank: int
    issued_at: object  # ExposedTimer.mark at issue: a compute-stream event
    event: object | None = None  # the side stream's work (all-to-all issue, kept copies) is done
    version: int = 0  # weights version the rows were read at
    # host lane: (work or None, pinned staging rows (None: received in the bank), their bank run, sent rows)
    host: tuple | None = None


@dataclass
class _Return:
    """One layer's gradient return in flight: the exchange's work (None once waited on the landing stream, or on
    one rank), the received rows, the send rows (kept alive for the collective), this rank's owned rows, and
    the landing stream's event once ``land_async`` started the landing."""

    work: object | None
    recv: torch.Tensor
    ex: Exchange
    send: torch.Tensor
    owned_rows: int
    landed: object | None = None


def _all_to_all(send: torch.Tensor, ex: Exchange, num_ranks: int, group, row_len: int, async_op: bool,
                pin: bool = False, out: torch.Tensor | None = None):
    """Run one exchange; returns (work or None, received rows in arrival order): into ``out`` if given (a
    contiguous ``[rows, row_len]`` tensor, e.g. a run of a bank), else a new tensor (a pinned host one if
    ``pin``: the host lane's staging)."""
    in_splits, out_splits = ex.splits(num_ranks)
    if out is None:
        recv = dev.host_empty((sum(out_splits), row_len), send.dtype) if pin else \
            torch.empty(sum(out_splits), row_len, dtype=send.dtype, device=send.device)
    else:
        if tuple(out.shape) != (sum(out_splits), row_len) or not out.is_contiguous() or out.dtype != send.dtype:
            raise ValueError(f"all-to-all output {tuple(out.shape)} {out.dtype} is not a contiguous "
                             f"[{sum(out_splits)}, {row_len}] {send.dtype} tensor")
        recv = out
    if group is None or num_ranks == 1:
        recv.copy_(send)  # a single rank only exchanges with itself
        # on the issuing (side) stream: ``send`` was allocated on the compute stream, and no c10d call keeps it
        # safe here (found by scripts/gpu_check.sh --cpu's stream program under the checked backend)
        dev.record_stream(send, dev.current_stream(send.device))
        return None, recv
    work = dist.all_to_all_single(recv, send.contiguous(), out_splits, in_splits, group=group, async_op=async_op)
    return work, recv


class TransferEngine:
    def __init__(self, group: dist.ProcessGroup | None, rank: int, num_ranks: int, node_of_rank_R: np.ndarray,
                 path: str = "direct", cost=None, host_group: dist.ProcessGroup | None = None,
                 grad_group: dist.ProcessGroup | None = None):
        if path not in ("direct", "host", "auto"):
            raise ValueError(f"transfer path must be direct, host or auto, got {path!r}")
        self.group = group
        self.rank = rank
        self.R = num_ranks
        self.node_of_rank_R = node_of_rank_R
        self.path = path
        self.cost = cost
        self.host_group = host_group if host_group is not None else group  # gloo on CPU
        # gradient returns on their own communicator: not queued behind the prefetches on ``group``
        self.grad_group = grad_group if grad_group is not None else group
        self.layers: dict[int, LayerBanks] = {}
        self.host_rows: dict[int, torch.Tensor] = {}  # layer -> [K, row] this rank's own experts, staged
        self.stats = TransferStats()
        self.weights_version = 0
        self.grad_sink = None  # layer -> the owned parameters whose .grad receives returned gradients (async)
        self._grad_pending: dict[int, _Return] = {}  # layer -> its gradient return in flight
        self.async_returns = 0  # gradient returns completed by finish_gradients with rows for this rank
        self.early_landings = 0  # of them, landed on the landing stream before the gate (``land_async``)
        self.early_returns = 0  # returns issued from the fused SwiGLU's backward, before its owned part
        self._early: set[int] = set()  # layers whose return was issued early and ReplicaWeights has not seen
        self._landing = LandingWatch()
        self._stream = None  # the transfer lane's side stream (``device.new_stream``)
        self._land_stream = None  # the owners' landing of returned gradients (``land_async``)
        self.stage_indices: dict[HostKey, torch.Tensor] = {}  # (table array, part) -> device copy
        # exposed waits and issue-to-arrival spans: CUDA events on the compute stream, resolved in take_stats
        self._exposed, self._direct = ExposedTimer(), ExposedTimer()
        self.layers_in_flight = self.max_layers_in_flight = 0  # layers whose send/receive buffers are alive

    @staticmethod
    def index_arrays(lt: LayerTransfers, slot_source_C: np.ndarray, K: int,
                     split=None) -> dict[HostKey, np.ndarray]:
        """Every index array this engine reads on the device for one (micro-step, layer), keyed as ``_index``
        looks them up: the runtime uploads a stage's worth in one copy ahead of use (``stage_indices``).
        ``split``: the layer's ``placement.tables.SlotSplit`` (the slot GEMM's in-place path) or None."""
        rows_T = lt.direct.send_row_T
        from_bank = rows_T >= K
        out = {HostKey(rows_T, "own_pos"): np.flatnonzero(~from_bank), HostKey(rows_T, "own_row"): rows_T[~from_bank],
               HostKey(rows_T, "bank_pos"): np.flatnonzero(from_bank), HostKey(rows_T, "bank_row"): rows_T[from_bank] - K,
               HostKey(slot_source_C, "clip0"): slot_source_C.clip(0)}
        # received and kept rows need no index: each lane fills one contiguous run of the bank (``_runs``)
        for a in (lt.keep_prev_row_U, lt.grad.send_row_T, lt.grad.recv_row_T):
            out[HostKey(a)] = a
        if split is not None:
            out[HostKey(split.spare_source_J)] = split.spare_source_J
            if len(split.spare_owned_U):
                out[HostKey(split.spare_owned_U)] = split.spare_owned_U
        return out

    def _index(self, host: np.ndarray, device: torch.device, part: str = "", derive=None) -> torch.Tensor:
        """Device copy of index array ``host`` (or of ``derive()``, its ``part``): from the stage's one upload,
        else (tables not uploaded ahead: reactive, direct engine use) uploaded now through the helper."""
        t = self.stage_indices.get(HostKey(host, part))
        if t is not None:
            return t
        return upload_one(host if derive is None else derive(), device)

    def _side_stream(self, device: torch.device):
        if self._stream is None:
            self._stream = dev.new_stream(device)
        return self._stream

    def weights_changed(self) -> None:
        """After an optimizer step every copy outside its owner is stale: it is re-fetched from the owner."""
        self.weights_version += 1

    def host_lanes(self) -> tuple[bool, bool]:
        """(intra-node moves, inter-node moves) take the CPU-assisted lane: the input of the table compiler."""
        if self.path == "auto":
            if self.cost is None:
                return False, False
            return bool(self.cost.use_host_path(False)), bool(self.cost.use_host_path(True))
        return (self.path == "host",) * 2

    def banks(self, layer: int, owned: tuple[torch.Tensor, ...], rows: int, dtype: torch.dtype) -> LayerBanks:
        """The layer's banks, allocated (or grown) for ``rows`` rows in ``dtype``."""
        lb = self.layers.get(layer)
        if lb is not None and lb.dtype != dtype and lb.pending is not None:
            raise RuntimeError(f"layer {layer}: banks re-allocated in {dtype} while a transfer writes into them")
        if lb is None or lb.dtype != dtype:
            lb = self.layers[layer] = LayerBanks([tuple(w.shape[1:]) for w in owned], rows, dtype, owned[0].device)
        lb.grow(rows)
        return lb

    @property
    def bank_bytes(self) -> int:
        return sum(lb.nbytes for lb in self.layers.values())

    def refresh_host_copies(self, layer: int, owned: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
        """Stage this rank's own experts in host memory (once per optimizer step, O(own experts))."""
        t0 = time.perf_counter()
        rows = pack_rows(*owned).to(dtype)
        host = dev.host_empty(rows.shape, rows.dtype)
        # the host sends these rows over gloo: it must hold them, so it waits for the copy (once per step)
        with dev.expected_sync("the host lane stages the owner's experts, once per layer per optimizer step"):
            self.host_rows[layer] = host.copy_(rows)
        self.stats.issue_s += time.perf_counter() - t0
        self.stats.seconds_by_path["host"] += time.perf_counter() - t0

    @staticmethod
    def _runs(layer: int, lt: LayerTransfers, rows: int) -> tuple[int, int, int]:
        """(direct, host, kept) row counts; refuses tables whose bank rows are not in arrival order (direct
        0.., then host, then kept: what lets each lane land in place). Host-side check, O(rows)."""
        nd, nh, nk = len(lt.direct.recv_row_T), len(lt.host.recv_row_T), len(lt.keep_row_U)
        for name, got, start in (("direct receive", lt.direct.recv_row_T, 0), ("host receive", lt.host.recv_row_T, nd),
                                 ("kept", lt.keep_row_U, nd + nh)):
            if not np.array_equal(got, np.arange(start, start + len(got))):
                raise RuntimeError(f"layer {layer}: {name} bank rows {got.tolist()} are not {start}.. in arrival "
                                   "order (tables not compiled by placement/tables.py?)")
        if nd + nh + nk > rows:
            raise RuntimeError(f"layer {layer}: {nd + nh + nk} replica rows do not fit a bank of {rows}")
        return nd, nh, nk

    @torch.no_grad()  # copies of weights into send rows and banks: never part of a graph
    def prefetch(self, layer: int, owned: tuple[torch.Tensor, ...], lt: LayerTransfers, bank: int,
                 rows: int, dtype: torch.dtype) -> None:
        """Start filling ``bank`` with this rank's replicas of one (micro-step, layer): the direct lane's
        all-to-all writes into the bank's first rows, the host lane's into the next (on CUDA: at ``wait``),
        kept replicas are copied from the other bank into the rest."""
        t0 = time.perf_counter()
        issued = ExposedTimer.mark(owned[0].device)
        lb = self.banks(layer, owned, rows, dtype)
        if lb.pending is not None:
            raise RuntimeError(f"layer {layer}: a transfer is still in flight")
        nd, nh, nk = self._runs(layer, lt, lb.rows)
        packed, other = lb.packed[bank], lb.packed[1 - bank]
        K = owned[0].shape[0]
        rows_T = lt.direct.send_row_T
        from_bank = rows_T >= K
        if (len(lt.keep_row_U) or from_bank.any()) and not lt.stale \
                and lb.version[1 - bank] != self.weights_version:
            raise RuntimeError(
                f"layer {layer}: the weights changed since the other bank was filled, but these tables keep or "
                "send its copies (compiled for a micro-step inside an optimizer step: plan and steps disagree)"
            )
        # direct lane: rows from the owned experts or the other bank, read on the compute stream: ``owned``
        # may be FSDP's unsharded buffer (issued from inside the layer's forward), freed after the layer.
        # Only owned rows (always after an optimizer step): one gather per matrix straight into its (strided)
        # part of the send rows; with rows from the other bank too, a gather and an index_copy_ (two copies).
        send = owned[0].new_empty(len(rows_T), lb.row_len, dtype=dtype)
        if len(rows_T):
            device = owned[0].device
            r_own = self._index(rows_T, device, "own_row", lambda: rows_T[~from_bank])
            parts = unpack_rows(send, lb.shapes)
            if not from_bank.any() and all(w.dtype == dtype for w in owned):
                for part, w in zip(parts, owned):
                    torch.index_select(w, 0, r_own, out=part)
            else:
                i_own = self._index(rows_T, device, "own_pos", lambda: np.flatnonzero(~from_bank))
                i_bank = self._index(rows_T, device, "bank_pos", lambda: np.flatnonzero(from_bank))
                r_bank = self._index(rows_T, device, "bank_row", lambda: rows_T[from_bank] - K)
                for part, w in zip(parts, owned):
                    part.index_copy_(0, i_own, w.index_select(0, r_own).to(dtype))
                send.index_copy_(0, i_bank, other.index_select(0, r_bank))
        stream = self._side_stream(owned[0].device)
        compute = dev.current_stream(owned[0].device)
        stream.wait_stream(compute)  # the side stream sees the rows and banks as the compute stream left them
        # allocated on the compute stream, used on the side stream: not handed out again before it is done
        # (``send`` and the bank's received rows are the collective's: c10d keeps those safe itself)
        for t in (packed, other):
            dev.record_stream(t, stream)
        with dev.use_stream(stream):
            # the receive buffer IS the bank: rows 0..nd-1 are the direct lane's, in arrival order
            work, _ = _all_to_all(send, lt.direct, self.R, self.group, lb.row_len, async_op=True, out=packed[:nd])
            nbytes = lb.row_len * send.element_size()
            inter = int(lt.send_inter_T.sum())
            self.stats.bytes_by_path["inter_node"] += inter * nbytes
            self.stats.bytes_by_path["intra_node"] += (len(lt.send_inter_T) - inter) * nbytes
            self.stats.transfers += len(lt.direct.send_peer_T)
            pending = _Pending([work] if work is not None else [], nd, bank, issued)
            # replicas that stay: one copy from the other bank straight into their run (rows nd+nh..)
            if nk:
                prev = self._index(lt.keep_prev_row_U, owned[0].device)
                dev.record_stream(prev, stream)
                torch.index_select(other, 0, prev, out=packed[nd + nh: nd + nh + nk])
                self.stats.local_copies += nk
            # host lane: the owners' staged rows, exchanged on the host group, then copied into the bank
            # a collective over the group: every rank joins when any rank of the group moves a row of this layer
            # on it (``host_any``, the same on all ranks), also with nothing to move itself
            if lt.host_any and self.R > 1 or len(lt.host.send_peer_T) or len(lt.host.recv_peer_T):
                t_host = time.perf_counter()
                if len(lt.host.send_peer_T) and layer not in self.host_rows:
                    raise RuntimeError(f"layer {layer}: host path used before refresh_host_copies")
                send_rows = torch.as_tensor(lt.host.send_row_T, dtype=torch.long)
                staged = self.host_rows.get(layer)
                hsend = staged.index_select(0, send_rows) if staged is not None else \
                    dev.host_empty((0, lb.row_len), dtype)
                # issued ahead like the direct lane, into pinned staging, landed at ``wait`` (first use) by one
                # non-blocking copy; the plain CPU backend receives straight into its run of the bank
                run = packed[nd: nd + nh]
                on_host = dev.backend().host_is_device and not owned[0].is_cuda
                hwork, hrecv = _all_to_all(hsend, lt.host, self.R, self.host_group, lb.row_len, async_op=True,
                                           pin=not on_host, out=run if on_host else None)
                pending.host = (hwork, None if on_host else hrecv, run, hsend)
                self.stats.bytes_by_path["host"] += hrecv.numel() * hrecv.element_size()
                self.stats.transfers += len(lt.host.recv_peer_T)
                self.stats.seconds_by_path["host"] += time.perf_counter() - t_host
            pending.event = dev.event()
            pending.event.record(stream)
        pending.version = self.weights_version
        lb.pending = pending
        self.layers_in_flight += 1
        self.max_layers_in_flight = max(self.max_layers_in_flight, self.layers_in_flight)
        lb.version[bank] = self.weights_version
        self.stats.issue_s += time.perf_counter() - t0

    def wait(self, layer: int) -> None:
        """Block until this layer's replicas have arrived (first use); counts exposed time."""
        lb = self.layers.get(layer)
        if lb is None or lb.pending is None:
            return
        start = ExposedTimer.mark(lb.device)
        p = lb.pending
        if p.version != self.weights_version:
            raise RuntimeError(f"layer {layer}: an optimizer step ran while this transfer was in flight: its rows "
                               "carry the old weights (prefetch a step's first micro-step after the step)")
        for w in p.works:
            w.wait()  # NCCL: the compute stream waits (the host does not); gloo: blocks
        if p.host is not None:  # host lane: gloo on the host (usually done: issued ahead)
            t_host = time.perf_counter()
            hwork, staged, run, _ = p.host
            if hwork is not None:
                hwork.wait()
            if staged is not None and len(run):  # pinned rows -> their bank run, async on the compute stream
                run.copy_(staged, non_blocking=True)
            self.stats.seconds_by_path["host"] += time.perf_counter() - t_host
        if p.event is not None:  # first-use wait by event on the side stream's work (the rows are in the bank)
            dev.current_stream(lb.device).wait_event(p.event)
        lb.pending = None
        self.layers_in_flight -= 1
        end = self._exposed.since(start, lb.device)
        if p.works and p.direct_rows:
            self._direct.add(p.issued_at, end)

    def take_stats(self, drain: bool = False) -> TransferStats:
        """Stats since the last call; timers of completed events only (``drain``: all, waiting for them)."""
        stats, self.stats = self.stats, TransferStats()
        stats.exposed_s += self._exposed.take(drain)
        stats.seconds_by_path["direct"] += self._direct.take(drain)
        return stats

    def slot_weights(self, layer: int, owned: tuple[torch.Tensor, ...], slot_source_C: np.ndarray,
                     lt: LayerTransfers, bank: int, dtype: torch.dtype, wait: bool = True,
                     split=None) -> tuple[SlotWeights, ...]:
        """This rank's slots' weights (in ``dtype``): owned from the shard, replicas from the bank.

        Not a ``[C, ...]`` copy: ``SlotWeights`` (``models/slot_gemm.py``), read by the grouped GEMM, so nothing
        but the shard, the bank and indices is saved. ``split`` (``placement.tables.SlotSplit``, host data):
        the GEMM reads the owned slots in place and gathers only the spare slots' bank rows; None: it gathers
        all C slots in forward and again in backward.
        ``wait = False`` (activation checkpointing's recompute): the forward landed ``bank``; what is in flight
        now is the next micro-step's transfer into the other bank, left to its own first use.
        """
        if wait:
            self.wait(layer)
        lb = self.layers.get(layer)
        if lb is None:
            lb = self.banks(layer, owned, 0, dtype)
        # no replica in this layer on any rank (static's layers, some of foremoe's): no gradient return to join
        replicas = ReplicaWeights.apply(self, layer, lt.grad, *owned, *lb.banks[bank]) if lt.grad_any \
            else tuple(lb.banks[bank])
        gated = lt.grad_any and self.grad_sink is not None  # an async return, finished at the block's gate
        if gated:
            self._landing.watch(layer, self.grad_sink(layer), self.land_async)
        device = owned[0].device
        index = self._index(slot_source_C, device, "clip0", lambda: slot_source_C.clip(0))
        in_place = None
        if split is not None:
            J = len(split.spare_source_J)  # in order: spare slot s reads bank row s, every row (no gather)
            in_order = (not len(split.spare_owned_U) and J == lb.banks[bank][0].shape[0]
                        and np.array_equal(split.spare_source_J, np.arange(J)))
            # the bank's gradient returned from inside the fused SwiGLU's backward, before its owned part
            early = (lambda grads: self._return_early(layer, lt.grad, grads, owned[0].shape[0])) if gated else None
            in_place = InPlaceSplit(split.owned_rows, split.spare_rows, self._index(split.spare_source_J, device),
                                    self._index(split.spare_owned_U, device) if len(split.spare_owned_U) else None,
                                    bool(in_order), early)
        return tuple(SlotWeights(o.to(dtype), b, index, in_place) for o, b in zip(owned, replicas))

    def return_gradients(self, layer: int, ex: Exchange, grads_B, owned_shapes, owned_dtype) -> tuple:
        """Send each bank row's gradient to its expert's owner; return the owner-side sums (owned dtype)."""
        shapes = [tuple(s[1:]) for s in owned_shapes]
        row_len = sum(int(np.prod(s)) for s in shapes)
        device = grads_B[0].device
        send = grad_rows(*grads_B, ex.send_row_T, lambda: self._index(ex.send_row_T, device))
        _, recv = _all_to_all(send, ex, self.R, self.grad_group, row_len, async_op=False)
        self.stats.grad_return_bytes += send.numel() * send.element_size()
        out = [torch.zeros(s, dtype=owned_dtype, device=device) for s in owned_shapes]
        if len(ex.recv_row_T):
            local = self._index(ex.recv_row_T, device)
            for o, g in zip(out, unpack_rows(recv, shapes)):
                o.index_add_(0, local, g.to(owned_dtype))
        return tuple(out)

    def _return_early(self, layer: int, ex: Exchange, grads_B, owned_rows: int) -> None:
        """The fused SwiGLU has the bank's gradients (its spare part ran first): issue their return now, so it
        travels while the owned part's backward runs; ``ReplicaWeights`` then finds it issued."""
        self.return_gradients_async(layer, ex, grads_B, owned_rows)
        self._early.add(layer)
        self.early_returns += 1

    def returned_early(self, layer: int) -> bool:
        """Whether ``layer``'s return was issued from inside the layer's backward (once: the flag is taken)."""
        if layer in self._early:
            self._early.discard(layer)
            return True
        return False

    def return_gradients_async(self, layer: int, ex: Exchange, grads_B, owned_rows: int) -> None:
        """Issue the return of each bank row's gradient to its owner; ``finish_gradients`` completes it."""
        if layer in self._grad_pending:
            raise RuntimeError(f"layer {layer}: a gradient return is still in flight")
        row_len = sum(int(np.prod(g.shape[1:])) for g in grads_B)
        device = grads_B[0].device
        send = grad_rows(*grads_B, ex.send_row_T, lambda: self._index(ex.send_row_T, device))
        work, recv = _all_to_all(send, ex, self.R, self.grad_group, row_len, async_op=True)
        self.stats.grad_return_bytes += send.numel() * send.element_size()
        self._grad_pending[layer] = _Return(work, recv, ex, send, owned_rows)

    def _sink_grads(self, layer: int, K: int) -> list[torch.Tensor]:
        """The sink's gradients as local tensors (zeros where none yet, made on the current stream)."""
        grads = []
        with torch.no_grad():
            for p in self.grad_sink(layer):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                if grad.shape[0] != K:  # FSDP's reduce-scatter already ran: the sum would be lost or misplaced
                    raise RuntimeError(f"layer {layer}: returned gradients arrived after FSDP resharded the experts")
                grads.append(grad)
        return grads

    @staticmethod
    def _land(recv: torch.Tensor, local: torch.Tensor, grads: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for grad, g in zip(grads, unpack_rows(recv, [tuple(x.shape[1:]) for x in grads])):
                grad.index_add_(0, local, g.to(grad.dtype))

    def land_async(self, layer: int) -> None:
        """Start adding ``layer``'s returned gradients into the sink's on the landing stream: called once the
        sink's parameters have their own gradient of this backward (``landing.LandingWatch``), so the return
        is issued. The landing stream waits for the compute stream (the owner's gradient, the receive buffer),
        then for the return's all-to-all (NCCL: a stream wait; gloo: the host blocks); ``finish_gradients``
        makes the compute stream wait for its event. Nothing to land here (no row returned to this rank): the
        gate waits for the exchange alone, as before."""
        p = self._grad_pending.get(layer)
        if p is None or p.landed is not None or not len(p.ex.recv_row_T):
            return
        recv = p.recv
        grads = self._sink_grads(layer, p.owned_rows)
        device = recv.device
        local = self._index(p.ex.recv_row_T, device)
        if self._land_stream is None:
            self._land_stream = dev.new_stream(device)
        stream = self._land_stream
        stream.wait_stream(dev.current_stream(device))
        for t in (recv, local):  # made on the compute stream, read on the landing stream
            dev.record_stream(t, stream)
        with dev.use_stream(stream):
            if p.work is not None:
                p.work.wait()
            self._land(recv, local, grads)
            p.landed = dev.event()
            p.landed.record(stream)
        p.work = None

    def finish_gradients(self, layer: int) -> None:
        """``layer``'s returned gradients in ``grad_sink(layer)``'s gradients before the compute stream goes on:
        it waits for the landing stream's event (``land_async`` ran), or for the return, then lands itself."""
        p = self._grad_pending.pop(layer, None)
        if p is None:
            return
        device = p.recv.device
        if p.landed is not None:
            with self._exposed.span(device):
                dev.current_stream(device).wait_event(p.landed)
            self.async_returns += 1
            self.early_landings += 1
            return
        if p.work is not None:
            with self._exposed.span(device):
                p.work.wait()
        if not len(p.ex.recv_row_T):
            return
        self.async_returns += 1
        self._land(p.recv, self._index(p.ex.recv_row_T, device), self._sink_grads(layer, p.owned_rows))

    def drop_landing_watches(self) -> None:
        """A micro-step ended: hooks not fired (no backward ran, or it failed) are removed, with the flags of
        returns issued early that no ``ReplicaWeights`` took."""
        self._landing.drop()
        self._early.clear()

    @property
    def gradients_in_flight(self) -> list[int]:
        return sorted(self._grad_pending)
