"""What one weight sync costs per rank, per design: the one model the senders' plan and the simulator share.

The runtime's bucketed senders take their buckets (``bucket_bounds``) and each engine's source and relays
(``group_ranks``) from here, and the simulator charges ``sync_cost`` of the design the runtime runs
(``simulator/rollout.py``), so a change of the runtime's plan changes the charge.

Designs (``DESIGNS``), for a model of M bytes in N HF tensors (Qwen3-30B-A3B bf16: 61 GB, 18,867 tensors), T
trainer ranks, K engines of g GPUs (``engine_gpus = 0``: colocated, the engines on the trainer's GPUs):

- ``reload``: every rank writes its M / T slice of an HF folder, every engine reads M back from the file system
  (``fs_GBps`` per node: an assumption, not measured here).
- ``current`` (the per-tensor NCCL path before issue 37): every rank all-gathers every parameter (M per rank),
  rank 0 broadcasts the N tensors one by one to one group of every engine worker (M out of rank 0's NIC when the
  ring leaves its node), gathers and broadcasts in turn.
- ``bucketed``: the HF tensors packed into buckets of ``bucket_bytes`` (vLLM's packing rule), one broadcast per
  bucket. Both engines' APIs take one sender per transfer group (group rank 0: vLLM 0.28-0.33's
  ``init_weight_transfer_engine``, one group per server; SGLang's ``init_weights_update_group``, any number of
  named groups, one update at a time) but let the group hold more trainer ranks (``rank_offset``,
  ``world_size``). With ``senders`` > 1 (SGLang, one engine server: ``_senders_cost``) the trainer's ranks form
  ``sender_groups``, buckets of whole entries are dealt to their sources in turn and every rank receives about
  M / S instead of M; the engine takes the groups' broadcasts one after another. Otherwise (vLLM) ONE group:
  a source rank (``source_rank`` of engine 0: rank 0) and the other GPUs of its node as relays, then every
  engine's workers (server k from ``rank_offset`` n + k g: the fleet's ``one_group``, what
  ``sources/streamed.py`` runs for K >= 1 engines): the source gathers each bucket once in two hops (each rank's
  slice crosses nodes once, to the GPU of its local index on the source's node, then over NVLink to the source;
  the others receive nothing) and broadcasts it once for every engine; the ring leaves the node on every relay's
  NIC (rail channels), so no single NIC carries the model. Per rank over IB: M / n of remote slices in, M / n
  out; over NVLink a source receives the model and every group member every byte (a broadcast's semantics, the
  engines' APIs).
  Colocated (``colocated_ipc_cost``): vLLM's ``ipc`` backend, as ``ipc_weights`` runs it.

The engine fleet (``fleet_sync_cost``, ``FLEET_DESIGNS``): K engines synced at once, per design and per NIC: one
transfer group of every engine's workers (``one_group``: vLLM's ``rank_offset`` lets several servers join one
group; one ring, M / n per NIC for any K; the bucketed vLLM sync above and the runtime run this one; a dead engine
breaks the group for all, and the survivors re-join a new one), a transfer group per engine (``per_engine``), or
one gather per trainer node forwarded to the node's sources (``node_forward``); the last two are kept for
comparison. Colocated fleets are fed on every node at once (``colocated_ipc_cost``).

Link model (the simulator's figures, ``simulator/timing.py``): a rank's NVLink and its own NIC, each direction
at its rate; a ring that enters a node on every NIC (rail channels) spreads its bytes over them. Pipelined
stages overlap: a sync takes its slowest stage plus one bucket's fill, plus one latency per collective and
``call_ms`` per engine call.

Engine-side load (``engine_load_s``): every engine worker then loads what it received, in parallel with the
others; its cost is Python per HF tensor, not bytes (``benchmarks/engine_load_cost.py`` in the real vLLM 0.28
engine: ~204 us per per-expert tensor inside the layerwise reload its weight-transfer engines and
``reload_weights`` run, ~353 us per other tensor; ~14 us per expert carried stacked through our
``vllm_fused_load`` extension; slime's published colocated sync implies ~130 us per tensor on an H200 host).
``load`` = ``per_tensor`` (stock: Qwen3-30B-A3B 3.9 s per sync) or ``stacked`` (0.41 s). vLLM's packed NCCL
consumer loads bucket b while b + 1 arrives (two buffers), so there the load overlaps the transfer; SGLang's
update takes one call at a time (receive, then load) and ``reload`` reads then loads, so there it adds.

Legend: N HF tensors, M model bytes, T trainer ranks, E engine GPUs, g GPUs per engine, K = E / g engines, n GPUs
per node, B bucket bytes, b buckets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

DESIGNS = ("reload", "current", "bucketed")
LOADS = ("per_tensor", "stacked")


@dataclass(frozen=True)
class SyncLinks:
    """Link rates (bytes/s per GPU and direction), one collective's latency, an engine call's overhead."""

    nvlink_Bps: float
    ib_Bps: float
    latency_s: float
    fs_Bps: float = 10e9  # a node's share of a parallel file system, write or read (assumed)
    call_s: float = 2e-3  # one HTTP engine call (route + JSON of a bucket's names), assumed
    load_expert_s: float = 204e-6  # an engine worker's load of one per-expert HF tensor (engine_load_cost.py)
    load_other_s: float = 353e-6  # ... of any other HF tensor (attention, norms, router, embedding, head)
    load_stacked_s: float = 14e-6  # ... per expert carried in a layer's stacked tensor (vllm_fused_load)

    @classmethod
    def of(cls, link) -> "SyncLinks":
        """From the simulator's ``DeviceCosts``."""
        return cls(link.nvlink_GBps * 1e9, link.ib_GBps * 1e9, link.a2a_latency_us * 1e-6)


