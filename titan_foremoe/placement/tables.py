"""One table compiler: from a stage plan and its loads to *this rank's* tables, per micro-step, all layers.

Every rank knows the whole plan, so it derives its own tables without any count exchange:

* **dispatch**: where each of its own token-expert pairs goes (segments of (expert, destination rank,
  destination slot) in expert-major order), and how many rows it receives from each source for each of
  its slots (``recv_SC``);
* **slot weights**: for each of its slots, an owned expert (index into its shard) or a bank row;
* **transfers**: the rows it sends and receives to fill the next bank (direct and CPU-assisted lanes),
  the replicas that stay (local copies), and the gradient return to the owners (``transfer/schedule.py``).

Token split (same rule as ``planner.split.source_split``, never materialized as ``tokens_SER``): per
expert, a source keeps what it can on itself, then fills hosts on its own node, then any host; each stage
is a north-west fill (sources and hosts in rank order), so one entry of the split is an interval overlap of
prefix sums. This rank's source row needs only its own intervals (sums of its node's and the earlier
sources' loads) and the hosts' intervals (a segmented cumsum over the (expert, host) pairs of the plan, E +
replicas per layer); its slots' columns need the split of its C experts only (C x S per layer). Nothing of
size L x E x R is built; the only pass over the loads is one sum over this rank's preceding sources.

Cost per micro-step on one rank, all layers (``benchmarks/bench_placement_scale.py``, one core of a loaded
2-core machine, process CPU time): Qwen3-30B-A3B (L = 48, E = 128, 2 spare slots) 4.2 ms and 0.29 MiB at
R = 64, 5.7 ms and 0.33 MiB at R = 128; DeepSeek-V3 shape (L = 58, E = 256) 7.7 ms / 0.63 MiB at R = 64,
15 ms / 0.80 MiB at R = 256 (the largest EP degree 256 experts allow: 1024 GPUs run 4+ EP groups of <= 256,
each rank's cost is that of its group). The old all-ranks path took 46 ms per layer at R = 64.
Tables hold O(L x (E + replicas + S x C)) integers: no ``tokens_SER``.

Owners: logical expert e of layer l lives in row ``row_LE[l, e]`` of the EP-sharded weights, i.e. on rank
``row // K`` at local row ``row % K`` (``planner.owners.physical_rows_LE``; the identity for contiguous owners).

Legend: L layers, E experts, S source ranks (S == R), R ranks, C slots per rank, K owned experts per rank
(E/R), N nodes, P ranks per node, Q send segments of this rank, H hosting pairs (layer, expert, host),
B bank rows (this rank's non-owned slots), X slots of all ranks, J spare slots (C - K), U owned rows read by
spare slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..planner.owners import physical_rows_LE
from ..transfer.host_key import HostKey
from ..transfer.schedule import Exchange, LayerTransfers


@dataclass(frozen=True)
class LayerDispatch:
    """This rank's dispatch tables for one (micro-step, layer); satisfies ``models.seams.DispatchTables``."""

    tokens_E: np.ndarray  # this rank's token-expert pairs per expert: the loads the plan was made for
    seg_end_Q: np.ndarray  # cumulative pairs over this rank's send segments, (expert, destination) order
    seg_rank_Q: np.ndarray  # destination rank of each segment
    seg_slot_Q: np.ndarray  # destination slot of each segment
    recv_SC: np.ndarray  # rows received from source s for slot c
    slot_expert_C: np.ndarray  # expert in each of this rank's slots (-1 empty)

    @property
    def num_slots(self) -> int:
        return len(self.slot_expert_C)

    def input_splits(self) -> list[int]:
        counts_Q = np.diff(self.seg_end_Q, prepend=0)
        return np.bincount(self.seg_rank_Q, weights=counts_Q, minlength=self.recv_SC.shape[0]).astype(np.int64).tolist()

    def output_splits(self) -> list[int]:
        return self.recv_SC.sum(1).tolist()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.tokens_E, self.seg_end_Q, self.seg_rank_Q, self.seg_slot_Q,
                                      self.recv_SC, self.slot_expert_C))


def dispatch_arrays(d: LayerDispatch) -> dict[HostKey, np.ndarray]:
    """The dispatch tables the dispatcher reads on the device, keyed as ``ActivePlacement.index`` finds them."""
    out = {HostKey(getattr(d, n)): getattr(d, n) for n in ("tokens_E", "seg_end_Q", "seg_rank_Q", "seg_slot_Q")}
    out[HostKey(d.recv_SC, "flat")] = d.recv_SC.reshape(-1)
    return out


