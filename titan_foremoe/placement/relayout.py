"""Step-boundary re-layout: experts change owner with their optimizer state.

With ``owner_policy = "balanced"`` the planner may give an expert a new owner at an optimizer step.
Rank r's EP shard holds the experts it owns in ascending order (``planner.owners.physical_rows_LE``), so a
new owner map is a permutation of the rows of every expert weight ``[E, ...]`` and of every optimizer-state
tensor of the same shape (AdamW's two moments). The rows are moved as FSDP holds them between steps
(sharded over ``efsdp`` as well): each rank sends and receives only its own row pieces, in one uneven
all-to-all per layer over the ranks of one ``dp_replicate`` replica (the expert mesh without that axis).
Nothing is gathered: a rank's metadata is O(E + G) per layer.

``ExpertLayout`` owns the map of every MoE layer (``owner_LE``): the placement runtime asks it for the
layout a micro-step was planned with, the native dispatch (no plan: rollout, supervised steps) maps
logical expert ids to rows through ``MaskedMoE``'s dispatcher (``expert_rows_E``), and checkpoints
are written in logical order (``logical()``: contiguous rows while the checkpointer reads them; the map is
saved beside them and restored after a load).

Cost per moved expert and rank: params x (4 B fp32 master + 8 B AdamW moments) / efsdp; Qwen3-30B-A3B
(4.7 M params per expert) moves 57 MB per expert, e.g. 0.45 ms intra-node at 125 GB/s per rank with
efsdp = 8. The planner's hysteresis keeps RL's stable hot experts in place (few moves per step).

Legend: L layers, E experts (rows of a weight), G ranks of the re-layout group, W rows of a tensor on this
rank, N rows this rank sends or receives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from ..distributed import groups
from ..distributed.uploads import upload_one
from ..models.seams import moe_layers
from ..planner.owners import check_owners, contiguous_owners, physical_rows_LE
from ..transfer.timing import ExposedTimer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowLayout:
    """The rows of an ``[E, ...]`` tensor each rank of the group holds between steps.

    ``row0_G``/``rows_G``: first global row and row count of each group rank (FSDP shards contiguous row
    ranges); ``col_G``: which column piece a rank holds (ranks that shard a later dim hold the same rows
    in different pieces, and only exchange with ranks of their own piece); ``me``: this rank's index.
    """

    row0_G: np.ndarray
    rows_G: np.ndarray
    col_G: np.ndarray
    me: int

    @classmethod
    def of(cls, w: torch.Tensor, group_ranks: list[int]) -> RowLayout:
        if not isinstance(w, DTensor):
            return cls(np.zeros(1, np.int64), np.array([w.shape[0]]), np.zeros(1, np.int64), 0)
        mesh = w.device_mesh
        ranks = mesh.mesh.numpy()
        starts, counts, cols = [], [], []
        for g in group_ranks:
            coord = [int(c[0]) for c in np.nonzero(ranks == g)]
            shape, offset = _compute_local_shape_and_global_offset(w.shape, mesh.shape, coord, w.placements)
            starts.append(offset[0])
            counts.append(shape[0])
            cols.append(tuple(offset[1:]))
        _, col_G = np.unique(np.array(cols).reshape(len(cols), -1), axis=0, return_inverse=True)
        return cls(np.array(starts), np.array(counts), col_G.ravel(), group_ranks.index(dist.get_rank()))


@dataclass(frozen=True)
class RowMoves:
    """This rank's part of one permutation ``new[q] = old[src_row_E[q]]``.

    Sends ordered by (destination, new row), receives by (source, new row): both ends agree unasked.
    """

    send_local_N: np.ndarray  # my local rows to send
    send_counts_G: list[int]
    recv_local_N: np.ndarray  # my local rows the received rows land in
    recv_counts_G: list[int]
    keep_src_N: np.ndarray  # local re-orders: my local row ...
    keep_dst_N: np.ndarray  # ... lands in my local row


def row_moves(layout: RowLayout, src_row_E: np.ndarray) -> RowMoves:
    """Which rows this rank sends, receives and re-orders for the permutation ``src_row_E``."""
    me, G = layout.me, len(layout.rows_G)
    E = len(src_row_E)
    peers = np.nonzero(layout.col_G == layout.col_G[me])[0]  # ranks holding my column piece: they cover E rows
    peers = peers[np.argsort(layout.row0_G[peers], kind="stable")]
    holder_E = np.repeat(peers, layout.rows_G[peers])
    if len(holder_E) != E:
        raise ValueError(f"re-layout: the group's row pieces cover {len(holder_E)} rows, not {E}")
    row0 = layout.row0_G
    q_all = np.arange(E)
    src_holder = holder_E[src_row_E]
    # receives: my new rows whose old row lives elsewhere; re-orders: old row mine, different position
    mine = holder_E == me
    q_in = q_all[mine & (src_holder != me)]
    q_keep = q_all[mine & (src_holder == me) & (src_row_E != q_all)]
    q_in = q_in[np.lexsort((q_in, src_holder[q_in]))]
    # sends: rows new elsewhere whose old row is mine
    q_out = q_all[(src_holder == me) & ~mine]
    q_out = q_out[np.lexsort((q_out, holder_E[q_out]))]
    return RowMoves(
        send_local_N=src_row_E[q_out] - row0[me],
        send_counts_G=np.bincount(holder_E[q_out], minlength=G).tolist(),
        recv_local_N=q_in - row0[me],
        recv_counts_G=np.bincount(src_holder[q_in], minlength=G).tolist(),
        keep_src_N=src_row_E[q_keep] - row0[me],
        keep_dst_N=q_keep - row0[me],
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass
class _LayerMove:
    tensors: list[torch.Tensor]  # local tensors written in place at finish
    moves: RowMoves
    recv: torch.Tensor | None
    kept: torch.Tensor | None
    work: object | None


@dataclass
class RelayoutStats:
    """What re-layouts cost this rank since the last ``take_stats`` (TensorBoard ``relayout/*``)."""

    experts_moved: int = 0  # logical experts whose owner changed (all layers)
    bytes_sent: int = 0  # this rank's rows sent (weights and optimizer state)
    exposed_s: float = 0.0  # compute-stream time spent issuing and waiting for re-layouts (``ExposedTimer``)
    relayouts: int = 0


class ExpertLayout:
    """The logical -> physical expert map of every MoE layer, and the re-layouts that change it.

    ``states_of(param)``: the optimizer-state tensors of a parameter (moved with it when they have its
    shape). ``group``: the ranks of one ``dp_replicate`` replica of the expert mesh (``replica_group``).
    """

    def __init__(self, model: torch.nn.Module, num_ranks: int, group: dist.ProcessGroup | None,
                 states_of: Callable[[torch.Tensor], list[torch.Tensor]]):
        self.layers = moe_layers(model)
        self.R = num_ranks
        self.E = self.layers[0].router.num_experts if self.layers else 0
        self.group = group
        self.group_ranks = dist.get_process_group_ranks(group) if group is not None else [0]
        self.states_of = states_of
        self.owner_LE = contiguous_owners(len(self.layers), self.E, num_ranks)
        self._pending: tuple[np.ndarray, list[_LayerMove], float] | None = None
        self._layouts: dict = {}
        self._saved_owner_LE: np.ndarray | None = None
        self._restore_to: np.ndarray | None = None
        self.stats = RelayoutStats()
        self._exposed = ExposedTimer()  # issue + wait on the compute stream (CUDA events), host time on CPU
        self._fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]

    @property
    def _device(self) -> torch.device:
        """Where the experts live (the compute stream the exposed time is measured on)."""
        return _local(self.layers[0].routed_experts.inner_experts.w1_EFD).device if self.layers else torch.device("cpu")

    # -- the map -------------------------------------------------------------------------------------
    @property
    def contiguous(self) -> np.ndarray:
        return contiguous_owners(len(self.layers), self.E, self.R)

    def _set_native_maps(self) -> None:
        """The native dispatch (no plan) sends logical expert e to row ``row_LE[l, e]``."""
        rows_LE = physical_rows_LE(self.owner_LE, self.R)
        identity = np.array_equal(self.owner_LE, self.contiguous)
        for layer, moe in enumerate(self.layers):
            d = moe.routed_experts.token_dispatcher
            d.set_expert_rows(None if identity else rows_LE[layer])

    def _tensors(self, layer: int) -> list[torch.Tensor]:
        e = self.layers[layer].routed_experts.inner_experts
        out = []
        for p in (e.w1_EFD, e.w2_EDF, e.w3_EFD):
            out.append(p)
            out += [s for s in self.states_of(p) if isinstance(s, torch.Tensor) and s.shape == p.shape]
        return out

    def _row_layout(self, t: torch.Tensor) -> RowLayout:
        key = (tuple(t.shape), getattr(t, "placements", None), id(getattr(t, "device_mesh", None)))
        if key not in self._layouts:
            self._layouts[key] = RowLayout.of(t, self.group_ranks)
        return self._layouts[key]

    # -- moving --------------------------------------------------------------------------------------
    def start(self, owner_LE: np.ndarray) -> None:
        """Issue the moves to ``owner_LE`` (asynchronous); ``finish`` applies them. The tensors must not
        change in between (read at issue, written at finish)."""
        self.finish()
        owner_LE = check_owners(owner_LE, len(self.layers), self.E, self.R)
        if self.group is None and dist.is_initialized() and dist.get_world_size() > 1 \
                and not np.array_equal(owner_LE, self.owner_LE):
            raise RuntimeError("this expert layout has no re-layout group: only balanced owners move experts")
        t0 = ExposedTimer.mark(self._device)
        for m in self._fsdp_modules:  # FSDP may leave a block unsharded after a forward: move the shards
            m.reshard()
        old_rows, new_rows = physical_rows_LE(self.owner_LE, self.R), physical_rows_LE(owner_LE, self.R)
        moved = []
        for layer in np.nonzero((owner_LE != self.owner_LE).any(axis=1))[0]:
            src_row_E = np.empty(self.E, dtype=np.int64)
            src_row_E[new_rows[layer]] = old_rows[layer]
            moved.append(self._start_layer(int(layer), src_row_E))
            self.stats.experts_moved += int((owner_LE[layer] != self.owner_LE[layer]).sum())
        self._pending = (owner_LE, moved, t0)
        self._exposed.since(t0, self._device)

    def _start_layer(self, layer: int, src_row_E: np.ndarray) -> _LayerMove:
        tensors = self._tensors(layer)
        moves = row_moves(self._row_layout(tensors[0]), src_row_E)
        for t in tensors[1:]:
            if self._row_layout(t).row0_G.tolist() != self._row_layout(tensors[0]).row0_G.tolist():
                raise ValueError(f"layer {layer}: expert tensors are sharded differently; cannot move their rows together")
        locals_ = [_local(t.detach()) for t in tensors]
        dtypes = {t.dtype for t in locals_}
        if len(dtypes) != 1:
            raise ValueError(f"layer {layer}: expert weights and optimizer state differ in dtype {dtypes}")
        with torch.no_grad():
            idx = upload_one(moves.send_local_N, locals_[0].device)
            send = torch.cat([t.index_select(0, idx).reshape(len(idx), int(np.prod(t.shape[1:]))) for t in locals_],
                             dim=1)
            keep_idx = upload_one(moves.keep_src_N, locals_[0].device)
            kept = [t.index_select(0, keep_idx) for t in locals_] if len(keep_idx) else None
            recv = work = None
            if self.group is not None:  # every rank of the group joins: each moved layer is one collective
                recv = send.new_empty((len(moves.recv_local_N), send.shape[1]))
                work = dist.all_to_all_single(recv, send.contiguous(), moves.recv_counts_G, moves.send_counts_G,
                                              group=self.group, async_op=True)
            self.stats.bytes_sent += send.numel() * send.element_size()
        return _LayerMove(locals_, moves, recv, kept, work)

    def finish(self) -> None:
        """Wait for the issued moves and write them into the weights and optimizer state."""
        if self._pending is None:
            return
        owner_LE, moved, _ = self._pending
        t0 = ExposedTimer.mark(self._device)
        for m in self._fsdp_modules:  # a forward since start may have left blocks unsharded ("never" reshard):
            m.reshard()  # drop those copies, so the next forward gathers the moved shards
        with torch.no_grad():
            for mv in moved:
                if mv.work is not None:
                    mv.work.wait()
                dev = mv.tensors[0].device
                if mv.kept is not None:
                    dst = upload_one(mv.moves.keep_dst_N, dev)
                    for t, k in zip(mv.tensors, mv.kept):
                        t.index_copy_(0, dst, k)
                if mv.recv is not None and len(mv.moves.recv_local_N):
                    dst = upload_one(mv.moves.recv_local_N, dev)
                    start = 0
                    for t in mv.tensors:
                        width = int(np.prod(t.shape[1:]))
                        t.index_copy_(0, dst, mv.recv[:, start : start + width].reshape(len(dst), *t.shape[1:]))
                        start += width
        self.owner_LE = owner_LE
        self._pending = None
        self.stats.relayouts += bool(moved)
        self._exposed.since(t0, self._device)
        self._set_native_maps()

    def move_to(self, owner_LE: np.ndarray) -> None:
        """Re-lay out now (issue and wait), unless ``owner_LE`` is already in effect or on its way."""
        if self._pending is not None and np.array_equal(self._pending[0], owner_LE):
            self.finish()
        elif not np.array_equal(owner_LE, self.owner_LE):
            self.start(owner_LE)
            self.finish()

    @property
    def pending_owner_LE(self) -> np.ndarray | None:
        return None if self._pending is None else self._pending[0]

    def take_stats(self) -> RelayoutStats:
        """The stats since the last call, exposed time resolved (waits for its CUDA events: once per stage)."""
        stats, self.stats = self.stats, RelayoutStats()
        stats.exposed_s += self._exposed.take()
        return stats

    # -- checkpoints ---------------------------------------------------------------------------------
    @contextmanager
    def logical(self):
        """Within the block the weights and optimizer state are in logical (contiguous) order, as a
        checkpoint or an HF export must be; the map in effect is what ``state_dict`` saves."""
        self.finish()
        self._saved_owner_LE = self.owner_LE
        stats = self.take_stats()  # these moves belong to the checkpoint's time, not to a step's relayout/*
        self.move_to(self.contiguous)
        try:
            yield
        finally:
            saved, self._saved_owner_LE = self._saved_owner_LE, None
            self.move_to(saved)
            self.stats = stats

    def state_dict(self) -> dict:
        owner_LE = self.owner_LE if self._saved_owner_LE is None else self._saved_owner_LE
        return {"owner_LE": torch.tensor(owner_LE, dtype=torch.int64)}  # a copy: DCP loads into it in place

    def load_state_dict(self, state_dict: dict) -> None:
        """The loaded weights are in logical order; ``restore`` re-lays them out as saved."""
        self.finish()
        self.owner_LE = self.contiguous
        self._set_native_maps()
        try:
            self._restore_to = check_owners(state_dict["owner_LE"].numpy(), len(self.layers), self.E, self.R)
        except ValueError as e:  # saved with another EP degree: the logical weights start contiguous
            logger.info("checkpoint's expert owners do not fit EP %d (%s): experts start in the contiguous layout",
                        self.R, e)
            self._restore_to = None

    def restore(self) -> None:
        """After a checkpoint load: move to the saved map."""
        if self._restore_to is not None:
            target, self._restore_to = self._restore_to, None
            self.move_to(target)


def replica_group(w: DTensor) -> dist.ProcessGroup:
    """The ranks of this rank's ``dp_replicate`` replica of the expert mesh of ``w`` (one group per replica,
    created collectively on every rank)."""
    mesh = w.device_mesh
    ranks = mesh.mesh
    names = list(mesh.mesh_dim_names or ())
    if "dp_replicate" in names:
        ranks = ranks.movedim(names.index("dp_replicate"), 0)
        slices = [r.flatten().tolist() for r in ranks]
    else:
        slices = [ranks.flatten().tolist()]
    return groups.subgroups(slices)  # with the job's timeout