@dataclass(frozen=True)
class SyncSetting:
    design: str
    trainer_gpus: int
    engine_gpus: int  # 0: colocated (the engines on the trainer's GPUs)
    engine_size: int  # g: GPUs per engine
    gpus_per_node: int
    bucket_bytes: int = 512 << 20
    api: str = "vllm"  # vllm: one /update_weights per sync; sglang: one update call per bucket
    state_entries: int = 0  # the trainer's state-dict entries (one gather each); 0: from N
    senders: int = 1  # bucketed, one engine server: sender groups (``sender_groups``; SGLang's named groups)
    expert_tensors: int = 0  # how many of the N HF tensors are per-expert matrices (``expert_tensor_count``)
    load: str = "per_tensor"  # the engine's load: per_tensor (stock loaders) | stacked (vllm_fused_load)

    def __post_init__(self) -> None:
        if self.design not in DESIGNS:
            raise ValueError(f"weight sync design {self.design!r}: choose from {DESIGNS}")
        if min(self.trainer_gpus, self.engine_size, self.gpus_per_node,
               self.bucket_bytes) < 1 or self.engine_gpus < 0:
            raise ValueError(f"weight sync setting needs positive sizes: {self}")
        if self.load not in LOADS:
            raise ValueError(f"engine load {self.load!r}: choose from {LOADS}")
        if self.senders < 1:
            raise ValueError(f"weight sync senders must be >= 1, got {self.senders}")
        if self.senders > 1 and self.engine_gpus and self.engine_gpus != self.engine_size:
            raise ValueError(f"several senders feed one engine server (what the runtime drives): engine_size "
                             f"{self.engine_size} != engine_gpus {self.engine_gpus}")
        if (self.engine_gpus or self.trainer_gpus) % self.engine_size:
            raise ValueError(f"{self.engine_gpus or self.trainer_gpus} engine GPUs do not split into engines of "
                             f"{self.engine_size}")


def hf_tensor_bytes(spec, dtype_bytes: int = 2) -> np.ndarray:
    """Bytes of each HF tensor of a model spec (``simulator.models.ModelSpec``), in the export's order: the
    embedding, per layer its attention (4 projections, 2 head norms), 2 layer norms, router and its E x 3 expert
    matrices (or a dense MLP's 3), the final norm and the head. Qwen3-30B-A3B: 18,867 tensors."""
    attn = spec.attn_linear_flops() / 2
    layer = [attn / 4] * 4 + [spec.head_dim] * 2 + [spec.dim] * 2
    moe = layer + [spec.dim * spec.num_experts] + [spec.dim * spec.moe_hidden] * (3 * spec.num_experts)
    shared = [spec.dim * spec.shared_hidden] * 3 if spec.shared_hidden else []
    dense = layer + [spec.dim * spec.dense_hidden] * 3
    sizes = [spec.vocab * spec.dim] + dense * spec.dense_layers + (moe + shared) * spec.moe_layers
    sizes += [spec.dim, spec.vocab * spec.dim]
    return np.asarray(sizes, np.float64) * dtype_bytes


