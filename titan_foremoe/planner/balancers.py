"""Balancer registry: every policy plans a whole stage behind one signature.

``plan_stage(name, loads_MLSE, topology, config, cost, micro_steps_per_step=...)``
returns a StagePlan. Micro-steps are grouped into optimizer steps of
``micro_steps_per_step``; weights change between steps, so replicas resident
across a step boundary are stale and must be re-sent (refresh_replicas_each_step).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from .eplb import eplb_slots
from .exact import plan_exact_stage
from .handoff import whole_handoffs
from .owners import balanced_owners, check_owners, contiguous_owners, owned_slots_LRK
from .reactive import plan_reactive
from .replicas import initial_slots, place_replicas
from .step_lpt import lpt_slots
from .time_polish import best_in_time, level_passes, level_time, rank_ms_LR
from .split import assign_from_slots, even_split, ideal_assign, rebalance_split_time
from .transfers import first_host_LE, keep_primary_copies, schedule_transfers
from .types import TRANSFER_DTYPE, CostModel, PlannerConfig, StagePlan, Topology
from .validate import validate_budget, validate_loads


class _Ctx:
    """Validated inputs shared by the balancers."""

    def __init__(self, loads_MLSE, topology, config, cost, micro_steps_per_step, history_LE,
                 initial_owner_LE=None, owners_ZLE=None, resume_slots_LRC=None):
        self.loads = validate_loads(loads_MLSE, topology)
        # the passes' tables are used only with pass_polish (level_passes and the starts' judge read cost.passes)
        cost = cost if config.pass_polish or not cost.passes else dataclasses.replace(cost, passes=())
        self.topology, self.config, self.cost = topology, config, cost
        self.M, self.L, _, self.E = self.loads.shape
        self.R = topology.num_ranks
        self.K = self.E // self.R
        self.S = validate_budget(config, self.E, topology)
        self.C = self.K + self.S
        self.mps = micro_steps_per_step or self.M
        if self.mps < 1 or self.M % self.mps:
            raise ValueError(f"micro_steps_per_step={self.mps} does not divide {self.M} micro-steps")
        self.load_MLE = self.loads.sum(axis=2)
        self.history_LE = history_LE
        if history_LE is not None and np.shape(history_LE) != (self.L, self.E):
            raise ValueError(f"history_LE must have shape {(self.L, self.E)}, got {np.shape(history_LE)}")
        self.contig_LE = contiguous_owners(self.L, self.E, self.R)
        self.initial_owner_LE = (self.contig_LE if initial_owner_LE is None
                                 else check_owners(initial_owner_LE, self.L, self.E, self.R))
        self.owners_ZLE = None
        if owners_ZLE is not None:
            Z = self.M // self.mps
            if np.shape(owners_ZLE) != (Z, self.L, self.E):
                raise ValueError(f"owners_ZLE must have shape {(Z, self.L, self.E)} (one map per optimizer step), "
                                 f"got {np.shape(owners_ZLE)}")
            self.owners_ZLE = np.stack([check_owners(o, self.L, self.E, self.R) for o in owners_ZLE])
        self.resume_slots_LRC = None
        if resume_slots_LRC is not None:
            if np.shape(resume_slots_LRC) != (self.L, self.R, self.C):
                raise ValueError(f"resume_slots_LRC must have shape {(self.L, self.R, self.C)}, "
                                 f"got {np.shape(resume_slots_LRC)}")
            self.resume_slots_LRC = np.asarray(resume_slots_LRC, dtype=np.int64)

    def empty_spares(self) -> np.ndarray:
        return np.full((self.L, self.R, self.S), -1, dtype=np.int64)

    def initial_slots_LRC(self) -> np.ndarray:
        """At stage start only the EP shards exist (the owners in effect), empty spares."""
        return np.concatenate([owned_slots_LRK(self.initial_owner_LE, self.R), self.empty_spares()], axis=2)

    def plan(self, name, slots, assign, owner, transfers, plan_ms, **info) -> StagePlan:
        tr = np.concatenate(transfers) if transfers else np.zeros(0, dtype=TRANSFER_DTYPE)
        return StagePlan(name, slots, assign, owner, tr, np.asarray(plan_ms, dtype=np.float64), self.topology, info)


def _static(ctx: _Ctx, name: str) -> StagePlan:
    """Experts contiguous by rank, no replicas: what plain EP does."""
    slots = np.empty((ctx.M, ctx.L, ctx.R, ctx.C), dtype=np.int64)
    assign = np.empty((ctx.M, ctx.L, ctx.E, ctx.R), dtype=np.int64)
    plan_ms = np.zeros(ctx.M)
    owned = owned_slots_LRK(ctx.contig_LE, ctx.R)
    for m in range(ctx.M):
        t0 = time.perf_counter()
        s, tok = initial_slots(ctx.load_MLE[m], owned, ctx.empty_spares())
        slots[m] = s
        assign[m] = assign_from_slots(s, tok, ctx.E)
        plan_ms[m] = (time.perf_counter() - t0) * 1e3
    owner = np.broadcast_to(ctx.contig_LE, (ctx.M, ctx.L, ctx.E)).copy()
    return ctx.plan(name, slots, assign, owner, [], plan_ms)


def _ideal(ctx: _Ctx, name: str) -> StagePlan:
    """Lower bound: every rank gets the mean (ignores slots; not an executable plan)."""
    plan = _static(ctx, name)
    for m in range(ctx.M):
        plan.assign_MLER[m] = ideal_assign(ctx.load_MLE[m], ctx.R)
    plan.info["executable"] = False
    return plan


def _eplb(ctx: _Ctx, name: str, oracle: bool, lpt: bool = False) -> StagePlan:
    """EPLB placement once per step, from this step's loads (oracle) or the previous step's.

    ``lpt``: the ``step_lpt`` baseline (RoutePack-style, step_lpt.py) instead: owners stay the EP shard, the
    step's LPT copies fill the spare slots; copied at the step boundary, tokens split evenly over the copies."""
    slots = np.empty((ctx.M, ctx.L, ctx.R, ctx.C), dtype=np.int64)
    assign = np.empty((ctx.M, ctx.L, ctx.E, ctx.R), dtype=np.int64)
    owner = np.empty((ctx.M, ctx.L, ctx.E), dtype=np.int64)
    plan_ms = np.zeros(ctx.M)
    transfers = []
    prev = ctx.initial_slots_LRC()
    for m0 in range(0, ctx.M, ctx.mps):
        t0 = time.perf_counter()
        if oracle:
            w = ctx.load_MLE[m0 : m0 + ctx.mps].sum(axis=0)
        elif m0 > 0:
            w = ctx.load_MLE[m0 - ctx.mps : m0].sum(axis=0)
        elif ctx.history_LE is not None:
            w = np.asarray(ctx.history_LE, dtype=np.float64)
        else:
            w = np.ones((ctx.L, ctx.E))  # no history yet: plan for uniform load
        s = lpt_slots(w, ctx.R, ctx.S) if lpt else eplb_slots(w, ctx.topology, ctx.C, ctx.config.eplb_num_groups)
        if lpt:  # the owners hold the weights; the spare slots' copies are last step's
            valid_prev = prev.copy()
            if ctx.config.refresh_replicas_each_step:
                valid_prev[:, :, ctx.K :] = -1
            src = ctx.contig_LE
        else:
            valid_prev = keep_primary_copies(prev, ctx.E) if ctx.config.refresh_replicas_each_step else prev
            src = first_host_LE(valid_prev, ctx.E)
        transfers.append(schedule_transfers(valid_prev, s, src, ctx.topology, m0, ctx.cost))
        step_ms = (time.perf_counter() - t0) * 1e3
        prim = ctx.contig_LE if lpt else first_host_LE(s, ctx.E)
        for m in range(m0, m0 + ctx.mps):
            t1 = time.perf_counter()
            tok = even_split(ctx.load_MLE[m], s)
            slots[m], assign[m], owner[m] = s, assign_from_slots(s, tok, ctx.E), prim
            plan_ms[m] = (time.perf_counter() - t1) * 1e3 + (step_ms if m == m0 else 0.0)
        prev = s
    # owner_MLE is each expert's primary copy (gradients meet there); the weights stay in the contiguous layout
    return ctx.plan(name, slots, assign, owner, transfers, plan_ms, owners_are_layout=lpt)


