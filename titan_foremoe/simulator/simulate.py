"""Simulate one RL iteration (recompute + update stages) on a cluster, per balancer.

Every EP group plans its stages with the project's planner (``planner.plan_stage``),
``timing.stage_times`` turns each plan into micro-step times, and the cluster waits for
the slowest group at every optimizer step (and at the end of the recompute stage).
The whole RL step adds the rollout on the engine fleet the config launches, the weight sync to every engine
and colocated engines' sleep and wake (``fleet.py``, ``rollout.py``; the same for every balancer); the optimizer step is HBM-bound (Adam: ~16 bytes
read + written per parameter). ``foremoe_balanced`` re-lays out owners at step boundaries
(``relayout.py``: one owner map for all groups, its moves charged by the runtime's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..planner import CostModel, PlannerConfig, Topology, plan_stage
from ..planner.metrics import max_over_mean_M, owner_summary, relayout_bytes_per_move, step_owners_of
from ..planner.owners import contiguous_owners
from ..planner.planahead import plans_lazily
from .calibration import Calibration
from .grouped_mm import (GroupedMMCost, group_ms_table, landing_prices, pass_tables, slot_tokens, spare_part_ms,
                         spare_row_ms, spare_token_weight)
from .models import ModelSpec
from .rl_step import StepBranches, rl_step_ms
from .fleet import fleet_layout, rollout_phase
from .relayout import exposed_relayout_s_Z, global_owners_ZLE, plan_by_step, relayout_s_Z
from .sequences import layout_metrics, levelled
from .timing import DeviceCosts, stage_times
from .workload import GroupWork, RLSchedule, merged_work

ALL_BALANCERS = ("off", "static", "eplb_history", "eplb_oracle", "step_lpt", "reactive", "exact", "foremoe",
                 "foremoe_balanced", "ideal")
EXACT_PLAN_US = 20.0  # the exact balancer's device planner per layer (MoonEP's one-kernel GPU planner; see _exact_plan)
# "off": the trainer's balancer "off", torchtitan's own MoE path (contiguous experts, no slots, no plan)
STAGES = ("rollout", "sleep_wake", "weight_sync", "recompute", "update", "optimizer", "relayout")


@dataclass(frozen=True)
class RolloutSpec:
    """The engine that generates the rollout (``rollout.py``): prompt tokens per response (the trace holds
    generated tokens only), GPUs per engine (0: one node), concurrent sequences per engine."""

    prompt_tokens: int = 128
    engine_gpus: int = 0
    max_batch: int = 1024  # vLLM 0.28's max_num_seqs on GPUs of >= 70 GiB (rollout.py; the KV cache may cap it)
    gpus: int = 0  # GPUs of the engines' own pool (disaggregated); 0: the trainer's GPUs (colocated)
    max_staleness: int = 0  # [rl] max_staleness: 0 synchronous, 1 one-step off-policy (rl_step.py)
    weight_sync: str = "bucketed"  # the sync's design (rollouts/engines/sync_cost.py): bucketed | current | reload
    sync_bucket_mb: int = 512  # [rollout_engine] weight_sync_bucket_mb
    decode_efficiency: float = 1.0  # the engine's decode speed end to end / the kernel tables' (rollout.py)
    sync_senders: int = 1  # sender groups: 1 vLLM's one source; > 1 [sglang_engine] weight_sync_senders
    sync_load: str = "stacked"  # the engine's load (sync_cost.engine_load_s): stacked (vllm_fused_load) | per_tensor
    engines: int = 0  # [rollout_engine] engines: 0 the layout's default (fleet.fleet_layout)
    samples_per_prompt: int = 1  # responses per request (a prompt's samples stay on one engine)
    max_tokens: int = 0  # the estimate the fleet client deals on (0: the longest response)
    sleep_level: int = 0  # [rollout_engine] sleep_level of colocated engines (rollout.sleep_wake_ms)
    fleet_sync: str = "one_group"  # the fleet's sync design (sync_cost.FLEET_DESIGNS): the runtime's one_group
    source: str = "engine"  # engine (the fleet) | embedded ([rl] rollout_source = "embedded": embedded_rollout.py)
    embedded_lockstep: str = "world"  # the embedded loop's "any row active" flag: world (what runs) | ep_group
    embedded_attention: str = "math"  # the embedded loop's SDPA kernel: math (a boolean mask) | fused


@dataclass(frozen=True)
class ClusterSpec:
    gpus: int
    gpus_per_node: int
    ep: int

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.ep < 1 or self.gpus_per_node < 1:
            raise ValueError("gpus, gpus_per_node and ep must be >= 1")
        if self.gpus % self.ep:
            raise ValueError(f"--gpus {self.gpus} is not a multiple of --ep {self.ep}")
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise ValueError(f"--gpus {self.gpus} does not fill nodes of {self.gpus_per_node}")
        if self.ep > self.gpus_per_node and self.ep % self.gpus_per_node:
            raise ValueError(f"--ep {self.ep} spans partial nodes of {self.gpus_per_node} GPUs")

    @property
    def groups(self) -> int:
        return self.gpus // self.ep

    def topology(self) -> Topology:
        """EP ranks are consecutive GPUs: a group fills whole nodes, or sits inside one."""
        return Topology.from_ranks(self.ep, min(self.ep, self.gpus_per_node))


def device_costs(cal: Calibration, a2a_gpus: int = 8, **overrides) -> DeviceCosts:
    """DeviceCosts from a calibration; keyword overrides (None = keep) for the CLI's link options.
    a2a_gpus: GPUs of one node in the EP group (picks the measured NVLink all-to-all curve; an
    --nvlink-gbps override replaces the curve by that bandwidth)."""
    links, copies = cal.links(), cal.copies()
    curves = links.get("nvlink_a2a") or {}
    n = min([int(k) for k in curves if int(k) >= a2a_gpus] or [max([int(k) for k in curves] or [8])])
    curve = curves.get(str(n)) if overrides.get("nvlink_GBps") is None else None
    kw = dict(
        nvlink_GBps=links["nvlink_GBps"], ib_GBps=links["ib_GBps"], h2d_GBps=copies["h2d_pinned_GBps"],
        a2a_latency_us=links["a2a_latency_us"], allgather_latency_us=links.get("allgather_latency_us", links["a2a_latency_us"]),
        gemm_slowdown_h2d=copies["gemm_slowdown_with_h2d"], gemm_slowdown_p2p=copies["gemm_slowdown_with_d2d"],
        dense_tflops=cal.dense_tflops, d2h_GBps=copies.get("d2h_pinned_GBps"),
        nvlink_a2a=(tuple(curve["bytes"]), tuple(curve["ms"])) if curve else None, a2a_peers=max(n, 2),
    )
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return DeviceCosts(**kw)


def _plans(b: str, loads_MLSE: np.ndarray, topo: Topology, cfg: PlannerConfig, cost: dict, mps: int,
           owners: tuple | None, rec_loads_MLSE: np.ndarray | None = None) -> dict:
    """The recompute and update plans of one group. owners: (layout in effect, owners_ZLE) for
    foremoe_balanced: the recompute keeps the layout in effect, each update step its agreed owners.
    cost: the planner's CostModel per stage ("rec", "upd"). rec_loads_MLSE: the recompute's loads where its
    micro-steps are not the update's (``[rl] recompute_merge``)."""
    rec_loads = loads_MLSE if rec_loads_MLSE is None else rec_loads_MLSE
    if b == "off":  # torchtitan's path: static's placement, timed without the slot path (simulate)
        plans = _plans("static", loads_MLSE, topo, cfg, cost, mps, None, rec_loads_MLSE)
        for p in plans.values():
            p.balancer = "off"
        return plans
    if owners is None:
        return {"rec": plan_stage(b, rec_loads, topo, cfg, cost["rec"], micro_steps_per_step=None),
                "upd": plan_stage(b, loads_MLSE, topo, cfg, cost["upd"], micro_steps_per_step=mps)}
    init_LE, owners_ZLE = owners
    rec = plan_stage("foremoe", rec_loads, topo, cfg, cost["rec"], initial_owner_LE=init_LE, owners_ZLE=init_LE[None])
    upd = plan_by_step(loads_MLSE, topo, cfg, mps, owners_ZLE, cost["upd"])
    rec.balancer = upd.balancer = b
    return {"rec": rec, "upd": upd}


