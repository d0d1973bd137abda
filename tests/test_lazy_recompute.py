"""The synchronous recompute stage planned one micro-step at a time (``placement/lazy.py``).

* the assembled plan and this rank's tables equal ``plan_stage`` / ``compile_stage`` of the whole stage, array
  for array (the oracle: the planner we already trust, run once over all micro-steps), for foremoe with
  contiguous and balanced owners, a slot cost, in the worker thread and process;
* two gloo ranks train the same (bit-identical losses and parameters) with the recompute's micro-steps 1..
  taken from the worker as with the whole stage planned before it, and the lazy path did run;
* a plan failing in one rank's worker ends the stage on both ranks with one clear error, no hang.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from distributed_helpers import run_ranks
from titan_foremoe.placement import lazy
from titan_foremoe.placement.tables import compile_stage
from titan_foremoe.planner import CostModel, PlannerConfig, Topology, plan_stage
from titan_foremoe.planner.owners import balanced_owners, contiguous_owners
from titan_foremoe.planner.planahead import StagePlanner
from titan_foremoe.planner.synthetic import synthetic_loads


def _same(a, b, where="tables") -> None:
    """Recursive equality of dataclasses / lists / arrays (exact, dtype too)."""
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    else:
        assert a == b, where


def _check(mode: str, owners: str, slot_tokens: int, rank: int = 3, first_layers: int | None = None) -> None:
    M, R = 4, 8
    loads = synthetic_loads("qwen3_30b_a3b", M, R, 2, seed=1)[:, :6]  # 6 layers: a second, not minutes
    L, E = loads.shape[1], loads.shape[3]
    topo, cfg = Topology.from_ranks(R, 4), PlannerConfig(spare_slots=1)
    cost = CostModel(slot_overhead_tokens=slot_tokens)
    kw = {}
    if owners == "balanced":  # owners decided outside (the runtime's step_owners), not the contiguous shards
        owner_LE = balanced_owners(loads.sum(axis=(0, 2)), topo, contiguous_owners(L, E, R), 0.0)
        assert not np.array_equal(owner_LE, contiguous_owners(L, E, R))
        kw = {"initial_owner_LE": contiguous_owners(L, E, R), "owners_ZLE": owner_LE[None]}
    whole = plan_stage("foremoe", loads, topo, cfg, cost, micro_steps_per_step=M, **kw)
    tables = compile_stage(whole, loads, rank, host_intra=False, host_inter=True)
    with StagePlanner(mode) as planner:
        stage = lazy.plan_lazily(planner, "foremoe", loads, topo, cfg, cost, rank, False, True, **kw,
                                 first_layers=first_layers)
        assert stage.k == (first_layers or L) and (stage.rest is None) == (first_layers is None)
        got = [stage.first if stage.rest is None else stage.take_rest()[0]] + [stage.take(m)[0] for m in range(1, M)]
    p = stage.plan
    for name in ("slots_MLRC", "assign_MLER", "owner_MLE", "transfers_T"):
        _same(getattr(p, name), getattr(whole, name), name)
    assert p.info == whole.info and p.balancer == whole.balancer and (p.plan_ms_M > 0).all()
    assert len(whole.transfers_T) and (whole.transfers_T["micro_step"] > 0).any()  # replicas move between micro-steps
    _same(got, tables)


@pytest.mark.parametrize("owners,slot_tokens,first_layers", [("contiguous", 0, None), ("balanced", 40, None),
                                                              ("contiguous", 0, 2), ("balanced", 40, 1)])
def test_micro_steps_one_at_a_time_are_the_whole_stage(owners, slot_tokens, first_layers):
    """With ``first_layers`` micro-step 0 too is planned in two parts: its first layers, then the rest."""
    _check("thread", owners, slot_tokens, first_layers=first_layers)


@pytest.mark.parametrize("mode,owners,slot_tokens", [("thread", "contiguous", 0), ("thread", "balanced", 40),
                                                     ("process", "balanced", 40)])
def test_a_stage_of_several_optimizer_steps_planned_in_the_worker_is_the_whole_stage(mode, owners, slot_tokens):
    """The update stage: micro-step 0 in the worker too, two optimizer steps of two micro-steps, each step's first
    micro-step a boundary (fresh replicas from the step's owners, stale tables), each step its own owners."""
    M, R, mps = 4, 8, 2
    loads = synthetic_loads("qwen3_30b_a3b", M, R, 2, seed=2)[:, :6]
    L, E = loads.shape[1], loads.shape[3]
    topo, cfg, cost = Topology.from_ranks(R, 4), PlannerConfig(spare_slots=1), CostModel(slot_overhead_tokens=slot_tokens)
    kw = {}
    if owners == "balanced":
        now = contiguous_owners(L, E, R)
        z0 = balanced_owners(loads[:2].sum(axis=(0, 2)), topo, now, 0.0)
        z1 = balanced_owners(loads[2:].sum(axis=(0, 2)), topo, z0, 0.0)
        assert not np.array_equal(z0, z1)
        kw = {"initial_owner_LE": now, "owners_ZLE": np.stack([z0, z1])}
    whole = plan_stage("foremoe", loads, topo, cfg, cost, micro_steps_per_step=mps, **kw)
    tables = compile_stage(whole, loads, 5, host_intra=True, host_inter=False)
    with StagePlanner(mode) as planner:
        stage = lazy.plan_lazily(planner, "foremoe", loads, topo, cfg, cost, 5, True, False, **kw,
                                 micro_steps_per_step=mps, first_in_worker=True)
        assert stage.first is None and stage.rest is None and sorted(stage.pending) == list(range(M))
        got = [stage.take(m)[0] for m in range(M)]
    p = stage.plan
    for name in ("slots_MLRC", "assign_MLER", "owner_MLE", "transfers_T"):
        _same(getattr(p, name), getattr(whole, name), name)
    assert p.info == whole.info and p.balancer == whole.balancer and (p.plan_ms_M > 0).all()
    assert (whole.transfers_T["micro_step"] == 2).any()  # the second step's replicas move at its boundary
    _same(got, tables)


def test_micro_steps_one_at_a_time_in_the_worker_process():
    _check("process", "contiguous", 40, first_layers=2)


def test_a_failed_micro_step_fails_the_rest_of_the_chain():
    """The worker's error comes back as one line, and micro-steps after it refuse to plan from nothing."""
    M, R = 3, 4
    loads = synthetic_loads("qwen3_30b_a3b", M, R, 2, seed=2)[:, :2]
    with StagePlanner("thread") as planner:
        stage = lazy.plan_lazily(planner, "foremoe", loads, Topology.from_ranks(R, 4), PlannerConfig(), CostModel(),
                                 0, False, False)
        stage.pending[1] = planner.call(lazy._plan_micro, "no-chain", 1, None, None, None, False)  # fails
        stage.pending[2] = planner.call(lazy._plan_micro, "no-chain", 2, None, None, None, True)
        tables, problem = stage.take(1)
        assert tables is None and problem.startswith("micro-step 1's plan failed in the planner's worker: ")
        assert "micro-step 1's plan failed before it" in stage.take(2)[1]


def _train(rank, world_size, tmp, out_path, fail_rank):
    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.placement import lazy as lazy_mod
    from titan_foremoe.train import placement_plans
    from titan_foremoe.train.rl_trainer import RLTrainer

    from titan_foremoe.planner.planahead import plans_lazily

    results = {}
    runs = ("lazy", "whole") if fail_rank is None else ("fail",)
    for run in runs:
        placement_plans.plans_lazily = (lambda name: False) if run == "whole" else plans_lazily
        if run == "fail" and rank == fail_rank:  # this rank's worker fails on micro-step 2 of the first stage
            real = lazy_mod._plan_micro

            def failing(chain, m, *args):
                if m == 2:
                    raise MemoryError("planner ran out of memory")
                return real(chain, m, *args)
            lazy_mod._plan_micro = failing
        cfg = load_config("train_configs/debug_tiny_rl.toml", [
            f"--job.dump_folder={tmp}/{run}", "--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0",
            "--training.steps=2", "--parallelism.expert_parallel_degree=2", "--training.global_batch_size=32",
            "--balance.balancer=foremoe", "--balance.spare_slots=1",
        ])
        trainer = RLTrainer(cfg)
        try:
            summary = trainer.train()
        except Exception as e:  # noqa: BLE001 - the test compares the error on every rank
            results[run] = {"error": f"{type(e).__name__}: {e}"}
        else:
            params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                      for n, p in trainer.model.named_parameters()}
            results[run] = {"loss": summary["loss"], "params": params,
                            "lazy_taken": trainer.placement.runtime.lazy_taken}
        trainer.close()
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()