def hf_entry_bytes(spec, dtype_bytes: int = 2) -> np.ndarray:
    """Bytes of each of the trainer's state-dict entries (one gather each) in ``hf_tensor_bytes``' order: an
    entry is one HF tensor, except a grouped expert matrix (E HF tensors). Qwen3-30B-A3B: 579 entries."""
    sizes = hf_tensor_bytes(spec, dtype_bytes)
    moe = [1] * 9 + [spec.num_experts] * 3 + [1] * (3 if spec.shared_hidden else 0)
    counts = [1] + [1] * 11 * spec.dense_layers + moe * spec.moe_layers + [1, 1]
    return np.add.reduceat(sizes, np.cumsum([0] + counts[:-1]))


def expert_tensor_count(spec) -> int:
    """How many of ``hf_tensor_bytes``' tensors are per-expert matrices (3 per routed expert and MoE layer):
    the ones the engine's stock loader takes one call each for. Qwen3-30B-A3B: 18,432 of 18,867."""
    return 3 * spec.num_experts * spec.moe_layers


def engine_load_s(tensors: int, s: SyncSetting, links: SyncLinks) -> float:
    """One engine worker's load of one sync (module docstring): per tensor, the experts by ``s.load`` (stacked
    only where the bucketed sync carries them so: ``reload`` reads an HF folder and ``current`` sends per-expert
    tensors, both through the stock loaders)."""
    experts = min(s.expert_tensors, tensors)
    stacked = s.load == "stacked" and s.design == "bucketed"
    per_expert = links.load_stacked_s if stacked else links.load_expert_s
    return experts * per_expert + (tensors - experts) * links.load_other_s


def entry_bucket_bounds(sizes_E: np.ndarray, bucket_bytes: int) -> np.ndarray:
    """``[b + 1]`` entry offsets of the buckets of whole state-dict entries (several senders: each entry is
    gathered to one source only, so no entry straddles two buckets): a bucket closes before the entry that would
    take it past ``bucket_bytes`` (an entry larger than a bucket is a bucket of its own)."""
    bounds, total = [0], 0.0
    for i, e in enumerate(np.asarray(sizes_E, np.float64)):
        if total and total + e > bucket_bytes:
            bounds.append(i)
            total = 0.0
        total += e
    if len(sizes_E):
        bounds.append(len(sizes_E))
    return np.asarray(bounds, np.int64)


def sender_groups(trainer_gpus: int, gpus_per_node: int, senders: int) -> list[list[int]]:
    """Trainer ranks of each sender group, source first: ``min(senders, T)`` groups spread evenly over the ranks
    (group s starts at ``s * (T // S)``), each its source and the next ``min(n, T // S) - 1`` ranks as relays
    (the GPUs of its node: the group's broadcast ring leaves the node on each of their NICs). Ranks past a group's
    width are in no group (they only give their slices)."""
    S = max(1, min(senders, trainer_gpus))
    stride = trainer_gpus // S
    width = max(1, min(gpus_per_node, stride))
    return [list(range(s * stride, s * stride + width)) for s in range(S)]


def bucket_senders(buckets: int, senders: int) -> np.ndarray:
    """``[b]``: the sender group of each bucket, dealt round-robin (consecutive buckets from different sources, so
    one source gathers while another sends; buckets of similar size give each source ~M / S)."""
    return np.arange(buckets) % max(1, senders)


NCCL_COMM_BYTES = 256 << 20
"""One NCCL communicator's memory on an engine worker (its ring buffers: ``NCCL_BUFFSIZE`` 4 MiB per channel and
peer, up to 32 channels; assumed, varies with NCCL's version and settings): an engine holds one per sender group."""


def policy_bytes(args, dtype_bytes: int = 2) -> int:
    """Bytes of the HF export of a model's args (``models/flavors``: attention with head norms, router, experts,
    norms, embedding and head): what one sync moves (Qwen3-30B-A3B in bf16: 61.1 GB)."""
    a = args
    attn = 2 * a.dim * a.n_heads * a.head_dim + 2 * a.dim * a.n_kv_heads * a.head_dim + 2 * a.head_dim
    moe = a.num_experts * 3 * a.dim * a.moe_hidden_dim + a.num_experts * a.dim
    return (a.n_layers * (attn + moe + 2 * a.dim) + 2 * a.vocab_size * a.dim + a.dim) * dtype_bytes