# the EPLB family (planner/balancers.py ``_eplb``) plans each optimizer step at its first micro-step
STEP_PLANNED = ("eplb_history", "eplb_oracle", "step_lpt")


def update_plan_ready_s(balancer: str, rec_plan_s_M: np.ndarray, upd_plan_s_M: np.ndarray, head_s: float,
                        ahead: bool) -> float | np.ndarray:
    """When the update stage's plan is ready (s, from the end of the rollout's host wait: the recompute may start at
    0), as ``placement_plans.plan_ahead`` queues it: foremoe's recompute micro-step 0 on the training thread from
    ``-head_s``, its micro-steps 1.. then the update's micro-steps one by one in the planner's worker, each ready
    on its own (an array: ``timing.stage_times`` waits for micro-step m + 1's at m's entry, ``placement/lazy.py``);
    a balancer planned whole submits the update stage to the worker first (while the training thread plans the
    recompute) and is ready at once (a float). Asynchronous RL (``ahead``): planned while the previous step
    trained (-inf)."""
    if ahead:
        return -np.inf
    if plans_lazily(balancer):
        return float(np.sum(rec_plan_s_M)) + np.cumsum(upd_plan_s_M) - head_s
    return float(np.sum(upd_plan_s_M)) - head_s


def _exact_plan(p_rec, p_upd, plan_us: float) -> None:
    """Charge the exact balancer's device planner ``plan_us`` per layer. Default 20 us: MoonEP plans in one GPU
    kernel; our torch-op planner (``planner/exact.py``, with the row selection) dispatches 68 aten ops
    (``benchmarks/bench_exact_layer.py``), ~0.2-0.3 ms
    launch-bound in eager mode on an H100 (not measured: no GPU in this session), so the default favours exact."""
    for p in (p_rec, p_upd):
        p.info["plan_ms_ML"] = np.full_like(p.info["plan_ms_ML"], plan_us * 1e-3)
        p.plan_ms_M = p.info["plan_ms_ML"].sum(axis=1)
        p.info["replicas_per_rank"] = float(((p.slots_MLRC[..., p.assign_MLER.shape[2] // p.topology.num_ranks:]
                                              >= 0).sum(axis=3)).mean())


def planner_costs(work: list[GroupWork], curve, spare_slots: int, slot_overhead_tokens: int | str = "auto",
                  time_polish: bool = True, rec_work: list[GroupWork] | None = None) -> dict[str, CostModel]:
    """The planner's CostModel per stage ("rec", "upd"): one cost model, the planner weighs a slot, a spare
    slot's row and (with ``time_polish``) a group's time as the simulator charges them on ``curve`` (the
    recompute runs forward only, the update forward and backward), at the stage's tokens per expert and
    micro-step (``rec_work``: the recompute's, where its micro-steps are not the update's, as
    ``train/slot_cost.py`` prices them). ``slot_overhead_tokens`` an int: that slot cost and token counts (the
    trainer's default CostModel with 0)."""
    slot_tok = {"rec": slot_overhead_tokens, "upd": slot_overhead_tokens}
    stage_work = {"rec": work if rec_work is None else rec_work, "upd": work}
    per = {k: float(np.mean([w.loads_MLSE.sum(axis=2).mean() for w in ws])) for k, ws in stage_work.items()}
    if slot_overhead_tokens == "auto":  # one cost model: the planner weighs a slot as the simulator charges it,
        # per stage (the recompute runs forward only, the update forward and backward)
        auto = isinstance(curve, GroupedMMCost)
        slot_tok = {k: slot_tokens(curve, per[k], backward=k == "upd") if auto else 0 for k in slot_tok}
    spare_w = {"rec": 1.0, "upd": 1.0}
    if slot_overhead_tokens == "auto" and isinstance(curve, GroupedMMCost):  # and a spare slot's token as charged
        spare_w = {k: spare_token_weight(curve, per[k], backward=k == "upd", spare=spare_slots) for k in spare_w}
    table = {"rec": None, "upd": None}
    if slot_overhead_tokens == "auto" and isinstance(curve, GroupedMMCost) and time_polish:  # and the time itself
        table = {k: (group_ms_table(curve, per[k], backward=k == "upd"),
                     spare_row_ms(curve, backward=k == "upd", spare=spare_slots),
                     pass_tables(curve, per[k], backward=k == "upd", spare=spare_slots),
                     spare_part_ms(curve, spare_slots, backward=k == "upd", tokens_per_slot=per[k]),
                     landing_prices(curve, backward=k == "upd"))
             for k in table}
    cost = {k: CostModel(slot_overhead_tokens=int(v), spare_token_weight=spare_w[k],
                         **({} if table[k] is None else {"group_ms": table[k][0], "spare_row_ms": table[k][1],
                                                         "passes": table[k][2], "spare_part_ms": table[k][3],
                                                         **table[k][4]}))
            for k, v in slot_tok.items()}
    return cost


def simulate(
    work: list[GroupWork],
    model: ModelSpec,
    cluster: ClusterSpec,
    sched: RLSchedule,
    cal: Calibration,
    link: DeviceCosts,
    spare_slots: int,
    balancers=ALL_BALANCERS,
    hbm_GBps: float | None = None,
    reactive_plan_us: float | None = None,
    exact_plan_us: float = EXACT_PLAN_US,
    plan_repeats: int = 3,
    plan_ms_given: dict | None = None,
    owner_hysteresis: float | None = None,
    owners_in_effect_LE: np.ndarray | None = None,
    slot_overhead_tokens: int | str = "auto",
    expert_kernel: str = "grouped_mm",
    slot_path: str = "inplace",
    rollout: RolloutSpec | None = RolloutSpec(),
    whole_handoffs: bool = False,
    time_polish: bool = True,
    slot_cost_starts: tuple[float, ...] = (1.0,),
    pass_polish: bool = False,
    polish_chain_depth: int = 1,
    recompute_merge: int = 1,
) -> dict:
    """summary dict: per balancer figures, speedups of foremoe, and the setting.

    reactive_plan_us: charge the reactive balancer this planning time per layer instead of
    the measured time of our Python planner (the peers plan in C++ or on the GPU). exact_plan_us: the exact
    balancer's device planning time per layer (its host timing is not what the GPU pays).
    Planning time is measured on the first group (best of plan_repeats per micro-step, as
    bench_planner) and its median micro-step is charged to every micro-step of every group:
    single timings on a shared CPU jump 10x. plan_ms_given (a previous result's "plan_ms")
    reuses those timings, e.g. across a GPU sweep whose EP groups have the same shape.
    foremoe_balanced: owners per step decided once for all groups (relayout.py), re-layout charged by the
    runtime rule; owners_in_effect_LE: the layout before the iteration (default contiguous);
    owner_hysteresis: default PlannerConfig's. slot_overhead_tokens: the planner's CostModel field ("auto": from
    the expert model, ``grouped_mm.slot_tokens``; 0 balances token counts, as the trainer's default CostModel
    does). slot_path: how the runtime reads its slots (``grouped_mm.SLOT_PATHS``: "gather" all C slots per call,
    "inplace" owned slots in place and the spare slots gathered).
    rollout: the engine (None: the step is the trainer's stages only, as before; its ``gpus`` > 0: engines on a
    pool of their own, the cluster is then the trainer's GPUs; its ``max_staleness``: ``step_ms`` synchronous or
    one-step off-policy, ``rl_step.py``). hbm_GBps: default the calibration's. whole_handoffs: the planner's
    ``PlannerConfig.whole_handoffs`` (whole experts to spare slots before splits, when a slot has a cost).
    slot_cost_starts: the planner's ``PlannerConfig.slot_cost_starts`` (multiples of the slot cost foremoe plans from).
    pass_polish: the planner's ``PlannerConfig.pass_polish`` (the update stage's forward and backward maxima polished
    apart, on ``grouped_mm.pass_tables``, as the trainer's ``[balance] pass_polish``). polish_chain_depth: the
    planner's ``PlannerConfig.polish_chain_depth``. recompute_merge: ``[rl] recompute_merge`` (the recompute runs
    every k consecutive micro-steps of a rank as one: ``workload.merged_work``; ``ideal``'s too).
    time_polish: with "auto", foremoe's last token polish levels the ranks on the expert model's time table
    (``CostModel.group_ms``, ``planner/time_polish.py``), as the trainer's "auto" does.
    """
    topo = cluster.topology()
    curve = cal.curve(model.dim, model.moe_hidden, expert_kernel, slot_path)
    curve_off = cal.curve(model.dim, model.moe_hidden, expert_kernel, "none")  # torchtitan's path: no slots
    cfg = PlannerConfig(spare_slots=spare_slots, whole_handoffs=whole_handoffs, slot_cost_starts=tuple(slot_cost_starts),
                        pass_polish=pass_polish, polish_chain_depth=polish_chain_depth)
    rec_work = [merged_work(w, recompute_merge) for w in work]  # the recompute's micro-steps (the update's at k = 1)
    cost = planner_costs(work, curve, spare_slots, slot_overhead_tokens, time_polish, rec_work)
    hyst = cfg.owner_hysteresis if owner_hysteresis is None else owner_hysteresis
    sched.micro_steps_per_step(cluster.groups)  # the batch must split into the groups' micro-steps
    mps = len(work[0].loads_MLSE) // sched.updates_per_rollout  # the layout's (a token budget sets its own)
    U = sched.updates_per_rollout
    L, E = work[0].loads_MLSE.shape[1], work[0].loads_MLSE.shape[3]
    init_LE = contiguous_owners(L, E, cluster.ep) if owners_in_effect_LE is None else owners_in_effect_LE
    per_move = relayout_bytes_per_move(model.expert_params, cluster.groups)  # efsdp = the EP groups
    params_per_rank = E // cluster.ep * model.expert_params * model.moe_layers + model.dense_params() / cluster.gpus
    hbm_GBps = cal.hbm_GBps if hbm_GBps is None else hbm_GBps
    # dense parts from the measured GEMM rows with the kernels we run; the vLLM-kernel figures keep FLOPs
    dense_gemm = cal.gemm_table() if isinstance(curve, GroupedMMCost) else None
    opt_ms = params_per_rank * 16 / (hbm_GBps * 1e9) * 1e3
    roll = {"rollout_ms": 0.0}
    sync_ms = sleep_ms = 0.0
    phase: dict = {}
    if rollout is not None:
        layout = fleet_layout(cluster.gpus, cluster.gpus_per_node, rollout.gpus, rollout.engine_gpus, rollout.engines)
        phase = rollout_phase(model, cal, link, [w.response_lens for w in work], layout, rollout, cluster.ep,
                              hbm_GBps * 1e9)
        roll, sync_ms, sleep_ms = phase["roll"], phase["sync_ms"], phase["sleep_wake_ms"]
    # colocated engines asleep after a synchronous rollout: the trainer plans while their weights move out
    plan_head_s = phase.get("sleep", {}).get("sleep_ms", 0.0) * 1e-3 if rollout and not rollout.max_staleness else 0.0
    ahead = bool(rollout and rollout.max_staleness)  # asynchronous RL: a step planned while the previous trains
    out: dict = {}
    plan_times: dict = {}
    dense_level = levelled(work) if "ideal" in balancers else None  # the ideal levels tokens as well as experts
    rec_level = levelled(rec_work) if "ideal" in balancers else None
    for b in balancers:
        rec, upd, mom_rec, mom_upd, upd_args = [], [], [], [], []
        plan_ms: dict = dict(plan_ms_given[b]) if plan_ms_given and b in plan_ms_given else {}
        owners = None
        if b == "foremoe_balanced":
            owners = (init_LE, global_owners_ZLE([w.loads_MLSE for w in work], mps, topo, "balanced", init_LE, hyst))
        for gi, (w, rw) in enumerate(zip(work, rec_work)):
            tokens_MS, pairs_MS = dense_level[gi] if b == "ideal" else (w.tokens_MS, w.pairs_MS)
            rec_tokens_MS, rec_pairs_MS = rec_level[gi] if b == "ideal" else (rw.tokens_MS, rw.pairs_MS)
            rec_loads = None if rw is w else rw.loads_MLSE
            plans = _plans(b, w.loads_MLSE, topo, cfg, cost, mps, owners, rec_loads)
            if not plan_ms:  # time the first group's planning: best of `plan_repeats`, median micro-step
                best = {k: (p.plan_ms_M, p.info.get("plan_ms_ML")) for k, p in plans.items()}
                for _ in range(plan_repeats - 1):
                    again = _plans(b, w.loads_MLSE, topo, cfg, cost, mps, owners, rec_loads)
                    for k, (t_M, t_ML) in best.items():
                        best[k] = (np.minimum(t_M, again[k].plan_ms_M),
                                   None if t_ML is None else np.minimum(t_ML, again[k].info["plan_ms_ML"]))
                plan_ms = {k: (float(t_M[0] if b in STEP_PLANNED else np.median(t_M)),  # the step's plan, or a
                               None if t_ML is None else float(np.median(t_ML)))  # typical micro-step's
                           for k, (t_M, t_ML) in best.items()}
            p_rec, p_upd = plans["rec"], plans["upd"]
            for stage, p in plans.items():  # one timing for all groups (same shapes)
                p.plan_ms_M = np.full_like(p.plan_ms_M, plan_ms[stage][0])
                if b in STEP_PLANNED:  # one plan per optimizer step, at its first micro-step; the rest an even split
                    per = len(p.plan_ms_M) if stage == "rec" else mps
                    p.plan_ms_M[np.arange(len(p.plan_ms_M)) % per != 0] = 0.0
                if plan_ms[stage][1] is not None:
                    p.info["plan_ms_ML"] = np.full_like(p.info["plan_ms_ML"], plan_ms[stage][1])
            if b == "reactive" and reactive_plan_us is not None:
                for p in (p_rec, p_upd):
                    p.info["plan_ms_ML"] = np.full_like(p.info["plan_ms_ML"], reactive_plan_us * 1e-3)
                    p.plan_ms_M = p.info["plan_ms_ML"].sum(axis=1)
            if b == "exact":
                _exact_plan(p_rec, p_upd, exact_plan_us)
            c = curve_off if b == "off" else curve
            r = stage_times(p_rec, rw.loads_MLSE, rec_tokens_MS, rec_pairs_MS, model, c, link, backward=False,
                            micro_steps_per_step=len(rw.loads_MLSE), prev_idle_PR=None, dense_gemm=dense_gemm,
                            planned_ahead=ahead, plan_head_s=plan_head_s)
            rec.append(r)
            upd_args.append((p_rec.plan_ms_M * 1e-3, (p_upd, w.loads_MLSE, tokens_MS, pairs_MS, model, c, link)))
            mom_rec.append(max_over_mean_M(p_rec.assign_MLER))
            mom_upd.append(max_over_mean_M(p_upd.assign_MLER))
        rec_end_s = max(float(r.dur_M.sum()) for r in rec)  # every group's update starts after the slowest recompute
        for r, (rec_plan_s_M, args) in zip(rec, upd_args):
            ready = update_plan_ready_s(b, rec_plan_s_M, args[0].plan_ms_M * 1e-3, plan_head_s, ahead)
            upd.append(stage_times(*args, backward=True, micro_steps_per_step=mps, prev_idle_PR=r.a2a_busy_last_PR,
                                   dense_gemm=dense_gemm, plan_ready_s=ready - rec_end_s))
        plan_times[b] = plan_ms
        owner_ZLE = owners[1] if owners else step_owners_of(p_upd)
        rec_ms = rec_end_s * 1e3
        relayout_Z = relayout_s_Z(owner_ZLE, init_LE, topo.node_of_rank_R(), per_move, link.copy_bw_P(per_move))
        relayout_ms_Z, exposed_relayout_ms_Z = relayout_Z * 1e3, exposed_relayout_s_Z(relayout_Z, rec_ms * 1e-3) * 1e3
        upd_steps = [max(float(u.dur_M[s * mps : (s + 1) * mps].sum()) for u in upd) * 1e3 for s in range(U)]
        train_ms = rec_ms + sum(upd_steps) + U * opt_ms + float(exposed_relayout_ms_Z.sum())
        stage_ms = {"rollout": roll["rollout_ms"], "sleep_wake": sleep_ms, "weight_sync": sync_ms, "recompute": rec_ms,
                    "update": sum(upd_steps), "optimizer": U * opt_ms, "relayout": float(exposed_relayout_ms_Z.sum())}
        step = rl_step_ms(StepBranches(roll["rollout_ms"] + sleep_ms, sync_ms, train_ms),
                          rollout.max_staleness if rollout else 0, bool(rollout and rollout.gpus))
        step_ms = step["step_ms"]
        moe = np.concatenate([np.max([r.moe_M for r in rec], axis=0), np.max([u.moe_M for u in upd], axis=0)])
        exp_tr = max(float(r.exposed_transfer_M.sum() + u.exposed_transfer_M.sum()) for r, u in zip(rec, upd))
        exp_pl = max(float(r.exposed_plan_M.sum() + u.exposed_plan_M.sum()) for r, u in zip(rec, upd))
        out[b] = {
            "step_ms": step_ms,
            "train_ms": train_ms,
            "stage_ms": stage_ms,
            "stage_share": {k: v / step["step_ms_sync"] for k, v in stage_ms.items()},  # of the synchronous step
            **{k: step[k] for k in ("step_ms_sync", "step_ms_async", "overlap_ms", "longer_branch")},
            "recompute_ms": rec_ms,
            "update_ms": sum(upd_steps),
            "optimizer_ms": U * opt_ms,
            "moe_ms_per_microstep": float(moe.mean()) * 1e3,
            "moe_ms_per_microstep_recompute": float(np.max([r.moe_M for r in rec], axis=0).mean()) * 1e3,
            "moe_ms_per_microstep_update": float(np.max([u.moe_M for u in upd], axis=0).mean()) * 1e3,
            "expert_ms_straggler_update": float(np.max([u.expert_M for u in upd], axis=0).mean()) * 1e3,
            "exposed_transfer_ms": exp_tr * 1e3,
            "exposed_plan_ms": exp_pl * 1e3,
            "max_over_mean": float(np.mean(mom_upd)),
            **layout_metrics(work, level=b == "ideal"),  # dense work: tokens_max_over_mean, padding_fraction
            "plan_ms_per_microstep": plan_ms["upd"][0],
            "max_over_mean_recompute": float(np.mean(mom_rec)),
            "transfer_bytes_per_rank": float(np.mean([r.transfer_bytes_R.mean() + u.transfer_bytes_R.mean()
                                                      for r, u in zip(rec, upd)])),
            "grad_return_bytes_per_rank": float(np.mean([u.grad_bytes_R.mean() for u in upd])),
            **owner_summary(owner_ZLE, cluster.ep, model.expert_params, cluster.groups, init_LE),
            "relayout_ms_per_step": relayout_ms_Z.tolist(),
            "exposed_relayout_ms": float(exposed_relayout_ms_Z.sum()),
            # mean over groups and micro-steps of both stages; the parts add up to the mean group's MoE time
            "moe_parts_ms_per_microstep": {k: float(np.mean([np.concatenate([r.parts_M[k], u.parts_M[k]])
                                                             for r, u in zip(rec, upd)])) for k in rec[0].parts_M},
        }
    out["plan_ms"] = plan_times
    out["planner_slot_tokens"] = {k: int(c.slot_overhead_tokens) for k, c in cost.items()}
    out["planner_spare_token_weight"] = {k: c.spare_token_weight for k, c in cost.items()}
    out["planner_group_ms"] = {k: None if c.group_ms is None else {"rows": c.group_ms[0], "ms": c.group_ms[1],
                                                                    "spare_row_ms": c.spare_row_ms}
                               for k, c in cost.items()}
    if rollout is not None:
        out["rollout"] = {**vars(rollout), **roll, "weight_sync_ms": sync_ms, "sleep_wake_ms": sleep_ms,
                          "train_gpus": cluster.gpus, "fleet": phase.get("layout"),
                          "sync_detail": phase.get("sync_detail", {})}
    if "foremoe" in out:  # Amdahl: the whole step's speedup is smaller than the MoE time's
        for name, key in (("speedup_of_foremoe", "step_ms"), ("sync_speedup_of_foremoe", "step_ms_sync"),
                          ("async_speedup_of_foremoe", "step_ms_async"), ("train_speedup_of_foremoe", "train_ms"),
                          ("moe_speedup_of_foremoe", "moe_ms_per_microstep")):
            f = out["foremoe"][key]
            out[name] = {b: out[b][key] / f for b in balancers if b != "foremoe"}
    return out