def test_two_ranks_train_the_same_with_lazily_planned_micro_steps(tmp_path):
    out = tmp_path / "out.pt"
    run_ranks(_train, 2, str(tmp_path), str(out), None)
    for rank in range(2):
        res = torch.load(f"{out}.{rank}")
        lz, wh = res["lazy"], res["whole"]
        assert "error" not in lz and "error" not in wh, (lz.get("error"), wh.get("error"))
        # both stages lazily planned (micro-steps 1.. of the recompute, every micro-step of the update)
        assert lz["lazy_taken"].get("recompute", 0) > 0 and lz["lazy_taken"].get("update", 0) > 0, lz["lazy_taken"]
        assert not wh["lazy_taken"]
        assert lz["loss"] == wh["loss"]
        for name, p in wh["params"].items():
            assert torch.equal(p, lz["params"][name]), name


def test_a_worker_failure_is_one_error_on_every_rank(tmp_path):
    out = tmp_path / "out.pt"
    run_ranks(_train, 2, str(tmp_path), str(out), 1)
    errors = [torch.load(f"{out}.{rank}")["fail"]["error"] for rank in range(2)]
    assert errors[0] == errors[1], errors
    assert "recompute stage (foremoe): rank 1: micro-step 2's plan failed in the planner's worker: MemoryError: " \
           "planner ran out of memory" in errors[0]