def bucket_bounds(sizes_N: np.ndarray, bucket_bytes: int) -> np.ndarray:
    """``[b + 1]`` tensor offsets of the buckets: a bucket closes on the tensor that takes it past
    ``bucket_bytes`` (vLLM's ``packed_tensor`` rule, on both of its sides; a tensor larger than a bucket is a
    bucket of its own or ends one)."""
    cum = np.cumsum(np.asarray(sizes_N, np.float64))
    bounds, start, base = [0], 0, 0.0
    while start < len(cum):
        end = int(np.searchsorted(cum, base + bucket_bytes, side="right")) + 1
        end = min(max(end, start + 1), len(cum))
        bounds.append(end)
        start, base = end, cum[end - 1]
    return np.asarray(bounds, np.int64)


def source_rank(engine_K: np.ndarray, trainer_gpus: int, gpus_per_node: int) -> np.ndarray:
    """``[K]``: the trainer rank that gathers each engine's buckets and broadcasts them (its group's rank 0):
    engines dealt round-robin over the trainer's nodes, then over each node's GPUs."""
    nodes = -(-trainer_gpus // gpus_per_node)
    engine_K = np.asarray(engine_K)
    return np.minimum((engine_K % nodes) * gpus_per_node + (engine_K // nodes) % gpus_per_node, trainer_gpus - 1)


def group_ranks(engine: int, trainer_gpus: int, gpus_per_node: int) -> list[int]:
    """Trainer ranks of ``engine``'s transfer group in group-rank order: its source first, then the other GPUs of
    the source's node (relays: the broadcast ring leaves the node on each of their NICs)."""
    src = int(source_rank(np.array([engine]), trainer_gpus, gpus_per_node)[0])
    first = src - src % gpus_per_node
    node = list(range(first, min(first + gpus_per_node, trainer_gpus)))
    i = node.index(src)
    return node[i:] + node[:i]


def _result(s: SyncSetting, stages: dict, sent: float, recv: float, recv_ib: float, coll: int, extra: float,
            sender: dict | None = None, engine_recv: float = 0.0, buckets: int = 0,
            engine_extra: float = 0.0) -> dict:
    return {"engine_worker_extra_bytes": engine_extra, "design": s.design, "setting": asdict(s), "sync_s": sum(stages.values()), "stages_s": stages,
            "bytes_sent_per_rank": sent, "bytes_received_per_rank": recv, "bytes_received_ib_per_rank": recv_ib,
            "collectives_per_rank": coll, "peak_extra_bytes_per_rank": extra, "sender": sender,
            "engine_worker_bytes_received": engine_recv, "buckets": buckets}


def sync_cost(sizes_N: np.ndarray, s: SyncSetting, links: SyncLinks, entry_sizes_E: np.ndarray | None = None) -> dict:
    """One sync's cost per trainer rank (the busiest: a sender where there is one), its stage times and ``sync_s``
    (module docstring). Bytes are per rank and direction; ``bytes_received_ib_per_rank`` is the part of the
    received bytes that crosses nodes. ``entry_sizes_E``: the state-dict entries' bytes (``hf_entry_bytes``;
    several senders bucket whole entries), default one entry per tensor."""
    sizes_N = np.asarray(sizes_N, np.float64)
    M, N, largest = float(sizes_N.sum()), len(sizes_N), float(sizes_N.max())
    T, n, g = s.trainer_gpus, s.gpus_per_node, s.engine_size
    colocated = s.engine_gpus == 0
    E = T if colocated else s.engine_gpus
    K = E // g
    entries = s.state_entries or N
    remote = max(T - n, 0) / T  # the share of the trainer's shards on other nodes
    if s.design == "reload":
        node_write = M * min(n, T) / T
        stages = {"write_s": node_write / links.fs_Bps, "read_s": M / links.fs_Bps,  # every engine node reads M
                  "load_s": engine_load_s(N, s, links), "latency_s": 2 * links.latency_s}
        return _result(s, stages, M / T, 0.0, 0.0, 2, largest, engine_recv=M)
    if s.design == "current":
        gathered = M * (T - 1) / T  # every rank receives every parameter (ring all-gather)
        gather_ib = M * remote / n  # the remote part entering a node on its n NICs
        ring_leaves = (E > n) or not colocated  # rank 0's broadcast ring reaches workers on other nodes
        stages = {"gather_s": max(gathered / links.nvlink_Bps, gather_ib / links.ib_Bps),
                  "send_s": M / (links.ib_Bps if ring_leaves else links.nvlink_Bps),
                  "load_s": engine_load_s(N, s, links), "latency_s": (entries + N) * links.latency_s}
        return _result(s, stages, gathered + M, gathered, gather_ib, entries + N, largest,
                       sender={"rank": 0, "bytes_sent": gathered + M}, engine_recv=M)
    bounds = bucket_bounds(sizes_N, s.bucket_bytes)
    b = len(bounds) - 1
    bucket_B = np.add.reduceat(sizes_N, bounds[:-1])
    biggest = float(bucket_B.max())
    if colocated:  # the IPC path (``ipc_weights``)
        return colocated_ipc_cost(sizes_N, s, links)
    if s.senders > 1:
        return _senders_cost(sizes_N if entry_sizes_E is None else np.asarray(entry_sizes_E, np.float64), s, links, N)
    src_K = source_rank(np.arange(K), T, n)
    if s.api == "vllm":  # K engines in ONE transfer group, as the runtime runs them: the fleet's one_group design
        f = FleetSync("one_group", T, n, g, tuple(int(x) for x in src_K), s.bucket_bytes, entries, s.expert_tensors,
                      s.load)
        r = fleet_sync_cost(sizes_N, f, links)
        return _result(s, r["stages_s"], r["bytes_sent_ib_per_rank"], r["bytes_received_per_rank"], r["nic_in_bytes"],
                       r["collectives"], 2 * biggest + largest,
                       sender={"rank": int(src_K[0]), "groups": 1, "relay_groups": r["rings_per_node"]},
                       engine_recv=M, buckets=b)
    nodes = -(-T // n)  # SGLang, one sender: its update calls one at a time, each receiving then loading
    node_K = np.arange(K) % nodes
    srcs = np.unique(src_K)
    groups_R = np.bincount(node_K, minlength=nodes)[np.arange(T) // n]  # the groups each rank relays in
    sources_R = np.bincount(src_K, minlength=T)  # the groups each rank is the source of
    gather_R = np.isin(np.arange(T), srcs) * M * (T - 1) / T  # a source gathers every bucket once (NVLink)
    ring_R = M * (groups_R - sources_R)  # a relay receives every byte of every group it is in
    give_R = M / T * (len(srcs) - np.isin(np.arange(T), srcs))  # its slices to every source
    relays = min(n, T)
    node_srcs = np.bincount(srcs // n, minlength=nodes)  # sources per node
    ib_in_R = node_srcs[np.arange(T) // n] * M * remote / relays  # two hops: the remote slices over every NIC
    recv_R = gather_R + ring_R + ib_in_R * (1 - np.isin(np.arange(T), srcs))
    stages = {"pipeline_s": max(((gather_R + ring_R) / links.nvlink_Bps).max(),  # into a GPU over NVLink
                                (ib_in_R / links.ib_Bps).max(),  # remote slices, one rail per NIC
                                ((groups_R * M / relays + give_R * remote) / links.ib_Bps).max(),  # out of a NIC
                                M / (min(g, n, relays) * links.ib_Bps),  # into an engine node: one NIC per channel
                                M / links.nvlink_Bps),  # every engine worker receives every byte (a broadcast)
              "fill_s": biggest / links.ib_Bps,
              "latency_s": (2 * entries * len(srcs) + b + b * int(groups_R.max())) * links.latency_s
              + b * links.call_s,  # two gathers per entry and source, a go flag and broadcasts per bucket
              "load_s": engine_load_s(N, s, links)}  # SGLang: one update call at a time, receiving then loading
    r = int(np.argmax(recv_R))
    return _result(s, stages, float((M * groups_R + give_R).max()), float(recv_R.max()), float(ib_in_R.max()),
                   int(2 * entries * len(srcs) + b + b * groups_R.max()), 2 * biggest + largest,
                   sender={"rank": int(srcs[0]), "groups": int(sources_R.max()), "relay_groups": int(groups_R.max()),
                           "busiest_rank": r}, engine_recv=M, buckets=b)


def _senders_cost(sizes_E: np.ndarray, s: SyncSetting, links: SyncLinks, tensors: int) -> dict:
    """The bucketed sync from several sender groups into one engine server (``weight_buckets``, SGLang's named
    groups): buckets of whole entries dealt round-robin to the groups' sources (``bucket_senders``), each entry
    gathered in two hops to its bucket's source only; the engine takes one group's update at a time (SGLang's
    writer lock), so the broadcasts follow each other while the other sources gather (pipelined, two buckets per
    source at most). Per rank: a source receives its buckets (~M / S, the remote part over its node's NICs), a relay
    its group's broadcasts (~M / S), a rank of a source's node that source's remote slices of its rail; the ring
    of a group of w GPUs leaves its node on w NICs and enters the engine's node on min(g, n) of them."""
    M, largest = float(sizes_E.sum()), float(sizes_E.max())
    T, n, g = s.trainer_gpus, s.gpus_per_node, s.engine_size
    groups = sender_groups(T, n, s.senders)
    S = len(groups)
    bounds = entry_bucket_bounds(sizes_E, s.bucket_bytes)
    b = len(bounds) - 1
    bucket_B = np.add.reduceat(sizes_E, bounds[:-1])
    sent_S = np.bincount(bucket_senders(b, S), weights=bucket_B, minlength=S)  # each source's bytes
    rank_R = np.arange(T)
    src_R = np.full(T, -1)
    grp_R = np.full(T, -1)
    for k, ranks in enumerate(groups):
        src_R[ranks[0]] = k
        grp_R[ranks] = k
    is_src, in_grp = src_R >= 0, grp_R >= 0
    remote = max(T - n, 0) / T
    node_bytes = np.bincount(np.array([r[0] // n for r in groups]), weights=sent_S, minlength=-(-T // n))
    ib_in_R = node_bytes[rank_R // n] * remote / min(n, T)  # hop 1: the remote slices of its node's sources
    gather_R = np.where(is_src, sent_S[np.maximum(src_R, 0)] * (T - 1) / T, 0.0)
    ring_R = np.where(in_grp & ~is_src, sent_S[np.maximum(grp_R, 0)], 0.0)  # a relay receives its group's bytes
    recv_R = gather_R + ring_R + np.where(is_src, 0.0, ib_in_R)
    out_R = np.where(in_grp, sent_S[np.maximum(grp_R, 0)], 0.0) + M / T  # its ring's bytes on, its own slices
    width_S = np.array([len(r) for r in groups])
    ring_Bps_S = np.minimum(width_S, min(g, n)) * links.ib_Bps
    send_s = float((sent_S / ring_Bps_S).sum())  # the engine takes one group at a time
    stages = {"pipeline_s": max(send_s, M / links.nvlink_Bps,  # every engine worker receives every byte
                                (recv_R / links.nvlink_Bps).max(), (ib_in_R / links.ib_Bps).max()),
              "fill_s": float(bucket_B.max()) * (1 / links.nvlink_Bps + 1 / links.ib_Bps),
              "latency_s": (2 * len(sizes_E) + 2 * b) * links.latency_s + b * links.call_s,
              "load_s": engine_load_s(tensors, s, links)}  # SGLang: receive, then load
    r = int(np.argmax(recv_R))
    coll = int(2 * len(sizes_E) + b + np.bincount(bucket_senders(b, S), minlength=S).max())
    return _result(s, stages, float(out_R.max()), float(recv_R.max()), float(ib_in_R.max()), coll,
                   2 * float(bucket_B.max()) + largest,
                   sender={"senders": S, "group_width": int(width_S.max()), "bytes_per_source": float(sent_S.max()),
                           "busiest_rank": r}, engine_recv=M, buckets=b, engine_extra=S * NCCL_COMM_BYTES)


def colocated_ipc_cost(sizes_N: np.ndarray, s: SyncSetting, links: SyncLinks) -> dict:
    """The colocated sync as ``ipc_weights`` runs it, per rank (every rank alike): an engine on every block of
    ``engine_size`` GPUs of every node, all fed at once, each worker reading every bucket from a copy on its own
    GPU (vLLM's IPC receiver: one handle per GPU UUID). Every rank all-gathers each entry whole (over its rail:
    M x remote / n over each NIC, each slice crossing nodes once per node; then over its node: M (n - 1) / n over
    NVLink), packs it and copies each bucket into its exported buffer; two one-int all-reduces per bucket (the
    buffer free, every copy in place) and one handle gather per sync; each engine's source posts one
    ``/update_weights`` per bucket, which returns once the workers have loaded it. The gathers of bucket b + 1
    run while the engines load bucket b, so the sync is the longer of the gathers and the engine chain (posts,
    loads), plus one bucket's fill. Memory beyond
    the model, every rank: the entry being gathered (at most the largest tensor, padded), the packed bucket and
    the exported buffer of the largest bucket."""
    sizes_N = np.asarray(sizes_N, np.float64)
    M, N, largest = float(sizes_N.sum()), len(sizes_N), float(sizes_N.max())
    T, n = s.trainer_gpus, min(s.gpus_per_node, s.trainer_gpus)
    entries = s.state_entries or N
    bounds = bucket_bounds(sizes_N, s.bucket_bytes)
    b = len(bounds) - 1
    biggest = float(np.add.reduceat(sizes_N, bounds[:-1]).max())
    received = M * (T - 1) / T  # every other rank's slices
    recv_ib = M * max(T - n, 0) / T / n  # the remote slices, one rail per NIC
    recv_nvl = M * (n - 1) / n  # the node's other rails
    hops = 3 if T > n else 2  # header all-gather, all-gather (rail, node across nodes)
    coll = hops * entries + 2 * b + 1  # per bucket two all-reduces; the handle gather once
    gather = max(recv_nvl / links.nvlink_Bps, recv_ib / links.ib_Bps)
    chain = {"calls_s": b * links.call_s, "load_s": engine_load_s(N, s, links)}
    stages = {"pipeline_s": max(gather, sum(chain.values())), "fill_s": biggest / links.nvlink_Bps,
              "latency_s": coll * links.latency_s + 3 * links.call_s}  # start, finish, reset
    sent = M * (n - 1) / n + M / T * max(T // n - 1, 0)  # ring all-gathers: its rail to the node, its slice to
    # the rail's other nodes
    return _result(s, stages, sent, received, recv_ib, coll, 2 * biggest + largest,
                   sender={"rank": 0, "bytes_received": received, "node_gpus": n,
                           "node_gpu_extra_bytes": biggest, "gather_s": gather, "engine_chain_s": chain,
                           "engines": T // s.engine_size},
                   engine_recv=M, buckets=b)


FLEET_DESIGNS = ("one_group", "node_forward", "per_engine")
NCCL_STEP_BYTES = 512 << 10
"""One step of an NCCL ring channel (``NCCL_BUFFSIZE`` 4 MiB / 8 steps, assumed): a broadcast's first bytes reach
the ring's last node after one step per hop, so a ring of h node hops adds h steps per broadcast."""


@dataclass(frozen=True)
class FleetSync:
    """A fleet's sync setting (``fleet_sync_cost``): K engines of g GPUs each on GPUs of their own, fed by the
    trainer's T ranks (n per node), engine k's source ``sources[k]`` (``rollouts/fleet/layout.py``)."""

    design: str
    trainer_gpus: int
    gpus_per_node: int
    engine_gpus: int  # g
    sources: tuple[int, ...]  # one per engine
    bucket_bytes: int = 512 << 20
    state_entries: int = 0
    expert_tensors: int = 0
    load: str = "stacked"

    def __post_init__(self) -> None:
        if self.design not in FLEET_DESIGNS:
            raise ValueError(f"fleet sync design {self.design!r}: choose from {FLEET_DESIGNS}")
        if not self.sources or min(self.trainer_gpus, self.gpus_per_node, self.engine_gpus) < 1:
            raise ValueError(f"fleet sync needs engines and positive sizes: {self}")

    @classmethod
    def of(cls, layout, design: str = "one_group", **kw) -> "FleetSync":
        """From ``rollouts.fleet.layout.EngineLayout`` (disaggregated): its engines, their GPUs and sources."""
        if layout.colocated:
            raise ValueError("a colocated fleet syncs by IPC from its nodes: colocated_fleet_cost")
        return cls(design, layout.trainer_gpus, layout.gpus_per_node, layout.engines[0].gpus,
                   tuple(layout.sources()), **kw)


FAILURE_ISOLATION = {
    "one_group": "one NCCL communicator over the source's node and every engine's workers: a dead engine breaks the "
                 "broadcast for all (NCCL cannot drop a rank); the survivors re-join a new group (vLLM's "
                 "init_weight_transfer_engine again, rank offsets without it) before the next sync",
    "node_forward": "one group per engine (its failure stays its own); one gather per trainer node, forwarded over "
                    "NVLink to the node's other sources",
    "per_engine": "one group per engine (its failure stays its own); every source gathers the model itself",
}


def fleet_sync_cost(sizes_N: np.ndarray, f: FleetSync, links: SyncLinks) -> dict:
    """One sync of M bytes to K disaggregated engines at once, per design (``FLEET_DESIGNS``), per rank and per NIC.

    - ``per_engine`` (vLLM's one sender per transfer group, one group per engine): every source gathers each bucket
      (two hops: a rank's slice crosses nodes once per remote source, on its own NIC, the remote slices enter the
      source's node over all n NICs) and broadcasts it to its engine with its node's GPUs as relays (the ring
      leaves on every relay's NIC: M / n per NIC per group). A trainer NIC carries ``K / nodes`` groups' rings and
      a rank sends its slice to every remote source: ~K M / T per rank, over M / n once K > T / n.
    - ``node_forward``: one gather per trainer node holding a source, forwarded over NVLink to the node's other
      sources; the rings as ``per_engine`` (vLLM still takes one sender per engine).
    - ``one_group`` (the runtime's: ``sources/streamed.py``): one transfer group of the source's node and every
      engine's workers (vLLM's ``rank_offset`` / ``world_size``: server k's workers at offset n + k g): one
      gather, one ring that leaves the trainer's node once (M / n per NIC) and passes through the engines' nodes in
      turn (each forwards M / n per NIC).
    All engines load at once (``engine_load_s``, overlapped with the transfer as vLLM's packed consumer does); the
    engines' calls are posted at once. Time: the slowest stage (NVLink into a GPU, NIC in, NIC out, the engines'
    load) plus a bucket's fill, a ring step per node hop and broadcast, and one latency per collective."""
    sizes_N = np.asarray(sizes_N, np.float64)
    M, N = float(sizes_N.sum()), len(sizes_N)
    T, n, g = f.trainer_gpus, f.gpus_per_node, f.engine_gpus
    nodes, K = -(-T // n), len(f.sources)
    src_K = np.asarray(f.sources, np.int64)
    rank_R, node_R = np.arange(T), np.arange(T) // n
    entries = f.state_entries or N
    bounds = bucket_bounds(sizes_N, f.bucket_bytes)
    b = len(bounds) - 1
    biggest = float(np.add.reduceat(sizes_N, bounds[:-1]).max())
    if f.design == "one_group":
        gatherers, rings_node = src_K[:1], np.bincount(src_K[:1] // n, minlength=nodes)
    else:  # per_engine: every source gathers; node_forward: each node's first source
        gatherers = src_K if f.design == "per_engine" else np.array(
            [src_K[src_K // n == nd].min() for nd in np.unique(src_K // n)])
        rings_node = np.bincount(src_K // n, minlength=nodes)
    gath_node = np.bincount(gatherers // n, minlength=nodes)  # gathers per trainer node
    remote = max(T - n, 0) / T
    relays = min(n, T)
    ib_in_R = gath_node[node_R] * M * remote / relays  # hop 1: a node's remote slices over its n NICs, per gather
    give_R = (len(gatherers) - gath_node[node_R]) * M / T  # its slice to every gatherer on another node
    ib_out_R = rings_node[node_R] * M / relays + give_R  # the rings leave on every relay's NIC
    is_gath = np.bincount(gatherers, minlength=T)[:T]
    is_src = np.bincount(src_K, minlength=T)[:T]
    forwarded_R = (is_src - np.minimum(is_src, is_gath)).clip(0) * M  # node_forward: a source fed over NVLink
    nvl_in_R = is_gath * M * (T - 1) / T + (rings_node[node_R] - is_src) * M + forwarded_R  # gathers, relaying
    workers_node = min(g, n) if f.design != "one_group" else min(K * g, n)  # one ring: all of a node's workers
    engine_nic = M / workers_node
    load = engine_load_s(N, SyncSetting("bucketed", T, K * g, g, n, expert_tensors=f.expert_tensors, load=f.load),
                         links)
    hops = 1 + (-(-K * g // n) if f.design == "one_group" else 1)  # node hops of the longest ring
    stages = {"pipeline_s": max(load, float(nvl_in_R.max()) / links.nvlink_Bps, float(ib_in_R.max()) / links.ib_Bps,
                                float(ib_out_R.max()) / links.ib_Bps, engine_nic / links.ib_Bps,
                                M / links.nvlink_Bps),
              "fill_s": biggest / links.ib_Bps + b * hops * (NCCL_STEP_BYTES / links.ib_Bps + links.latency_s),
              "latency_s": (2 * entries * len(gatherers) + b * (1 + int(rings_node.max()))) * links.latency_s
              + 4 * links.call_s}  # every rank in every gather (two hops per entry), a go flag + its rings per bucket
    return {"design": f.design, "engines": K, "sync_s": sum(stages.values()), "stages_s": stages,
            "model_bytes": M, "nic_out_bytes": float(ib_out_R.max()), "nic_in_bytes": float(ib_in_R.max()),
            "engine_nic_bytes": engine_nic, "bytes_sent_ib_per_rank": float(ib_out_R.max()),
            "bytes_received_per_rank": float((nvl_in_R + ib_in_R * (1 - is_gath)).max()),
            "gathers": len(gatherers), "rings_per_node": int(rings_node.max()), "buckets": b,
            "collectives": 2 * entries * len(gatherers) + b * (1 + int(rings_node.max())),
            "failure_isolation": FAILURE_ISOLATION[f.design]}