@dataclass(frozen=True)
class SlotSplit:
    """The slot GEMM's in-place split (``models/slot_gemm.py``): every owned slot c < K reads owned row c (or is
    empty), so the owned experts are read where they are and only the spare slots' rows are gathered.

    Spare slot s (slot K + s) reads row ``spare_source_J[s]`` of ``cat([owned[spare_owned_U], bank])`` (0 if
    empty); ``spare_owned_U`` (owned rows read by spare slots) is empty for plans that put replicas in the bank.
    """

    owned_rows: int  # received rows of slots 0..K-1 (rows are slot-major): the first owned_rows
    spare_rows: int
    spare_source_J: np.ndarray
    spare_owned_U: np.ndarray


def slot_splits(slot_source_LC: np.ndarray, recv_LSC: np.ndarray, K: int) -> list[SlotSplit | None]:
    """``SlotSplit`` of each layer, or None where an owned slot holds another row (EPLB-style plans: the slot
    GEMM gathers all C slots). Host data only (no device sync), vectorized over layers: ~0.2 ms for 48 layers
    (Qwen3-30B-A3B, one core of the loaded 2-core box), ~5% of the tables' compile."""
    src_LC = np.asarray(slot_source_LC, dtype=np.int64)
    L, C = src_LC.shape
    if C < K or recv_LSC.shape[0] != L or recv_LSC.shape[2] != C:
        raise ValueError(f"slot split: slot sources {src_LC.shape}, received rows {recv_LSC.shape}, {K} owned")
    own_LK = src_LC[:, :K]
    in_place_L = np.all((own_LK == np.arange(K)) | (own_LK < 0), axis=1)
    owned_rows_L = recv_LSC[:, :, :K].sum(axis=(1, 2))
    spare_rows_L = recv_LSC.sum(axis=(1, 2)) - owned_rows_L
    src_LJ = src_LC[:, K:]
    from_owned_LJ = (src_LJ >= 0) & (src_LJ < K)
    source_LJ = np.where(src_LJ >= K, src_LJ - K, 0)
    none_U = np.zeros(0, dtype=np.int64)
    out: list[SlotSplit | None] = []
    for l in range(L):
        if not in_place_L[l]:
            out.append(None)
            continue
        source_J, owned_U = source_LJ[l], none_U
        if from_owned_LJ[l].any():  # spare slots reading owned rows: read from cat(owned[owned_U], bank)
            owned_U, pos_J = np.unique(src_LJ[l][from_owned_LJ[l]], return_inverse=True)
            source_J = np.where(src_LJ[l] >= K, source_J + len(owned_U), 0)
            source_J[from_owned_LJ[l]] = pos_J
        out.append(SlotSplit(int(owned_rows_L[l]), int(spare_rows_L[l]), source_J, owned_U))
    return out


def slot_split(slot_source_C: np.ndarray, recv_SC: np.ndarray, K: int) -> SlotSplit | None:
    """``slot_splits`` of one layer."""
    return slot_splits(np.asarray(slot_source_C)[None], np.asarray(recv_SC)[None], K)[0]


@dataclass(frozen=True)
class LayerTables:
    dispatch: LayerDispatch
    slot_source_C: np.ndarray  # weights of slot c: index into cat(owned K, bank B); -1 empty
    transfers: LayerTransfers
    split: SlotSplit | None = None  # the slot GEMM reads owned slots in place (None: it gathers all slots)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.split is None else self.split.spare_source_J.nbytes + self.split.spare_owned_U.nbytes
        return self.dispatch.nbytes + self.slot_source_C.nbytes + self.transfers.nbytes + extra


@dataclass(frozen=True)
class RankTables:
    """Everything one rank needs to run one micro-step (all layers)."""

    rank: int
    layers: list[LayerTables]
    num_bank_rows: int  # bank rows this micro-step needs (non-owned slots, max over layers)
    replicas_L: np.ndarray  # non-owned, non-empty slots per layer on this rank
    planned_rows_L: np.ndarray  # rows this rank's experts process per layer (the plan)
    bank_row_LC: np.ndarray  # bank row of each of this rank's slots (-1: owned or empty), arrival order:
    # the next micro-step's compile needs it (``prev_rows_LC``)

    @property
    def nbytes(self) -> int:
        return (sum(t.nbytes for t in self.layers) + self.replicas_L.nbytes + self.planned_rows_L.nbytes
                + self.bank_row_LC.nbytes)


