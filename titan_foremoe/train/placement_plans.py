"""The RL step's placement: the runtime, the owners of each optimizer step, and the stage plans.

Per RL step, once the rollout's loads are known (``foresight``):

1. owners: with ``[balance] owner_policy = "balanced"`` the owners of each update step come from that
   step's load summed over *all* EP groups (one all-reduce of L x E per step: 48 x 128 x 8 B = 49 KB for
   Qwen3-30B-A3B), so every group sharing the FSDP-sharded experts agrees on one layout;
2. the recompute stage is planned now, on the owners in effect (foremoe: only its first micro-step, the rest queued
   in the planner's worker and taken by the runtime at each micro-step, ``placement/lazy.py``); the update stage
   in the planner's worker after them (``[balance] planner``: a thread, or a process; with this rank's tables), on
   the new owners (foremoe, synchronously: micro-step by micro-step too, the runtime taking micro-step m + 1 at m's
   entry instead of the whole stage at its start); foremoe weighs a slot with each stage's calibrated cost
   (``slot_cost.py``, ``[balance] slot_overhead_tokens``);
3. the move to the first update step's owners is issued now and applied when the update stage starts:
   it travels during the recompute stage (``ExpertLayout.start``). Later steps' moves happen right after
   their optimizer step, exposed (``PlacementRuntime._ensure_layout``).

Legend: M micro-steps, Z optimizer steps of a stage, L layers, S source ranks, E experts.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from ..config.job_config import JobConfig
from ..distributed import collectives
from ..placement.exact import ExactRuntime
from ..placement.lazy import LazyStage, plan_lazily
from ..placement.reactive import ReactiveRuntime
from ..placement.relayout import ExpertLayout, replica_group
from ..placement.runtime import PlacementRuntime
from ..placement.tables import compile_stage
from ..planner.balancers import plan_stage
from ..planner.owners import step_loads_ZLE, step_owners_ZLE
from ..planner.planahead import StagePlanner, plans_lazily
from ..planner.types import CostModel, PlannerConfig, Topology
from ..transfer.groups import twin_group
from .slot_cost import SlotCost


def optimizer_states(optimizers):
    """``states_of(param)`` for ``ExpertLayout``: the param's optimizer-state tensors (AdamW's moments)."""
    def states_of(p: torch.Tensor) -> list[torch.Tensor]:
        return [v for opt in optimizers for v in opt.state.get(p, {}).values()]
    return states_of


@dataclass(frozen=True)
class PlanTables:
    """``then`` of the planner: (plan, this rank's tables), as ``PlacementRuntime.compile`` makes them; a
    picklable object, so that it runs in the planner's worker process too (``[balance] planner``)."""

    loads_MLSE: np.ndarray
    rank: int
    host_intra: bool
    host_inter: bool

    def __call__(self, plan):
        return plan, compile_stage(plan, self.loads_MLSE, self.rank, host_intra=self.host_intra,
                                   host_inter=self.host_inter)


def _done(value) -> Future:
    f = Future()
    f.set_result(value)
    return f


def _when(f: Future, value) -> Future:
    """A future of ``value``, done when ``f`` is (failed or not: a lazily planned stage reports its micro-steps'
    failures itself, ``LazyStage.take``)."""
    out = Future()
    f.add_done_callback(lambda _: out.set_result(value))
    return out


class PlannedStep:
    """A step's stage plans, made (or being made) before it starts; ``lead_s``: how long before a time they were
    ready (negative: that long after)."""

    def __init__(self, loads_MLSE: np.ndarray, recompute: Future, update: Future, first_owner_LE,
                 slot_tokens: dict[str, int] | None = None, rec_loads_MLSE: np.ndarray | None = None):
        self.loads_MLSE, self.recompute, self.update, self.first_owner_LE = loads_MLSE, recompute, update, first_owner_LE
        self.rec_loads_MLSE = loads_MLSE if rec_loads_MLSE is None else rec_loads_MLSE  # the recompute's micro-steps
        self.slot_tokens = slot_tokens or {}  # foremoe: the slot cost each stage was planned with
        self._ready: list[float] = []
        for f in (recompute, update):
            f.add_done_callback(lambda _: self._ready.append(time.perf_counter()))

    def lead_s(self, start: float) -> float:
        """Seconds between both plans being ready and ``start`` (after both were waited for)."""
        self.recompute.result(), self.update.result()
        while len(self._ready) < 2:  # the callbacks run right after a future completes
            time.sleep(1e-4)
        return start - max(self._ready)


class StagePlacement:
    """Builds the runtime of ``[balance]`` and plans each RL step's recompute and update stages."""

    def __init__(self, cfg: JobConfig, model: torch.nn.Module, optimizers, ep: int, ep_rank: int, ep_group,
                 host_group, weights_dtype: torch.dtype, ranks_per_node: int):
        b = cfg.balance
        self.cfg = cfg
        self.topology = Topology.from_ranks(ep, ranks_per_node)  # resolved: validate.ep_ranks_per_node
        self.planner_config = PlannerConfig(spare_slots=b.spare_slots, owner_policy=b.owner_policy,
                                            owner_hysteresis=b.owner_hysteresis, pass_polish=b.pass_polish,
                                            slot_cost_starts=tuple(float(x) for x in b.slot_cost_starts),
                                            polish_chain_depth=b.polish_chain_depth)
        experts = next(p for n, p in model.named_parameters() if n.endswith("w1_EFD"))
        # the planner's slot cost (only foremoe weighs one): per stage and step with "auto", from the expert shape
        # [E, F, D] (a DTensor's shape is the global one) and the calibration, loaded here once per job
        self.slot_cost = (SlotCost(b.slot_overhead_tokens, b.slot_cost_device, experts.shape[2], experts.shape[1],
                                   b.spare_slots)
                          if b.balancer == "foremoe" else None)
        # the layout exists for every balancer (contiguous unless balanced); only balanced owners move experts,
        # over their own group (created collectively: the policy is the same on every rank)
        moves = b.owner_policy == "balanced" and hasattr(experts, "device_mesh")
        self.layout = ExpertLayout(model, ep, replica_group(experts) if moves else None, optimizer_states(optimizers))
        # two communicators over the EP ranks besides the EP group's own: prefetches, and gradient returns (so a
        # layer's return never queues behind the next micro-step's 48 prefetches); created in this order on every rank
        prefetch_group, grad_group = twin_group(ep_group), twin_group(ep_group)
        common = dict(path=b.transfer_path, cost=CostModel(), host_group=host_group, weights_dtype=weights_dtype,
                      grad_group=grad_group, window=b.prefetch_window_layers)
        if b.balancer == "exact":  # plans each layer on the device inside its forward (placement/exact.py)
            self.runtime: PlacementRuntime = ExactRuntime(
                model, prefetch_group, ep_rank, ep, self.topology.node_of_rank_R(), **common,
                ranks_per_node=self.topology.ranks_per_node)
        elif b.balancer == "reactive":
            self.runtime = ReactiveRuntime(
                model, prefetch_group, ep_rank, ep, self.topology.node_of_rank_R(), **common,
                topology=self.topology, config=self.planner_config, count_group=ep_group)
        else:
            self.runtime = PlacementRuntime(model, prefetch_group, ep_rank, ep, self.topology.node_of_rank_R(),
                                            **common, layout=self.layout)
        self.stage_planner = StagePlanner(b.planner)

    @property
    def balanced(self) -> bool:
        return self.cfg.balance.owner_policy == "balanced"

    def step_owners(self, loads_MLSE: np.ndarray, micro_steps_per_step: int) -> np.ndarray:
        """Owners of each update step ``[Z, L, E]``, identical on every rank (loads of all EP groups)."""
        step_ZLE = torch.as_tensor(step_loads_ZLE(loads_MLSE, micro_steps_per_step), dtype=torch.float64)
        collectives.all_reduce(step_ZLE)  # each group's loads counted once per EP rank: a common scale
        return step_owners_ZLE(step_ZLE.numpy(), self.topology, "balanced", self.layout.owner_LE,
                               self.planner_config.owner_hysteresis)

    def plan_stages(self, loads_MLSE: np.ndarray, micro_steps_per_step: int, history_LE=None):
        """((recompute plan, loads), future of (update plan, this rank's tables)); starts the first move."""
        return self.begin(self.plan_ahead(loads_MLSE, micro_steps_per_step, history_LE))

    def plan_ahead(self, loads_MLSE: np.ndarray, micro_steps_per_step: int, history_LE=None,
                   recompute_in_worker: bool = False, rec_loads_MLSE: np.ndarray | None = None) -> PlannedStep:
        """Collective (balanced owners: one all-reduce): a step's plans, started; nothing moves until ``begin``.

        The update stage is planned in the worker; the recompute stage here, or with ``recompute_in_worker``
        (asynchronous RL: the step is planned before it starts) in the worker too, first. Synchronously, foremoe
        plans only the recompute's first micro-step here and queues the others in the worker, then the update
        stage's micro-steps one by one (``placement/lazy.py``): 1 micro-step's planning on the training thread
        instead of M, and the update waits for one micro-step's plan at a time, not for its whole plan. The owners
        in effect are the layout's now: planned ahead, that is after the previous step's last optimizer step.
        ``rec_loads_MLSE``: the recompute stage's loads where its micro-steps are not the update's (``[rl]
        recompute_merge``)."""
        name = self.cfg.balance.balancer
        rec_loads = loads_MLSE if rec_loads_MLSE is None else rec_loads_MLSE
        if name in ("reactive", "exact"):  # plans each layer inside its forward (placement/): nothing ahead
            return PlannedStep(loads_MLSE, _done(None), _done((None, None)), None, rec_loads_MLSE=rec_loads)
        kw = {"history_LE": history_LE} if name == "eplb_history" else {}  # none at the first step: uniform
        rec_kw = upd_kw = {}
        if self.balanced:
            now = self.layout.owner_LE
            owners_ZLE = self.step_owners(loads_MLSE, micro_steps_per_step)
            rec_kw = {"initial_owner_LE": now, "owners_ZLE": now[None]}
            upd_kw = {"initial_owner_LE": now, "owners_ZLE": owners_ZLE}
        cost, slot_tokens = self.stage_costs(loads_MLSE, rec_loads)
        rec_args = (name, rec_loads, self.topology, self.planner_config, cost["recompute"])
        lanes = self.runtime.engine.host_lanes()
        recompute = None
        if recompute_in_worker:
            recompute = self.stage_planner.submit(*rec_args, micro_steps_per_step=rec_loads.shape[0], **kw, **rec_kw)
        elif plans_lazily(name):  # micro-step 0 now, the rest queued in the worker ahead of the update stage
            recompute = _done(plan_lazily(self.stage_planner, *rec_args, self.runtime.rank, *lanes, **rec_kw))
        rec_kw = dict(micro_steps_per_step=rec_loads.shape[0], **kw, **rec_kw)
        if not recompute_in_worker and plans_lazily(name):  # the update too, micro-step by micro-step, queued
            # after the recompute's: the runtime takes micro-step m + 1 at m's entry, not the whole stage at its start
            stage = plan_lazily(self.stage_planner, name, loads_MLSE, self.topology, self.planner_config,
                                cost["update"], self.runtime.rank, *lanes, micro_steps_per_step=micro_steps_per_step,
                                first_in_worker=True, **upd_kw)
            update = _when(stage.pending[0], (stage.plan, stage))
        else:
            tables = PlanTables(loads_MLSE, self.runtime.rank, *lanes)
            update = self.stage_planner.submit(  # plan and this rank's tables, both in the planner's worker
                name, loads_MLSE, self.topology, self.planner_config, cost["update"],
                micro_steps_per_step=micro_steps_per_step, then=tables, **kw, **upd_kw,
            )
        if recompute is None:
            recompute = _done(plan_stage(*rec_args, **rec_kw))
        return PlannedStep(loads_MLSE, recompute, update, upd_kw["owners_ZLE"][0] if self.balanced else None,
                           slot_tokens, rec_loads)

    def stage_costs(self, loads_MLSE: np.ndarray, rec_loads_MLSE: np.ndarray | None = None
                    ) -> tuple[dict[str, CostModel], dict[str, int]]:
        """(the planner's ``CostModel`` per stage, foremoe's slot tokens per stage; {} for the other balancers).

        The same on every rank of the EP group without a collective: it depends on ``loads_MLSE`` alone, which is
        every source rank's loads all-gathered over the EP group (``RLTrainer.foresight``'s
        ``gather_source_loads``), so each rank of the group holds the same array (the plans must agree too)."""
        if self.slot_cost is None:
            return dict.fromkeys(("recompute", "update"), CostModel()), {}
        return self.slot_cost.cost_models(loads_MLSE, rec_loads_MLSE)

    def begin(self, planned: PlannedStep):
        """A step starts on its plans: ((recompute plan, loads), future of (update plan, tables)); starts the
        move to the update stage's first owners (it travels while the recompute stage runs)."""
        if planned.first_owner_LE is not None:
            self.layout.start(planned.first_owner_LE)
        rec = planned.recompute.result()
        if isinstance(rec, LazyStage):  # the runtime takes micro-steps 1.. at their entry
            return (rec.plan, planned.rec_loads_MLSE, rec), planned.update
        return (rec, planned.rec_loads_MLSE), planned.update

    def relayout_metrics(self) -> dict[str, float]:
        """This RL step's re-layouts (``relayout/*``): the slowest rank's bytes and exposed time."""
        s = self.layout.take_stats()
        worst = torch.tensor([float(s.bytes_sent), s.exposed_s])
        collectives.all_reduce(worst, collectives.ReduceOp.MAX)
        return {"relayout/experts_moved": float(s.experts_moved), "relayout/bytes_sent_max": float(worst[0]),
                "relayout/exposed_s_max": float(worst[1]), "relayout/relayouts": float(s.relayouts)}

    def close(self) -> None:
        self.stage_planner.close()