def min_new_tokens_L(load_LE: np.ndarray, num_ranks: int, config: PlannerConfig, cost: CostModel) -> np.ndarray:
    """Smallest straggler relief that justifies a new replica (a weight transfer).

    With transfers hidden one micro-step ahead, a small fraction of the mean; when they
    cannot be hidden, at least the tokens whose compute equals an inter-node transfer.
    """
    mean = load_LE.sum(axis=1) / num_ranks
    # a slot's fixed cost (cost.slot_overhead_tokens) is charged to the receiver's load in place_replicas
    th = np.ceil(config.min_replica_gain * mean)
    if not cost.overlap_transfers:
        th = np.maximum(th, np.ceil(cost.transfer_s(True) / cost.compute_s_per_token))
    return th.astype(np.int64)


def _replicas_at(ctx: _Ctx, load_LE, owned_LRK, resident_LRS, min_new_L, c0: int, polish: int):
    """One micro-step's foremoe plan with a slot costing ``c0`` tokens: replicas, the token polishes (tokens + c0
    per slot, then with a spare slot's token weight), then the time polish on the table."""
    cfg, cost = ctx.config, ctx.cost
    s, tok = place_replicas(load_LE, owned_LRK, resident_LRS, ctx.topology, min_new_L, cfg.stay_bonus,
                            cfg.node_bonus, slot_tokens=c0)
    rebalance_split_time(s, tok, polish, c0)
    if cost.spare_token_weight != 1.0:  # then level the ranks on the runtime's cost of a spare slot's token
        rebalance_split_time(s, tok, polish, c0, cost.spare_token_weight, ctx.K)
    level_time(s, tok, polish, cost, ctx.K, cfg.polish_chain_depth)  # then on the kernels' time itself (a table)
    return s, tok