# -- token split ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitPrefix:
    """Prefix sums of the locality-first split, ``[L, E, R]`` each (sources and hosts both indexed by rank).

    ``self_`` what source r keeps on itself; ``a0n, a1n`` / ``b0n, b1n`` the node-stage intervals of sources /
    hosts (prefix within the node); ``a0g, a1g`` / ``b0g, b1g`` the global-stage intervals.
    """

    self_: np.ndarray
    a0n: np.ndarray
    a1n: np.ndarray
    b0n: np.ndarray
    b1n: np.ndarray
    a0g: np.ndarray
    a1g: np.ndarray
    b0g: np.ndarray
    b1g: np.ndarray
    ranks_per_node: int


def split_prefix(loads_LSE: np.ndarray, assign_LER: np.ndarray, ranks_per_node: int) -> SplitPrefix:
    """The shared part of the token split: O(L x E x R), vectorized over layers and nodes."""
    L, S, E = loads_LSE.shape
    R = assign_LER.shape[2]
    if assign_LER.shape[:2] != (L, E):
        raise ValueError(f"split: loads {loads_LSE.shape} and assign {assign_LER.shape} disagree")
    if R % ranks_per_node:
        raise ValueError(f"split: {R} ranks do not divide into nodes of {ranks_per_node}")
    N, P = R // ranks_per_node, ranks_per_node
    sup = np.ascontiguousarray(loads_LSE.transpose(0, 2, 1), dtype=np.int64)  # [L, E, S]
    cap = np.asarray(assign_LER, dtype=np.int64)
    self_ = np.minimum(sup, cap)
    sup1 = (sup - self_).reshape(L, E, N, P)
    cap1 = (cap - self_).reshape(L, E, N, P)
    a1n = np.cumsum(sup1, axis=3)
    a0n = a1n - sup1
    b1n = np.cumsum(cap1, axis=3)
    b0n = b1n - cap1
    sent = np.maximum(np.minimum(a1n, b1n[..., -1:]) - a0n, 0)
    used = np.maximum(np.minimum(b1n, a1n[..., -1:]) - b0n, 0)
    sup2 = (sup1 - sent).reshape(L, E, R)
    cap2 = (cap1 - used).reshape(L, E, R)
    a1g = np.cumsum(sup2, axis=2)
    b1g = np.cumsum(cap2, axis=2)
    return SplitPrefix(self_, a0n.reshape(L, E, R), a1n.reshape(L, E, R), b0n.reshape(L, E, R),
                       b1n.reshape(L, E, R), a1g - sup2, a1g, b1g - cap2, b1g, P)


def _overlap(a0, a1, b0, b1):
    return np.maximum(np.minimum(a1, b1) - np.maximum(a0, b0), 0)


