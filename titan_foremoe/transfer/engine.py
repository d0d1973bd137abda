"""Replica weights moved ahead of use, and their gradients returned to the owners.

Each MoE layer has two *banks* of C slot buffers (w1, w2, w3), used by
alternating micro-steps. While micro-step m runs its backward, the weights
that micro-step m+1 needs are already travelling into the other bank: one
asynchronous uneven all-to-all per layer over the EP group, waited on only
when that layer's experts first run (``wait``). A replica that stays on its
rank from one micro-step to the next is copied locally from the other bank;
the plan lists every real move, including the re-sends after an optimizer
step (stale weights). Owned experts are never copied: they are read straight
from the rank's DTensor shard.

Backward: ``ReplicaWeights`` makes the bank rows a function of the owners'
shards, so the gradient of every replica is sent back to its owner (one
all-to-all per layer, in the backward pass) and summed into the owner's
parameter gradient by autograd, before the optimizer step. Doing it per
micro-step keeps no extra gradient buffers and moves exactly the bytes of the
forward transfers.

Two paths, chosen per move by the cost model (``path = "auto"``) or forced:

* **direct**: the holder sends the weights over the collective backend (the
  asynchronous all-to-all above; NCCL on GPU, gloo on CPU).
* **host** (CPU-assisted): after every optimizer step each owner's experts are
  staged in host memory and all-gathered over a gloo group, so every rank has
  a host copy of every expert; a move is then a host-to-device copy into the
  bank (on a side stream on GPU), with no collective at transfer time.

On CPU both paths run the same code minus streams.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ..placement.layout import LayerLayout


@dataclass
class TransferStats:
    """Per micro-step: what moved and what it cost."""

    transfers: int = 0
    bytes_by_path: dict = field(default_factory=lambda: {"intra_node": 0, "inter_node": 0, "host": 0})
    # direct: from issuing the all-to-all to its arrival at first use (an upper bound on the wire time);
    # host: staging refreshes plus the copies into the banks
    seconds_by_path: dict = field(default_factory=lambda: {"direct": 0.0, "host": 0.0})
    issue_s: float = 0.0
    exposed_s: float = 0.0  # time spent waiting for transfers at first use
    local_copies: int = 0
    grad_return_bytes: int = 0


def _rows(w1, w2, w3) -> torch.Tensor:
    """Pack experts ``[n, F, D] x 3`` into rows ``[n, 3*F*D]``."""
    n = w1.shape[0]
    return torch.cat([w1.reshape(n, -1), w2.reshape(n, -1), w3.reshape(n, -1)], dim=1)


def _unpack(rows: torch.Tensor, shapes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = rows.shape[0]
    sizes = [int(np.prod(s)) for s in shapes]
    a, b, c = rows.split(sizes, dim=1)
    return a.reshape(n, *shapes[0]), b.reshape(n, *shapes[1]), c.reshape(n, *shapes[2])


def _exchange(sends: list[list[tuple[int, int, int]]], me: int, num_ranks: int):
    """Split sizes of an uneven all-to-all that every rank derives from the same plan.

    ``sends[src]`` lists ``(dst, slot, expert)`` rows rank ``src`` sends. Returns this
    rank's rows in send order (by destination), the input and output splits, and
    the ``(slot, expert)`` of every received row in arrival order.
    """
    mine = sorted(sends[me])
    in_splits = [sum(1 for d, _, _ in mine if d == r) for r in range(num_ranks)]
    out_splits, received = [], []
    for src in range(num_ranks):
        got = sorted((c, e) for d, c, e in sends[src] if d == me)
        out_splits.append(len(got))
        received.extend(got)
    return mine, in_splits, out_splits, received


@dataclass
class _Pending:
    work: object | None
    recv: torch.Tensor | None
    recv_slots: list[int]
    bank: int
    issued_at: float


class LayerBanks:
    """The two banks of one layer plus the transfer in flight into one of them."""

    def __init__(self, owned_shapes, capacity: int, dtype: torch.dtype, device: torch.device):
        self.shapes = owned_shapes  # per-expert shapes of w1, w2, w3
        self.banks = [
            [torch.zeros(capacity, *s, dtype=dtype, device=device) for s in owned_shapes] for _ in range(2)
        ]
        self.pending: _Pending | None = None
        self.version = [-1, -1]  # weights version each bank's copies were taken at


class TransferEngine:
    def __init__(self, group: dist.ProcessGroup | None, rank: int, num_ranks: int, node_of_rank_R: np.ndarray,
                 path: str = "direct", cost=None, host_group: dist.ProcessGroup | None = None):
        if path not in ("direct", "host", "auto"):
            raise ValueError(f"transfer path must be direct, host or auto, got {path!r}")
        self.group = group
        self.rank = rank
        self.R = num_ranks
        self.node_of_rank_R = node_of_rank_R
        self.path = path
        self.cost = cost
        self.host_group = host_group if host_group is not None else group  # gloo on CPU
        self.layers: dict[int, LayerBanks] = {}
        self.host_rows: dict[int, torch.Tensor] = {}  # layer -> [E, row] staged weights of every expert
        self.stats = TransferStats()
        self.weights_version = 0

    def weights_changed(self) -> None:
        """After an optimizer step every copy outside its owner is stale: it is re-fetched from the owner."""
        self.weights_version += 1

    def uses_host(self, src: int, dst: int) -> bool:
        inter = bool(self.node_of_rank_R[src] != self.node_of_rank_R[dst])
        if self.path == "auto":
            return self.cost is not None and self.cost.use_host_path(inter)
        return self.path == "host"

    def refresh_host_copies(self, layer: int, owned: tuple[torch.Tensor, ...]) -> None:
        """Stage every expert's current weights in host memory (after each optimizer step)."""
        t0 = time.perf_counter()
        local = _rows(*owned).to("cpu", non_blocking=False)
        if self.R > 1 and self.host_group is not None:
            gathered = local.new_empty(self.R * local.shape[0], local.shape[1])
            dist.all_gather_into_tensor(gathered, local, group=self.host_group)
        else:
            gathered = local.clone()
        self.host_rows[layer] = gathered.pin_memory() if torch.cuda.is_available() else gathered
        self.stats.issue_s += time.perf_counter() - t0
        self.stats.seconds_by_path["host"] += time.perf_counter() - t0

    def _banks(self, layer: int, owned: tuple[torch.Tensor, ...], capacity: int) -> LayerBanks:
        if layer not in self.layers:
            shapes = [tuple(w.shape[1:]) for w in owned]
            self.layers[layer] = LayerBanks(shapes, capacity, owned[0].dtype, owned[0].device)
        return self.layers[layer]

    def prefetch(
        self,
        layer: int,
        owned: tuple[torch.Tensor, ...],
        layouts_R: list[LayerLayout],
        prev_layouts_R: list[LayerLayout] | None,
        moves: np.ndarray,
        bank: int,
    ) -> None:
        """Start filling ``bank`` with the replicas of ``layouts_R[self.rank]``.

        ``layouts_R``: every rank's layout of this (micro-step, layer); ``prev_layouts_R``
        the previous micro-step's, whose bank (the other one) holds the replicas
        resident now; ``moves``: the plan's transfers of this (micro-step, layer).
        """
        t0 = time.perf_counter()
        me = self.rank
        C = len(layouts_R[me].slot_expert_C)
        lb = self._banks(layer, owned, C)
        if lb.pending is not None:
            raise RuntimeError(f"layer {layer}: a transfer is still in flight")
        K = owned[0].shape[0]
        # Copies held from before the last optimizer step are stale: whatever the plan says,
        # such a replica is fetched again from its owner (a fix the runtime owns, not the planner).
        stale = lb.version[1 - bank] != self.weights_version
        owner_of = layouts_R[me].owner_E
        moves_by_dst = {
            (int(m["dst_rank"]), int(m["expert"])): int(owner_of[m["expert"]]) if stale else int(m["src_rank"])
            for m in moves
        }

        def resident_slot(r: int, e: int) -> int:
            if prev_layouts_R is None or stale:
                return -1
            hits = np.nonzero(prev_layouts_R[r].slot_expert_C == e)[0]
            return int(hits[0]) if len(hits) else -1

        # Every rank derives the same send/receive lists from the plan.
        host_moves: list[tuple[int, int]] = []  # (slot, expert) this rank fills from its host copy
        send_rows: list[list[tuple[int, int, int]]] = [[] for _ in range(self.R)]  # per src: (dst, slot, expert)
        for r, lay in enumerate(layouts_R):
            for c, e in enumerate(lay.slot_expert_C.tolist()):
                if e < 0 or lay.owner_E[e] == r:
                    continue
                src = moves_by_dst.get((r, e))
                if src is None and stale and prev_layouts_R is not None:
                    src = moves_by_dst[(r, e)] = int(lay.owner_E[e])  # kept by the plan, stale here
                if src is None:
                    if resident_slot(r, e) < 0:
                        raise RuntimeError(
                            f"plan: expert {e} in slot {c} of rank {r} (layer {layer}) is neither moved nor resident"
                        )
                    continue  # stays: local copy between banks
                if self.uses_host(src, r):
                    if r == me:
                        host_moves.append((c, e))
                    continue
                send_rows[src].append((r, c, e))
        mine, in_splits, out_splits, received = _exchange(send_rows, me, self.R)
        recv_slots = [c for c, _ in received]
        out_rows = []
        for dst, c, e in mine:
            if layouts_R[me].owner_E[e] == me:
                out_rows.append(_rows(*(w[e - me * K : e - me * K + 1] for w in owned)))
            else:
                c_prev = resident_slot(me, e)
                if c_prev < 0:
                    raise RuntimeError(f"plan: rank {me} sends expert {e} (layer {layer}) without holding it")
                out_rows.append(_rows(*(w[c_prev : c_prev + 1] for w in lb.banks[1 - bank])))
        row_len = sum(int(np.prod(s)) for s in lb.shapes)
        send = torch.cat(out_rows) if out_rows else owned[0].new_zeros(0, row_len)

        # Replicas that stay: local copy from the other bank (no transfer).
        lay = layouts_R[me]
        for c, e in enumerate(lay.slot_expert_C.tolist()):
            if e >= 0 and lay.owner_E[e] != me and (me, e) not in moves_by_dst:
                c_prev = resident_slot(me, e)
                for cur, prev in zip(lb.banks[bank], lb.banks[1 - bank]):
                    cur[c].copy_(prev[c_prev])
                self.stats.local_copies += 1

        # CPU-assisted moves: host staging -> bank (a side-stream H2D copy on GPU).
        if host_moves:
            t_host = time.perf_counter()
            if layer not in self.host_rows:
                raise RuntimeError(f"layer {layer}: host path used before refresh_host_copies")
            rows = self.host_rows[layer][torch.tensor([e for _, e in host_moves])]
            w1, w2, w3 = _unpack(rows.to(owned[0].device, non_blocking=True), lb.shapes)
            idx = torch.tensor([c for c, _ in host_moves], device=owned[0].device)
            for bank_w, got in zip(lb.banks[bank], (w1, w2, w3)):
                bank_w.index_copy_(0, idx, got)
            self.stats.bytes_by_path["host"] += rows.numel() * rows.element_size()
            self.stats.transfers += len(host_moves)
            self.stats.seconds_by_path["host"] += time.perf_counter() - t_host

        work, recv = None, None
        if self.group is not None and self.R > 1:
            recv = send.new_empty(sum(out_splits), row_len)
            work = dist.all_to_all_single(
                recv, send.contiguous(), out_splits, in_splits, group=self.group, async_op=True
            )
        for dst, _, _ in mine:
            path = "inter_node" if self.node_of_rank_R[dst] != self.node_of_rank_R[me] else "intra_node"
            self.stats.bytes_by_path[path] += row_len * send.element_size()
        self.stats.transfers += len(mine)
        lb.pending = _Pending(work, recv, recv_slots, bank, t0)
        lb.version[bank] = self.weights_version
        self.stats.issue_s += time.perf_counter() - t0

    def wait(self, layer: int) -> None:
        """Block until this layer's replicas have arrived (first use); counts exposed time."""
        lb = self.layers.get(layer)
        if lb is None or lb.pending is None:
            return
        t0 = time.perf_counter()
        p = lb.pending
        if p.work is not None:
            p.work.wait()
        if p.recv is not None and p.recv_slots:
            w1, w2, w3 = _unpack(p.recv, lb.shapes)
            idx = torch.tensor(p.recv_slots, device=p.recv.device)
            for bank_w, got in zip(lb.banks[p.bank], (w1, w2, w3)):
                bank_w.index_copy_(0, idx, got)
        lb.pending = None
        done = time.perf_counter()
        self.stats.exposed_s += done - t0
        if p.work is not None and p.recv_slots:
            self.stats.seconds_by_path["direct"] += done - p.issued_at

    def slot_weights(
        self, layer: int, owned: tuple[torch.Tensor, ...], layouts_R: list[LayerLayout], bank: int
    ) -> tuple[torch.Tensor, ...]:
        """``[C, ...]`` weights of this rank's slots: owned experts from the shard, replicas from the bank."""
        self.wait(layer)
        lay = layouts_R[self.rank]
        lb = self._banks(layer, owned, len(lay.slot_expert_C))
        replicas = ReplicaWeights.apply(self, layer, layouts_R, *owned, *lb.banks[bank])
        index = torch.as_tensor(lay.slot_source_C.clip(0), device=owned[0].device)
        return tuple(torch.cat([o, b]).index_select(0, index) for o, b in zip(owned, replicas))

    def return_gradients(self, layer: int, layouts_R: list[LayerLayout], grads_C, owned_shapes) -> tuple:
        """Send each replica slot's gradient to its expert's owner; return the owner-side sums."""
        me = self.rank
        K = owned_shapes[0][0]
        sends = [[] for _ in range(self.R)]  # per src: (owner, slot, expert)
        for r, lay in enumerate(layouts_R):
            for c, e in enumerate(lay.slot_expert_C.tolist()):
                if e >= 0 and lay.owner_E[e] != r:
                    sends[r].append((int(lay.owner_E[e]), c, e))
        mine, in_splits, out_splits, received = _exchange(sends, me, self.R)
        recv_experts = [e for _, e in received]
        shapes = [tuple(s[1:]) for s in owned_shapes]
        row_len = sum(int(np.prod(s)) for s in shapes)
        if mine:
            idx = torch.tensor([c for _, c, _ in mine], device=grads_C[0].device)
            send = _rows(*(g.index_select(0, idx) for g in grads_C))
        else:
            send = grads_C[0].new_zeros(0, row_len)
        recv = send.new_empty(sum(out_splits), row_len)
        if self.R > 1 and self.group is not None:
            dist.all_to_all_single(recv, send.contiguous(), out_splits, in_splits, group=self.group)
        self.stats.grad_return_bytes += send.numel() * send.element_size()
        out = [torch.zeros(s, dtype=grads_C[0].dtype, device=grads_C[0].device) for s in owned_shapes]
        if recv_experts:
            local = torch.tensor([e - me * K for e in recv_experts], device=recv.device)
            for o, g in zip(out, _unpack(recv, shapes)):
                o.index_add_(0, local, g)
        return tuple(out)


class ReplicaWeights(torch.autograd.Function):
    """Bank rows as a function of the owners' shards: forward reads the bank, backward returns grads to owners."""

    @staticmethod
    def forward(ctx, engine, layer, layouts_R, o1, o2, o3, b1, b2, b3):
        ctx.engine, ctx.layer, ctx.layouts_R = engine, layer, layouts_R
        ctx.owned_shapes = (tuple(o1.shape), tuple(o2.shape), tuple(o3.shape))
        return b1.view_as(b1), b2.view_as(b2), b3.view_as(b3)

    @staticmethod
    def backward(ctx, g1, g2, g3):
        grads = tuple(
            torch.zeros(ctx.layouts_R[0].slot_expert_C.shape[0], *s[1:]) if g is None else g
            for g, s in zip((g1, g2, g3), ctx.owned_shapes)
        )
        owned = ctx.engine.return_gradients(ctx.layer, ctx.layouts_R, grads, ctx.owned_shapes)
        return (None, None, None, *owned, None, None, None)