def _foremoe(ctx: _Ctx, name: str, owner_policy: str | None = None) -> StagePlan:
    """Foresight plan: owners per step, replicas per micro-step, exact token splits."""
    cfg, topo = ctx.config, ctx.topology
    policy = owner_policy or cfg.owner_policy
    slots = np.empty((ctx.M, ctx.L, ctx.R, ctx.C), dtype=np.int64)
    assign = np.empty((ctx.M, ctx.L, ctx.E, ctx.R), dtype=np.int64)
    owner_out = np.empty((ctx.M, ctx.L, ctx.E), dtype=np.int64)
    plan_ms = np.zeros(ctx.M)
    transfers = []
    resumed = ctx.resume_slots_LRC is not None  # micro-step 0 continues an optimizer step: not a boundary
    if resumed and ctx.owners_ZLE is None and policy == "balanced":  # its owners came from the whole step's loads
        raise ValueError("resume_slots_LRC with balanced owners needs the step's owners (owners_ZLE)")
    prev = ctx.resume_slots_LRC.copy() if resumed else ctx.initial_slots_LRC()
    prev_owner = ctx.initial_owner_LE
    polish = cfg.polish_iters if cfg.polish_iters is not None else 2 * ctx.R
    li = np.arange(ctx.L)[:, None, None]
    for m0 in range(0, ctx.M, ctx.mps):
        t0 = time.perf_counter()
        if ctx.owners_ZLE is not None:  # agreed for all EP groups sharing the weights (owners.step_owners_ZLE)
            owner = ctx.owners_ZLE[m0 // ctx.mps]
        elif policy == "balanced":
            step_load = ctx.load_MLE[m0 : m0 + ctx.mps].sum(axis=0)
            owner = balanced_owners(step_load, topo, prev_owner, cfg.owner_hysteresis)
        else:
            owner = ctx.contig_LE
        owned = owned_slots_LRK(owner, ctx.R)
        step_ms = (time.perf_counter() - t0) * 1e3
        for m in range(m0, m0 + ctx.mps):
            t1 = time.perf_counter()
            boundary = m == m0 and not (resumed and m == 0)
            valid_prev = prev.copy()
            if boundary and cfg.refresh_replicas_each_step:
                valid_prev[:, :, ctx.K :] = -1  # replicas hold last step's weights
            resident = valid_prev[:, :, ctx.K :]
            if boundary:  # a resident replica of an expert the rank now owns is redundant
                e = np.where(resident >= 0, resident, 0)
                mine = owner[li, e] == np.arange(ctx.R)[None, :, None]
                resident = np.where((resident >= 0) & ~mine, resident, -1)
            load_LE = ctx.load_MLE[m]
            c0 = ctx.cost.slot_overhead_tokens
            min_new = min_new_tokens_L(load_LE, ctx.R, cfg, ctx.cost)
            s, tok = _replicas_at(ctx, load_LE, owned, resident, min_new, c0, polish)
            others = sorted({int(round(c0 * x)) for x in cfg.slot_cost_starts} - {c0}) if c0 else []
            t_LR = rank_ms_LR(tok, ctx.cost, ctx.K, s)
            worse = np.flatnonzero(t_LR.max(axis=1) > t_LR.mean(axis=1) * (1.0 + cfg.slot_cost_starts_gap))
            if others and worse.size:  # the other slot costs, on the layers left above the gap only; ties go to
                # the cheaper slot cost
                w = (load_LE[worse], owned[worse], resident[worse], min_new[worse])
                by_c = {c: _replicas_at(ctx, *w, c, polish) for c in others} | {c0: (s[worse], tok[worse])}
                s[worse], tok[worse] = best_in_time([by_c[c] for c in sorted(by_c)], ctx.cost, ctx.K)
            if c0 and cfg.whole_handoffs:  # with a slot's fixed cost, also level whole experts first (a split
                # costs c0, a handoff nothing), alone and with splits after; each layer keeps the plan with the
                # lowest straggler (splits alone win where experts are large next to c0: big micro-batches)
                whole = whole_handoffs(load_LE, owned, resident, c0)
                split = place_replicas(load_LE, owned, resident, topo, min_new, cfg.stay_bonus, cfg.node_bonus,
                                       slot_tokens=c0, initial=whole)
                rebalance_split_time(*split, polish, c0)
                level_time(*split, polish, ctx.cost, ctx.K, cfg.polish_chain_depth)
                s, tok = best_in_time([(s, tok), split, whole], ctx.cost, ctx.K)
            level_passes(s, tok, ctx.cost, ctx.K)  # with pass_polish: each pass's slowest rank, once on the plan kept
            slots[m], assign[m], owner_out[m] = s, assign_from_slots(s, tok, ctx.E), owner
            # copies come from the previous micro-step's layout: last step's owners at a boundary
            src_owner = prev_owner if boundary else owner
            transfers.append(schedule_transfers(valid_prev, s, src_owner, topo, m, ctx.cost))
            plan_ms[m] = (time.perf_counter() - t1) * 1e3 + (step_ms if boundary else 0.0)
            prev = s
        prev_owner = owner
    return ctx.plan(name, slots, assign, owner_out, transfers, plan_ms, owner_policy=policy)


def _reactive(ctx: _Ctx, name: str) -> StagePlan:
    """Per-forward plan of each layer from its own counts (Megatron / LLEP style, reactive.py).

    info["plan_ms_ML"]: planning time per layer, on that layer's critical path.
    """
    slots, assign, transfers, plan_ms_ML = plan_reactive(ctx.load_MLE, ctx.topology, ctx.S, ctx.config.min_replica_gain)
    owner = np.broadcast_to(ctx.contig_LE, (ctx.M, ctx.L, ctx.E)).copy()
    return ctx.plan(name, slots, assign, owner, [transfers], plan_ms_ML.sum(axis=1),
                    plan_ms_ML=plan_ms_ML, reactive=True)


def _exact(ctx: _Ctx, name: str) -> StagePlan:
    """MoonEP-style exact quotas per node, planned per layer from its own counts (exact.py, the runtime's planner).

    Duplicates are pulled from their owners in the layer (transfers of that micro-step, never inter-node);
    info["plan_ms_ML"]: this host's time of the planner per layer (the simulator charges the device's instead).
    Spare slots are what the plan needs (``config.spare_slots`` does not bound it: exactness needs up to K)."""
    t0 = time.perf_counter()
    assign, slots = plan_exact_stage(ctx.load_MLE, ctx.R, ctx.topology.ranks_per_node)
    plan_ms_ML = np.full((ctx.M, ctx.L), (time.perf_counter() - t0) * 1e3 / (ctx.M * ctx.L))
    m, l, r, c = np.nonzero(slots[:, :, :, ctx.K:] >= 0)
    tr = np.zeros(len(m), dtype=TRANSFER_DTYPE)
    e = slots[m, l, r, ctx.K + c]
    tr["micro_step"], tr["layer"], tr["expert"], tr["src_rank"], tr["dst_rank"] = m, l, e, e // ctx.K, r
    owner = np.broadcast_to(ctx.contig_LE, (ctx.M, ctx.L, ctx.E)).copy()
    return ctx.plan(name, slots, assign, owner, [tr], plan_ms_ML.sum(axis=1), plan_ms_ML=plan_ms_ML,
                    reactive=True, exact=True)


BALANCERS: dict[str, Callable[[_Ctx, str], StagePlan]] = {
    "static": _static,
    "eplb_history": lambda ctx, name: _eplb(ctx, name, oracle=False),
    "eplb_oracle": lambda ctx, name: _eplb(ctx, name, oracle=True),
    "step_lpt": lambda ctx, name: _eplb(ctx, name, oracle=True, lpt=True),
    "reactive": _reactive,
    "exact": _exact,
    "foremoe": _foremoe,
    "foremoe_contiguous": lambda ctx, name: _foremoe(ctx, name, "contiguous"),
    "foremoe_balanced": lambda ctx, name: _foremoe(ctx, name, "balanced"),
    "ideal": _ideal,
}


def plan_stage(
    balancer: str,
    loads_MLSE: np.ndarray,
    topology: Topology,
    config: PlannerConfig | None = None,
    cost: CostModel | None = None,
    *,
    micro_steps_per_step: int | None = None,
    history_LE: np.ndarray | None = None,
    initial_owner_LE: np.ndarray | None = None,
    owners_ZLE: np.ndarray | None = None,
    resume_slots_LRC: np.ndarray | None = None,
) -> StagePlan:
    """Plan every micro-step of a stage.

    loads_MLSE: token-expert assignments [micro_steps, layers, source_ranks, experts].
    micro_steps_per_step: micro-steps per optimizer step (default: the whole stage is one step).
    history_LE: previous step's expert loads, used by eplb_history for the first step.
    initial_owner_LE: the owners in effect when the stage starts (the runtime's layout; default contiguous).
    owners_ZLE: foremoe's owners for each optimizer step, decided outside (``owners.step_owners_ZLE`` over
        the loads of every EP group sharing the weights); default: from this stage's loads and the policy.
    resume_slots_LRC: foremoe only: ``loads_MLSE``'s first micro-step continues an optimizer step whose previous
        micro-step had these slots (not a boundary: its replicas stay valid, its owners are ``owners_ZLE[0]``).
        Planning a stage's micro-steps one at a time this way, each from the last one's slots, gives exactly the
        whole stage's plan (``placement/lazy.py``: the runtime's recompute stage; ``tests/test_lazy_recompute.py``).
    """
    if balancer not in BALANCERS:
        raise ValueError(f"unknown balancer {balancer!r}; choose from {sorted(BALANCERS)}")
    if resume_slots_LRC is not None and not balancer.startswith("foremoe"):
        raise ValueError(f"resume_slots_LRC: only foremoe plans micro-step by micro-step from its slots, "
                         f"not {balancer!r}")
    ctx = _Ctx(loads_MLSE, topology, config or PlannerConfig(), cost or CostModel(), micro_steps_per_step, history_LE,
               initial_owner_LE, owners_ZLE, resume_slots_LRC)
    plan = BALANCERS[balancer](ctx, balancer)
    plan.info["micro_steps_per_step"] = ctx.mps  # replicas are refreshed from owners at these boundaries
    return plan