def test_simulator_charges_what_the_synchronous_recompute_runs():
    """The recompute stage (``prev_idle_PR=None``): foremoe's first plan exposed, micro-step m >= 1's by what it
    exceeds m - 1, its moves charged inside m (issued at its entry); a balancer planned whole (EPLB) pays every
    micro-step's plan before the stage and moves its replicas behind the micro-step before."""
    from titan_foremoe.simulator.calibration import load_calibration
    from titan_foremoe.simulator.models import get_model
    from titan_foremoe.simulator.simulate import device_costs
    from titan_foremoe.simulator.timing import stage_times

    model = get_model("gpt_oss_20b")
    M, R = 3, 8
    loads = synthetic_loads("qwen3_30b_a3b", M, R, 4, seed=3)[:, :model.moe_layers, :, :32]
    plan = plan_stage("foremoe", loads, Topology.from_ranks(R, 4), PlannerConfig(spare_slots=1), micro_steps_per_step=M)
    plan.transfers_T = plan.transfers_T[plan.transfers_T["micro_step"] == 2]  # moves into micro-step 2 only
    assert len(plan.transfers_T)
    plan.plan_ms_M = np.array([2.0, 50_000.0, 0.0])
    cal = load_calibration("h100")
    link = dataclasses.replace(device_costs(cal, R), nvlink_GBps=0.05, ib_GBps=0.05, h2d_GBps=0.05,
                               transfer_path="direct")  # moves far slower than compute
    tokens, pairs = loads.sum(axis=(1, 3)) / 4.0, np.full((M, R), 1e4)

    def times(p, ahead=False):
        return stage_times(p, loads, tokens, pairs, model, cal.curve(model.dim, model.moe_hidden), link,
                           backward=False, micro_steps_per_step=M, prev_idle_PR=None, planned_ahead=ahead)

    lz = times(plan)
    assert lz.exposed_plan_M[0] == pytest.approx(2e-3)
    assert 0 < 50.0 - lz.exposed_plan_M[1] < lz.dur_M[0] and lz.exposed_plan_M[2] == 0
    assert lz.exposed_transfer_M[1] == 0 < lz.exposed_transfer_M[2]
    whole = times(dataclasses.replace(plan, balancer="eplb_oracle"))
    assert whole.exposed_plan_M == pytest.approx([50.002, 0.0, 0.0])
    assert whole.exposed_transfer_M[1] > 0 == whole.exposed_transfer_M[2]
    # asynchronous RL plans the whole stage in the worker while the previous step trains: nothing exposed, the moves
    # behind the micro-step before (as every balancer planned whole)
    ahead = times(plan, ahead=True)
    assert (ahead.exposed_plan_M == 0).all()
    assert ahead.exposed_transfer_M[1] == whole.exposed_transfer_M[1] and ahead.exposed_transfer_M[2] == 0


