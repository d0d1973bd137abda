"""Typed configs and the plan container shared by every planner level.

Shape suffixes follow torchtitan's ``models/common/moe.py`` convention:
M micro-steps, L layers, S source ranks, E logical experts, R ranks,
C slots per rank (E/R owned + spare), N nodes, T transfers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

OWNER_POLICIES = ("contiguous", "balanced")

# One row per expert-weight move; the transfer engine issues them one micro-step ahead.
TRANSFER_DTYPE = np.dtype(
    [
        ("micro_step", np.int32),
        ("layer", np.int32),
        ("expert", np.int32),
        ("src_rank", np.int32),
        ("dst_rank", np.int32),
        ("inter_node", np.bool_),  # path: False = intra-node (NVLink), True = inter-node (IB)
    ]
)


@dataclass(frozen=True)
class Topology:
    """Expert-parallel ranks grouped into nodes; rank r lives on node r // ranks_per_node."""

    num_nodes: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        for name in ("num_nodes", "ranks_per_node"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Topology.{name} must be a positive int, got {v!r}")

    @classmethod
    def from_ranks(cls, num_ranks: int, ranks_per_node: int) -> "Topology":
        """Build from a rank count; raises if the ranks do not divide into whole nodes."""
        if num_ranks < 1 or ranks_per_node < 1:
            raise ValueError(f"topology: ranks ({num_ranks}) and ranks_per_node ({ranks_per_node}) must be >= 1")
        if num_ranks % ranks_per_node:
            raise ValueError(
                f"topology: {num_ranks} ranks do not divide into nodes of {ranks_per_node} ranks"
            )
        return cls(num_ranks // ranks_per_node, ranks_per_node)

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def node_of_rank_R(self) -> np.ndarray:
        return np.arange(self.num_ranks) // self.ranks_per_node


@dataclass(frozen=True)
class CostModel:
    """Per-token compute and per-expert move costs, H100-class defaults (gpt-oss-20b expert).

    Defaults: one gpt-oss-20b expert is 3 x 2880 x 2880 bf16 weights ~= 50 MB;
    a token through it costs ~150 MFLOP forward+backward, ~0.4 us at ~400 TFLOP/s
    effective; NVLink ~400 GB/s effective per direction; one 400 Gb/s NIC per GPU
    ~= 45 GB/s effective inter-node. Dispatch volume: hidden_size x act_bytes per token.
    """

    compute_s_per_token: float = 0.4e-6
    expert_bytes: float = 50e6
    intra_node_bw: float = 400e9  # bytes / s
    inter_node_bw: float = 45e9  # bytes / s
    host_to_device_bw: float = 50e9  # bytes / s, pinned host memory -> GPU (PCIe Gen5 x16), the CPU-assisted path
    device_to_host_bw: float = 50e9  # bytes / s, staging an owner's experts in host memory (once per step)
    host_network_bw: float = 12e9  # bytes / s, host-to-host hop of the CPU-assisted lane (gloo over the NIC)
    hidden_size: int = 2880
    act_bytes: int = 2
    # Transfers are issued one micro-step ahead, so they hide behind compute unless
    # the link is saturated; set False to charge their full time against a replica's gain.
    overlap_transfers: bool = True
    # Fixed cost of one more expert group on a rank, in tokens (a grouped GEMM's per-group cost and the slot
    # gather; the simulator derives it from its calibrated expert model, simulator/grouped_mm.py): foremoe
    # balances tokens + this per slot with tokens, and a new replica costs its receiver this much.
    # 0 balances token counts.
    slot_overhead_tokens: int = 0
    # What a token costs in a spare slot relative to an owned one (>= 1): the in-place slot GEMM copies a spare
    # slot's output rows into place (models/slot_gemm.py); the simulator derives it from its calibrated model.
    # The token-level polish levels ranks with it. 1: tokens are tokens.
    spare_token_weight: float = 1.0
    # The time of one more expert group of n rows on a rank, as a table ``((rows...), (ms...))`` of the runtime's
    # grouped GEMMs (``simulator.grouped_mm.group_ms_table``, the simulator's calibrated model), and what a row
    # costs more in a spare slot (ms). With a table foremoe's last token polish levels the ranks' time on it
    # (``time_polish.level_time``): the grouped GEMM's time is not linear in rows (tiles, small groups), so
    # ranks level in tokens + a slot cost stay ~3% apart in time. None: no time polish.
    group_ms: tuple | None = None
    spare_row_ms: float = 0.0
    # The fixed time (ms) of a rank's spare part in a layer, paid only where its spare slots run rows (the in-place
    # slot path's bank-row gather and second grouped calls: ``simulator.grouped_mm.spare_part_ms``); charged on
    # each spare slot with rows, exact for one spare slot (the default), an upper bound for more.
    spare_part_ms: float = 0.0
    # What an owner's compute stream pays per replica gradient returned to it in a layer (ms; the update stage's
    # backward: the ``index_add_`` into its expert's gradient on the landing stream, ``transfer/landing.py``, at
    # ``simulator.grouped_mm.landing_prices``' share), and once per layer where any is (launches); 0 in the
    # recompute. Weighed by ``time_polish.landing_LR``.
    landing_ms: float = 0.0
    landing_fixed_ms: float = 0.0
    # The passes of the stage that each wait for their own slowest rank (the update stage: forward, then
    # backward), per pass ``(time table, spare_row_ms, spare_part_ms)`` as ``group_ms`` / ``spare_row_ms`` /
    # ``spare_part_ms`` are for their sum. With
    # two or more and ``PlannerConfig.pass_polish``, foremoe's last polish lowers each layer's max over ranks of
    # each pass, summed (``time_polish.level_passes``): levelling the sum leaves the forward's and the backward's
    # stragglers on different ranks, and each pass waits for its own. Empty: the stage is one pass.
    passes: tuple = ()

    def transfer_s(self, inter_node: bool | np.ndarray) -> float | np.ndarray:
        bw = np.where(inter_node, self.inter_node_bw, self.intra_node_bw)
        return self.expert_bytes / bw

    def host_path_s(self, inter_node: bool) -> float:
        """One move by the CPU-assisted lane: the owner's staging (charged in full to the move: at worst
        one move per staged expert), the host-to-host hop between nodes, the host-to-device copy."""
        hop = self.expert_bytes / self.host_network_bw if inter_node else 0.0
        return self.expert_bytes / self.device_to_host_bw + hop + self.expert_bytes / self.host_to_device_bw

    def use_host_path(self, inter_node: bool) -> bool:
        """The CPU-assisted lane, staging included, beats the direct link for this move."""
        return self.host_path_s(inter_node) < float(self.transfer_s(inter_node))

    def dispatch_bytes(self, tokens: int | np.ndarray) -> float | np.ndarray:
        return np.asarray(tokens) * float(self.hidden_size * self.act_bytes)


@dataclass(frozen=True)
class PlannerConfig:
    """Knobs of the foresight planner (and the slot budget every balancer gets)."""

    spare_slots: int = 1  # S replica slots per rank on top of the E/R owned experts
    slots_per_rank: int | None = None  # optional total budget C; must be >= E/R (overrides spare_slots)
    owner_policy: str = "contiguous"  # "contiguous": rank r owns [r*E/R, (r+1)*E/R) (DTensor Shard(0))
    # balanced owners are only re-placed when the kept placement is worse than the
    # new one by more than this fraction of the mean (hysteresis keeps owners stable in RL).
    owner_hysteresis: float = 0.2
    # A new replica (a weight transfer) must take at least this fraction of the mean
    # rank load off the straggler; a replica already resident is always worth using.
    min_replica_gain: float = 0.01
    stay_bonus: float = 0.5  # score bonus for reusing a resident replica (no transfer)
    node_bonus: float = 0.1  # score bonus for a replica fed from the same node (intra-node path)
    # Weights change at every optimizer step, so resident replicas are stale at a step boundary.
    refresh_replicas_each_step: bool = True
    polish_iters: int | None = None  # token-level rebalancing iterations (None: 2 * R)
    # With a slot's fixed cost (CostModel.slot_overhead_tokens > 0), hand whole experts to spare slots before
    # splitting any (handoff.py): a split costs a slot's fixed cost, a whole handoff none. Off by default: on the
    # calibrated H100 / H200 model a slot costs ~0.1-0.4 of an expert's load and handoffs buy <= 0.1% while the
    # planner takes 3-6x longer (docs/simulator.md, gap to ideal); they pay where a slot costs about an expert.
    whole_handoffs: bool = False
    # foremoe plans each micro-step from these multiples of the slot's fixed cost (CostModel.slot_overhead_tokens)
    # and keeps per layer the plan whose slowest rank is fastest on the time table (``time_polish.best_in_time``):
    # the greedy's cost of a split is a line fitted around the typical group, so a cheaper or dearer split is
    # the better plan on some layers (docs/simulator.md, gap to ideal: the planning time this costs)
    # (1.0 always; the others only on the layers whose slowest rank is above their mean rank by
    # ``slot_cost_starts_gap``, 0: every layer; 0.01 planned 2.3x instead of 2.9x the one start's time at the
    # same trainer's stages within 0.1 ms on the trace, docs/simulator.md)
    # Off by default (one start), as ``whole_handoffs``: (0.5, 1, 2) plans 2.3-2.9x longer for 0.1-0.2% of the
    # trainer's stages, enough to put the update stage's planning on the critical path (docs/simulator.md)
    slot_cost_starts: tuple[float, ...] = (1.0,)
    slot_cost_starts_gap: float = 0.0
    # With ``CostModel.passes`` (the update stage's forward and backward tables), the last polish lowers each layer's
    # max over ranks of the forward plus that of the backward (``time_polish.level_passes``), and the starts are
    # judged on it. Off by default: 1.5x (EP 8) / 1.34x (EP 64) the update stage's planning time for 0.04-0.06% of
    # the trainer's stages at 64 GPUs (docs/simulator.md, levers).
    pass_polish: bool = False
    # The time polish's ranks that may shed per layer (``time_polish.level_time``): 1, the straggler only; k, when the
    # straggler has no move that lowers it, the rank below it sheds (down to the k-th), making room for it next round
    # (two ranks level at the top, each with its only co-host the other, stop a straggler-only polish). Off by
    # default: 3 plans 1.1-1.4x (EP 8) / 2.1x (EP 64) longer for 0.04-0.07% of the trainer's stages
    # (docs/simulator.md, levers).
    polish_chain_depth: int = 1
    eplb_num_groups: int | None = None  # EPLB expert groups (None: one expert per group)

    def __post_init__(self) -> None:
        if self.owner_policy not in OWNER_POLICIES:
            raise ValueError(f"owner_policy must be one of {OWNER_POLICIES}, got {self.owner_policy!r}")
        if self.slots_per_rank is None and self.spare_slots < 0:
            raise ValueError(f"spare_slots must be >= 0, got {self.spare_slots}")
        if not self.slot_cost_starts or any(not (x > 0) for x in self.slot_cost_starts):
            raise ValueError(f"slot_cost_starts must be positive multiples of the slot cost, got {self.slot_cost_starts}")
        if isinstance(self.polish_chain_depth, bool) or not isinstance(self.polish_chain_depth, int) or \
                self.polish_chain_depth < 1:
            raise ValueError(f"polish_chain_depth must be an int >= 1, got {self.polish_chain_depth!r}")
        if not self.slot_cost_starts_gap >= 0:
            raise ValueError(f"slot_cost_starts_gap must be >= 0, got {self.slot_cost_starts_gap}")

    def resolve_spare(self, num_experts: int, num_ranks: int) -> int:
        """Spare slots per rank; raises if the budget cannot hold the E/R owned experts."""
        if num_experts % num_ranks:
            raise ValueError(f"experts ({num_experts}) must divide evenly over ranks ({num_ranks})")
        owned = num_experts // num_ranks
        if self.slots_per_rank is not None:
            if self.slots_per_rank < owned:
                raise ValueError(
                    f"slot budget: slots_per_rank={self.slots_per_rank} is smaller than E/R={owned}"
                )
            return self.slots_per_rank - owned
        return self.spare_slots


@dataclass
class StagePlan:
    """Everything the runtime needs to execute a stage of micro-steps.

    slots_MLRC: logical expert resident in slot c of rank r (-1 = empty); the first
        E/R slots hold the rank's owned experts, the spare slots follow. A spare slot
        may hold a resident replica with no tokens (kept so a later micro-step reuses it).
    assign_MLER: tokens of expert e processed on rank r; sums over R equal the loads
        summed over sources.
    owner_MLE: owner rank of every expert (fixed for contiguous owners). It is the weights' layout
        (``layout_owner_MLE``) unless ``info["owners_are_layout"]`` is False (EPLB: the primary copy).
    transfers_T: structured array (TRANSFER_DTYPE) of weight moves, issued one micro-step ahead.
    plan_ms_M: planning wall time per micro-step (all layers).
    """

    balancer: str
    slots_MLRC: np.ndarray
    assign_MLER: np.ndarray
    owner_MLE: np.ndarray
    transfers_T: np.ndarray
    plan_ms_M: np.ndarray
    topology: Topology
    info: dict = field(default_factory=dict)

    @property
    def rank_load_MLR(self) -> np.ndarray:
        return self.assign_MLER.sum(axis=2)

    @property
    def layout_owner_MLE(self) -> np.ndarray:
        """Which rank holds each expert's weights and optimizer state in each micro-step (its EP shard)."""
        if self.info.get("owners_are_layout", True):
            return self.owner_MLE
        M, L, E = self.owner_MLE.shape
        R = self.topology.num_ranks
        return np.broadcast_to(np.arange(E) // (E // R), (M, L, E))

    def transfers_for(self, micro_step: int) -> np.ndarray:
        return self.transfers_T[self.transfers_T["micro_step"] == micro_step]