def split_entries(px: SplitPrefix, l, e, s, r) -> np.ndarray:
    """Tokens of expert e that source s sends to host r in layer l (broadcast index arrays)."""
    P = px.ranks_per_node
    out = np.where(s == r, px.self_[l, e, s], 0)
    same_node = (s // P) == (r // P)
    out = out + np.where(same_node, _overlap(px.a0n[l, e, s], px.a1n[l, e, s], px.b0n[l, e, r], px.b1n[l, e, r]), 0)
    return out + _overlap(px.a0g[l, e, s], px.a1g[l, e, s], px.b0g[l, e, r], px.b1g[l, e, r])


# -- one micro-step ------------------------------------------------------------------------------------


def _hosting_pairs(slots_LRC: np.ndarray, num_experts: int):
    """(layer, expert, host, first slot) of every expert copy, sorted by (layer, expert, host)."""
    L, R, C = slots_LRC.shape
    l, r, c = np.nonzero(slots_LRC >= 0)
    e = slots_LRC[l, r, c]
    key = ((l * num_experts + e) * R + r) * C + c
    order = np.argsort(key, kind="stable")
    l, e, r, c = l[order], e[order], r[order], c[order]
    pair = (l * num_experts + e) * R + r
    first = np.ones(len(pair), dtype=bool)
    first[1:] = pair[1:] != pair[:-1]
    return l[first], e[first], r[first], c[first]


def _seg_cumsum(x: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum of ``x`` restarting where ``start`` is True (``start[0]`` must be True)."""
    c = np.cumsum(x)
    seg = np.cumsum(start) - 1
    return c - (c - x)[start][seg]


def _send_row(loads_LSE, assign_LER, hl, he, hr, me: int, P: int) -> np.ndarray:
    """This rank's entries of the split at the hosting pairs: O(L x E x N + H) plus one pass over its prefix.

    The same north-west stages as ``split_prefix``, but the source side is only this rank's interval
    (prefix sums of its node's and all earlier sources' loads) and the host side is a segmented cumsum
    over the hosting pairs, so nothing of size L x E x R is built.
    """
    L, S, E = loads_LSE.shape
    N = S // P
    n_me = me // P
    cap0_H = assign_LER[hl, he, hr]
    self_H = np.minimum(loads_LSE[hl, hr, he], cap0_H)
    cap1_H = cap0_H - self_H
    node_H = hr // P
    le = hl * E + he
    start_le = np.ones(len(le), dtype=bool)
    start_le[1:] = le[1:] != le[:-1]
    start_len = start_le.copy()
    start_len[1:] |= node_H[1:] != node_H[:-1]
    # node totals per (layer, expert, node): sources' residual supply and hosts' residual capacity
    idx_H = (hl * E + he) * N + node_H
    bt_LEN = np.bincount(idx_H, weights=cap1_H, minlength=L * E * N).reshape(L, E, N)
    self_LEN = np.bincount(idx_H, weights=self_H, minlength=L * E * N).reshape(L, E, N)
    node_load_LNE = loads_LSE.reshape(L, N, P, E).sum(axis=2)  # the one pass over all the loads
    at_LEN = node_load_LNE.transpose(0, 2, 1) - self_LEN
    flow_LEN = np.minimum(at_LEN, bt_LEN)
    # hosts: node-stage and global-stage intervals
    b1n_H = _seg_cumsum(cap1_H, start_len)
    b0n_H = b1n_H - cap1_H
    used_H = np.maximum(np.minimum(b1n_H, at_LEN[hl, he, node_H]) - b0n_H, 0)
    cap2_H = cap1_H - used_H
    b1g_H = _seg_cumsum(cap2_H, start_le)
    b0g_H = b1g_H - cap2_H
    # this source: node-stage and global-stage intervals
    self_me_LE = np.minimum(loads_LSE[:, me, :], assign_LER[:, :, me])
    upto = hr <= me
    self_pre_LE = np.bincount(le[upto], weights=self_H[upto], minlength=L * E).reshape(L, E)
    in_node = upto & (node_H == n_me)
    self_pre_node_LE = np.bincount(le[in_node], weights=self_H[in_node], minlength=L * E).reshape(L, E)
    node_pre_LE = loads_LSE[:, n_me * P : me + 1, :].sum(axis=1)
    pre_LE = node_pre_LE + node_load_LNE[:, :n_me].sum(axis=1)
    a1n = node_pre_LE - self_pre_node_LE
    sup1 = loads_LSE[:, me, :] - self_me_LE
    a0n = a1n - sup1
    bt_me = bt_LEN[:, :, n_me]
    sent_me = np.maximum(np.minimum(a1n, bt_me) - a0n, 0)
    a1g = pre_LE - self_pre_LE - flow_LEN[:, :, :n_me].sum(axis=2) - np.minimum(a1n, bt_me)
    a0g = a1g - (sup1 - sent_me)
    t_H = np.where(hr == me, self_me_LE[hl, he], 0)
    t_H = t_H + np.where(node_H == n_me, _overlap(a0n[hl, he], a1n[hl, he], b0n_H, b1n_H), 0)
    return (t_H + _overlap(a0g[hl, he], a1g[hl, he], b0g_H, b1g_H)).astype(np.int64)


def _dispatch(slots_LRC, assign_LER, loads_LSE, me: int, P: int) -> list[LayerDispatch]:
    L, R, C = slots_LRC.shape
    E = assign_LER.shape[1]
    hl, he, hr, hc = _hosting_pairs(slots_LRC, E)
    planned_H = assign_LER[hl, he, hr]
    hosted_L = np.bincount(hl, weights=planned_H, minlength=L)
    if not np.array_equal(hosted_L, assign_LER.sum(axis=(1, 2))):
        hosted = np.zeros(assign_LER.shape, dtype=bool)
        hosted[hl, he, hr] = True
        l, e, r = np.argwhere((assign_LER > 0) & ~hosted)[0]
        raise ValueError(f"plan sends tokens of expert {e} to rank {r} in layer {l}, which does not host it")
    # this rank's source row at every hosting pair with tokens
    t_H = _send_row(loads_LSE, assign_LER, hl, he, hr, me, P)
    keep = t_H > 0
    ql, qr, qc, qt = hl[keep], hr[keep], hc[keep], t_H[keep]
    bounds = np.searchsorted(ql, np.arange(L + 1))
    cum = np.cumsum(qt)
    seg_end = cum - np.concatenate([[0], cum])[bounds[:-1]][ql]  # cumulative within each layer
    # its slots' columns: the split restricted to the experts of its slots (first slot of each)
    slot_e_LC = slots_LRC[:, me, :]
    e_LC = np.where(slot_e_LC >= 0, slot_e_LC, 0)
    first_LC = np.zeros((L, C), dtype=bool)
    mine = hr == me
    first_LC[hl[mine], hc[mine]] = True
    li = np.arange(L)[:, None]
    loads_LSC = np.take_along_axis(loads_LSE, e_LC[:, None, :], axis=2)
    assign_LCR = assign_LER[li, e_LC]
    px = split_prefix(loads_LSC, assign_LCR, P)
    recv_LCS = split_entries(px, li[:, :, None], np.arange(C)[None, :, None], np.arange(R)[None, None, :], me)
    recv_LCS = np.where(first_LC[:, :, None], recv_LCS, 0)
    recv_LSC = np.ascontiguousarray(recv_LCS.transpose(0, 2, 1))
    tokens_LE = np.ascontiguousarray(loads_LSE[:, me, :], dtype=np.int64)
    out = []
    for layer in range(L):
        a, b = bounds[layer], bounds[layer + 1]
        out.append(LayerDispatch(tokens_LE[layer], seg_end[a:b], qr[a:b], qc[a:b], recv_LSC[layer],
                                 slot_e_LC[layer]))
    return out


def _owner_of(row_LE: np.ndarray, l: np.ndarray, e: np.ndarray, K: int) -> np.ndarray:
    """Owner rank of logical expert e (-1: none) in layer l."""
    return np.where(e >= 0, row_LE[l, np.maximum(e, 0)] // K, -1)


def _lookup(keys_sorted: np.ndarray, values: np.ndarray, query: np.ndarray, missing: int = -1) -> np.ndarray:
    """``values[j]`` where ``keys_sorted[j] == query`` (unique sorted keys), else ``missing``."""
    if len(keys_sorted) == 0:
        return np.full(np.shape(query), missing, dtype=np.int64)
    i = np.searchsorted(keys_sorted, query).clip(0, len(keys_sorted) - 1)
    return np.where(keys_sorted[i] == query, values[i], missing)


def _split_by_layer(l: np.ndarray, L: int, *cols: np.ndarray) -> list[tuple[np.ndarray, ...]]:
    """Rows already sorted by layer -> per-layer column slices."""
    b = np.searchsorted(l, np.arange(L + 1))
    return [tuple(c[b[i] : b[i + 1]] for c in cols) for i in range(L)]


def _sorted(key: np.ndarray, *cols: np.ndarray) -> tuple[np.ndarray, ...]:
    o = np.argsort(key, kind="stable")
    return tuple(c[o] for c in cols)


def _arrival_rows(l: np.ndarray, L: int, base_L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bank row of each entry, entries per layer): rows sorted by layer numbered ``base_L[l], base_L[l] + 1, ...``
    within their layer, in the given order."""
    n_L = np.bincount(l, minlength=L)
    start_L = np.cumsum(n_L) - n_L
    return base_L[l] + np.arange(len(l)) - start_L[l], n_L


def _transfers(slots_LRC, prev_slots_LRC, moves_T, me: int, K: int, ranks_per_node: int, stale: bool,
               host_intra: bool, host_inter: bool, prev_rows_LC, row_LE) -> tuple[list[LayerTransfers], np.ndarray]:
    """This rank's weight moves, kept replicas and gradient return, all layers; and its bank rows ``[L, C]``.

    One vectorized pass over every rank's non-owned slots (X = L x R x spare at most) decides each slot's
    source (the plan's move, its owner when stale, or none: it stays); this rank keeps the rows it
    receives, sends or keeps. Sends are ordered (layer, destination, slot) and receives (layer, source,
    slot), so both ends of every exchange agree on the row order without talking.

    Bank rows are numbered in arrival order: the direct lane's receives first (rows 0..), then the host
    lane's, then the replicas that stay (slot order). Each lane's rows are then one contiguous run of the
    bank, so its all-to-all writes straight into it (``transfer/banks.py``); the price is that a row's number
    depends on how the replica got there, so a kept replica's previous row comes from the previous
    micro-step's compile (``prev_rows_LC``), not from its slots alone.
    """
    L, R, C = slots_LRC.shape
    E = K * R
    P = ranks_per_node
    # every rank's non-owned slots (vectorized scan of the plan's slots, no loop over ranks)
    owner_LRC = _owner_of(row_LE, np.arange(L)[:, None, None], slots_LRC, K)
    xl, xr, xc = np.nonzero((slots_LRC >= 0) & (owner_LRC != np.arange(R)[None, :, None]))
    xe = slots_LRC[xl, xr, xc]
    xowner = owner_LRC[xl, xr, xc]
    local_X = row_LE[xl, xe] % K  # the expert's row in its owner's shard
    if stale:  # first micro-step after an optimizer step: every replica from its owner
        xsrc = xowner.copy()
    else:
        mkey = (moves_T["layer"].astype(np.int64) * R + moves_T["dst_rank"]) * E + moves_T["expert"]
        mkey, msrc = _sorted(mkey, mkey, moves_T["src_rank"].astype(np.int64))
        xsrc = _lookup(mkey, msrc, (xl * R + xr) * E + xe)  # -1: stays (resident)
    moved = xsrc >= 0
    inter = (np.where(moved, xsrc, xr) // P) != (xr // P)
    host = moved & np.where(inter, host_inter, host_intra)
    direct = moved & ~host
    mine = xr == me
    stay = mine & ~moved
    # this rank's bank rows in arrival order: direct (source, slot), host (owner, slot), kept (slot)
    xrow = np.full(len(xl), -1, dtype=np.int64)  # bank row of the slot on its rank (only needed for mine)
    ix = np.arange(len(xl))
    rcv = direct & mine
    (rcv_x,) = _sorted((xl[rcv] * R + xsrc[rcv]) * C + xc[rcv], ix[rcv])
    xrow[rcv_x], nd_L = _arrival_rows(xl[rcv_x], L, np.zeros(L, dtype=np.int64))
    hrc = host & mine
    (hrc_x,) = _sorted((xl[hrc] * R + xowner[hrc]) * C + xc[hrc], ix[hrc])
    xrow[hrc_x], nh_L = _arrival_rows(xl[hrc_x], L, nd_L)
    (stay_x,) = _sorted(xl[stay] * C + xc[stay], ix[stay])
    xrow[stay_x], _ = _arrival_rows(xl[stay_x], L, nd_L + nh_L)
    rows_LC = np.full((L, C), -1, dtype=np.int64)
    rows_LC[xl[mine], xc[mine]] = xrow[mine]
    # previous bank row of expert e on rank me, layer l (resident replicas)
    if prev_slots_LRC is not None and not stale:
        pl, pc = np.nonzero(prev_rows_LC >= 0)
        pk = pl * E + prev_slots_LRC[pl, me, pc]
        pkey, prow = _sorted(pk, pk, prev_rows_LC[pl, pc])
    else:
        pkey = prow = np.zeros(0, dtype=np.int64)
    # stays: local copies on this rank
    keep_prev = _lookup(pkey, prow, xl[stay_x] * E + xe[stay_x])
    if (keep_prev < 0).any():
        i = stay_x[np.nonzero(keep_prev < 0)[0][0]]
        raise RuntimeError(f"plan: expert {xe[i]} in slot {xc[i]} of rank {me} (layer {xl[i]}) is neither moved "
                           "nor resident")
    # direct lane: sends from me (owned row or my previous bank row), receives into my bank rows
    snd = direct & (xsrc == me)
    sl, sr, sc, se, slocal, sowner = _sorted((xl[snd] * R + xr[snd]) * C + xc[snd], xl[snd], xr[snd], xc[snd],
                                             xe[snd], local_X[snd], xowner[snd])
    own = sowner == me
    held = _lookup(pkey, prow, sl * E + se)
    if ((~own) & (held < 0)).any():
        i = np.nonzero((~own) & (held < 0))[0][0]
        raise RuntimeError(f"plan: rank {me} sends expert {se[i]} (layer {sl[i]}) without holding it")
    s_row = np.where(own, slocal, K + held)
    rl, rsrc, rrow = xl[rcv_x], xsrc[rcv_x], xrow[rcv_x]
    # host lane: from the owner's staged copy
    hs = host & (xowner == me)
    hl, hr, hse = _sorted((xl[hs] * R + xr[hs]) * C + xc[hs], xl[hs], xr[hs], local_X[hs])
    hrl, hrsrc, hrrow = xl[hrc_x], xowner[hrc_x], xrow[hrc_x]
    # gradient return: my replica slots -> owners; owners receive every replica of their experts
    gs = mine
    gl, gdst, grow = _sorted((xl[gs] * R + xowner[gs]) * C + xc[gs], xl[gs], xowner[gs], xrow[gs])
    gr = xowner == me
    gra, grsrc, gre = _sorted((xl[gr] * R + xr[gr]) * C + xc[gr], xl[gr], xr[gr], local_X[gr])
    kl = xl[stay_x]
    kp, kr = keep_prev, xrow[stay_x]

    per = [
        _split_by_layer(sl, L, sr, s_row, sr // P != me // P),
        _split_by_layer(rl, L, rsrc, rrow),
        _split_by_layer(hl, L, hr, hse),
        _split_by_layer(hrl, L, hrsrc, hrrow),
        _split_by_layer(gl, L, gdst, grow),
        _split_by_layer(gra, L, grsrc, gre),
        _split_by_layer(kl, L, kp, kr),
    ]
    host_any_L = np.bincount(xl[host], minlength=L) > 0  # from every rank's slots: the same on all ranks
    grad_any_L = np.bincount(xl, minlength=L) > 0  # every replica returns its gradient to its owner
    out = []
    for layer in range(L):
        (s_peer, s_rw, s_inter), (r_peer, r_rw), (h_peer, h_rw), (hr_peer, hr_rw), (g_peer, g_rw), \
            (gr_peer, gr_rw), (k_prev, k_row) = (p[layer] for p in per)
        out.append(LayerTransfers(
            direct=Exchange(s_peer, s_rw, r_peer, r_rw), host=Exchange(h_peer, h_rw, hr_peer, hr_rw),
            grad=Exchange(g_peer, g_rw, gr_peer, gr_rw), keep_prev_row_U=k_prev, keep_row_U=k_row,
            send_inter_T=s_inter, stale=stale, host_any=bool(host_any_L[layer]), grad_any=bool(grad_any_L[layer]),
        ))
    return out, rows_LC


def compile_micro_step(
    slots_LRC: np.ndarray,
    assign_LER: np.ndarray,
    loads_LSE: np.ndarray,
    rank: int,
    ranks_per_node: int,
    *,
    prev_slots_LRC: np.ndarray | None,
    moves_T: np.ndarray,
    stale: bool,
    host_intra: bool = False,
    host_inter: bool = False,
    row_LE: np.ndarray | None = None,
    prev_rows_LC: np.ndarray | None = None,
) -> RankTables:
    """This rank's tables for one micro-step, all layers.

    ``prev_slots_LRC``: the previous micro-step's slots in this stage (None at the first), whose bank holds
    the replicas resident now; ``prev_rows_LC``: that micro-step's ``RankTables.bank_row_LC`` (where in its
    bank each replica is: arrival order, so it depends on how each got there), required with
    ``prev_slots_LRC`` unless ``stale`` (then nothing is read from the previous bank); L x C int64, 7 KiB at
    Qwen3-30B-A3B EP 8. ``moves_T``: the plan's transfers of this micro-step (TRANSFER_DTYPE).
    ``stale``: the first micro-step after an optimizer step (or of a stage): replicas held elsewhere are
    stale, so every replica is fetched from its owner whatever the plan keeps. ``host_intra/host_inter``:
    whether intra-/inter-node moves take the CPU-assisted lane. ``row_LE``: each logical expert's row in the
    EP-sharded weights (default: contiguous owners, the identity).
    """
    slots_LRC = np.asarray(slots_LRC, dtype=np.int64)
    L, R, C = slots_LRC.shape
    E = assign_LER.shape[1]
    if E % R:
        raise ValueError(f"tables: {E} experts do not divide over {R} ranks")
    K = E // R
    if not 0 <= rank < R:
        raise ValueError(f"tables: rank {rank} outside 0..{R - 1}")
    row_LE = np.broadcast_to(np.arange(E), (L, E)) if row_LE is None else np.asarray(row_LE, dtype=np.int64)
    dispatch = _dispatch(slots_LRC, np.asarray(assign_LER, dtype=np.int64), np.asarray(loads_LSE, dtype=np.int64),
                         rank, ranks_per_node)
    if prev_slots_LRC is not None and not stale:
        if prev_rows_LC is None:
            raise ValueError("tables: prev_rows_LC (the previous micro-step's RankTables.bank_row_LC) is required "
                             "with prev_slots_LRC when the micro-step is not stale")
        prev_rows_LC = np.asarray(prev_rows_LC, dtype=np.int64)
        if prev_rows_LC.shape != (L, np.shape(prev_slots_LRC)[2]):
            raise ValueError(f"tables: prev_rows_LC {prev_rows_LC.shape} does not match prev_slots_LRC "
                             f"{np.shape(prev_slots_LRC)} (expected [L, C] of this rank)")
    transfers, rows_LC = _transfers(slots_LRC, prev_slots_LRC, moves_T, rank, K, ranks_per_node, stale, host_intra,
                                    host_inter, prev_rows_LC, row_LE)
    slot_e = slots_LRC[:, rank]
    local_LC = np.take_along_axis(row_LE, np.maximum(slot_e, 0), axis=1) % K
    slot_source_LC = np.where(slot_e < 0, -1, np.where(rows_LC >= 0, K + rows_LC, local_LC))
    splits = slot_splits(slot_source_LC, np.stack([d.recv_SC for d in dispatch]), K)
    layers = [LayerTables(d, slot_source_LC[i], t, splits[i]) for i, (d, t) in enumerate(zip(dispatch, transfers))]
    replicas_L = (rows_LC >= 0).sum(axis=1)
    planned_L = np.asarray(assign_LER[:, :, rank].sum(axis=1), dtype=np.int64)
    return RankTables(rank, layers, int(replicas_L.max(initial=0)), replicas_L, planned_L, rows_LC)


def stale_micro_steps(num_micro_steps: int, micro_steps_per_step: int | None) -> np.ndarray:
    """Micro-steps whose replicas must come from the owners: a stage's first and each step's first."""
    mps = micro_steps_per_step or num_micro_steps
    return np.arange(num_micro_steps) % mps == 0


def compile_stage(plan, loads_MLSE: np.ndarray, rank: int, *, host_intra: bool = False,
                  host_inter: bool = False) -> list[RankTables]:
    """This rank's tables for every micro-step of a stage plan (run in the planner's background thread), in
    order: each micro-step's bank rows depend on the previous one's (``compile_micro_step(prev_rows_LC=)``)."""
    M, L = plan.assign_MLER.shape[:2]
    loads_MLSE = np.asarray(loads_MLSE)
    if loads_MLSE.shape[:2] != (M, L):
        raise ValueError(f"tables: plan {plan.assign_MLER.shape} and loads {loads_MLSE.shape} disagree")
    stale_M = stale_micro_steps(M, plan.info.get("micro_steps_per_step"))
    P = plan.topology.ranks_per_node
    tr = plan.transfers_T
    layout_MLE = plan.layout_owner_MLE
    out = []
    for m in range(M):
        if stale_M[m]:  # owners change only at step boundaries
            row_LE = physical_rows_LE(layout_MLE[m], plan.topology.num_ranks)
        out.append(compile_micro_step(
            plan.slots_MLRC[m], plan.assign_MLER[m], loads_MLSE[m], rank, P,
            prev_slots_LRC=plan.slots_MLRC[m - 1] if m > 0 else None, moves_T=tr[tr["micro_step"] == m],
            stale=bool(stale_M[m]), host_intra=host_intra, host_inter=host_inter, row_LE=row_LE,
            prev_rows_LC=out[m - 1].bank_row_LC if m > 0 else None,
        ))
    return out


def stage_splits(tables: list[RankTables], num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows this rank sends to, rows it receives from) each peer ``[M, L, K, R]``, for the K = 4 exchanges of
    ``distributed.agreement.SPLIT_KINDS`` (tokens, direct, host, grad): what ``check_splits`` compares.
    O(M x L x R) integers (Qwen3-30B-A3B, R = 64, 16 micro-steps: 3 MB), a few ms per stage."""
    M, L = len(tables), len(tables[0].layers) if tables else 0
    send = np.zeros((M, L, 4, num_ranks), dtype=np.int64)
    recv = np.zeros_like(send)
    for m, t in enumerate(tables):
        for layer, lt in enumerate(t.layers):
            send[m, layer, 0], recv[m, layer, 0] = lt.dispatch.input_splits(), lt.dispatch.output_splits()
            for k, ex in enumerate((lt.transfers.direct, lt.transfers.host, lt.transfers.grad), start=1):
                send[m, layer, k], recv[m, layer, k] = ex.splits(num_ranks)
    return send, recv