def test_simulator_waits_for_plans_as_the_planners_queue_runs_them():
    """The synchronous step's planning as ``StagePlacement.plan_ahead`` queues it: foremoe's recompute micro-step 0
    on the training thread, its micro-steps 1.. one after another in the worker (each waited at its entry), then the
    update's micro-steps, micro-step m + 1's waited at m's entry (a balancer planned whole: the whole update stage,
    waited at its start; ``update_plan_ready_s``); a head start (colocated engines falling asleep) runs that queue
    before the stage. Hand-worked timelines."""
    from titan_foremoe.simulator.simulate import update_plan_ready_s
    from titan_foremoe.simulator.timing import _ahead_waits, _lazy_waits

    plans, durs = np.array([2.0, 10.0, 1.0]), np.array([5.0, 3.0, 4.0])
    # ready 2, 12, 13; micro-step 0 waits 2 (ends 7), 1 waits 5 (ends 15), 2 is ready
    assert _lazy_waits(plans, durs).tolist() == [2.0, 5.0, 0.0]
    # 4 before the stage: ready -2, 8, 9; 0 ends 5, 1 waits 3 (ends 11), 2 ready
    assert _lazy_waits(plans, durs, head_s=4.0).tolist() == [0.0, 3.0, 0.0]
    assert _lazy_waits(plans, durs, head_s=20.0).tolist() == [0.0, 0.0, 0.0]
    upd = np.array([3.0, 3.0])
    assert update_plan_ready_s("foremoe", plans, upd, 4.0, ahead=False).tolist() == [13.0 + 3.0 - 4.0, 13.0 + 6.0 - 4.0]
    assert update_plan_ready_s("eplb_oracle", plans, upd, 4.0, ahead=False) == 6.0 - 4.0  # submitted first
    assert update_plan_ready_s("foremoe", plans, upd, 0.0, ahead=True) == -np.inf
    # the update stage (``prev_idle_PR`` given) waits for its whole plan at micro-step 0 only, and not when ready
    from titan_foremoe.simulator.calibration import load_calibration
    from titan_foremoe.simulator.models import get_model
    from titan_foremoe.simulator.simulate import device_costs
    from titan_foremoe.simulator.timing import stage_times

    model, M, R = get_model("gpt_oss_20b"), 3, 8
    loads = synthetic_loads("qwen3_30b_a3b", M, R, 4, seed=3)[:, :model.moe_layers, :, :32]
    plan = plan_stage("foremoe", loads, Topology.from_ranks(R, 4), PlannerConfig(spare_slots=1), micro_steps_per_step=M)
    plan.plan_ms_M = np.array([40.0, 40.0, 40.0])
    cal = load_calibration("h100")
    link = device_costs(cal, R)

    def update(**kw):
        return stage_times(plan, loads, loads.sum(axis=(1, 3)) / 4.0, np.full((M, R), 1e4), model,
                           cal.curve(model.dim, model.moe_hidden), link, backward=True, micro_steps_per_step=M,
                           prev_idle_PR=np.zeros((3, R)), **kw)

    late, ready, base = update(plan_ready_s=0.05), update(plan_ready_s=-1.0), update()
    assert late.exposed_plan_M.tolist() == [0.05, 0.0, 0.0] and (ready.exposed_plan_M == 0).all()
    assert late.dur_M.sum() == pytest.approx(ready.dur_M.sum() + 0.05) and ready.dur_M.sum() == base.dur_M.sum()
    # micro-step by micro-step: 0 takes plans 0 and 1 at its entry, m takes m + 1's at its own
    d = base.dur_M
    assert _ahead_waits(np.array([1.0, 2.0, 3.0]), np.array([5.0, 5.0, 5.0])).tolist() == [2.0, 0.0, 0.0]
    assert _ahead_waits(np.array([0.0, 0.0, 9.0]), np.array([5.0, 1.0, 1.0])).tolist() == [0.0, 4.0, 0.0]
    lazy = update(plan_ready_s=np.array([0.0, 0.02, d[0] + 0.07]))
    assert lazy.exposed_plan_M == pytest.approx([0.02, 0.05, 0.0])
    assert lazy.dur_M.sum() == pytest.approx(base.dur_M.sum() + 0.07)
    assert (update(plan_ready_s=np.array([-1.0, -1.0, -1.0])).dur_M == base.dur_M).all()  # ready: nothing waits
