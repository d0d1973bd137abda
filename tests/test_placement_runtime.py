"""Run-time placement changes where experts run, not what is computed.

Three RL steps on 4 gloo ranks with EP=4 and one spare slot per rank, with
``balancer = static``, ``foremoe`` (replicas, token splits, transfers one
micro-step ahead, replica gradients returned to owners), ``eplb_oracle`` and
``reactive`` (each layer planned and its replicas moved inside its forward):
the same losses and final parameters (fp32, relative difference <= 1e-5), every
rank processes exactly the rows the plan gave it, and foremoe's and reactive's
measured max/mean rank load is lower than static's.
"""

from __future__ import annotations

import torch

from distributed_helpers import run_ranks


def _three_steps(rank, world_size, tmp, out_path):
    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer

    results = {}
    for run in ("static", "foremoe", "eplb_oracle", "reactive", "foremoe_pass_polish"):
        balancer = run.removesuffix("_pass_polish")  # foremoe with the levers ([balance] pass_polish, slot_cost_starts,
        # polish_chain_depth): other splits, same losses
        cfg = load_config("train_configs/debug_tiny_rl.toml", [
            f"--job.dump_folder={tmp}/{run}", "--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0",
            "--training.steps=3", f"--balance.balancer={balancer}", "--balance.spare_slots=1",
            f"--balance.pass_polish={str(run != balancer).lower()}",
            # and the other levers of docs/simulator.md: three slot-cost starts, a polish chain of 3 ranks
            f"--balance.slot_cost_starts={'0.5,1,2' if run != balancer else '1'}",
            f"--balance.polish_chain_depth={3 if run != balancer else 1}",
            # foremoe: next micro-step's transfers of at most 1 layer in flight (4 layers: 4 without a window)
            f"--balance.prefetch_window_layers={1 if balancer == 'foremoe' else 0}",
            # the foreseen loads on disk: the oracle of foremoe's slot cost (the default "auto")
            f"--rl.save_loads={str(run == 'foremoe').lower()}",
        ])
        trainer = RLTrainer(cfg)
        summary = trainer.train()
        summary["max_layers_in_flight"] = trainer.placement.runtime.engine.max_layers_in_flight
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in trainer.model.named_parameters()}
        results[run] = {"summary": summary, "params": params}
        if run == "foremoe" and rank == 0:
            results[run]["loads"] = [torch.load(f"{tmp}/{run}/loads/step_{s:05d}.pt")["loads_MLSE"]
                                          for s in range(3)]
        trainer.close()
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


def test_foremoe_matches_static_and_follows_its_plan(tmp_path):
    out_path = tmp_path / "out.pt"
    run_ranks(_three_steps, 4, str(tmp_path), str(out_path))
    res = torch.load(out_path)
    static, foremoe = res["static"]["summary"], res["foremoe"]["summary"]
    assert len(static["loss"]) == len(foremoe["loss"]) == 3
    for a, b in zip(static["loss"], foremoe["loss"]):
        assert abs(a - b) <= 1e-5 * max(abs(a), 1e-3)
    assert static["rl/reward_mean"] == foremoe["rl/reward_mean"]
    for other in ("foremoe", "eplb_oracle", "reactive", "foremoe_pass_polish"):  # EPLB keeps copies off their owners: stale after a step
        for a, b in zip(static["loss"], res[other]["summary"]["loss"]):
            assert abs(a - b) <= 1e-5 * max(abs(a), 1e-3), other
        for name, p in res["static"]["params"].items():
            q = res[other]["params"][name]
            assert ((p - q).norm() / p.norm()).item() <= 1e-5, (other, name)
    # every rank processed exactly the rows its plan assigned, in every micro-step
    assert foremoe["placement/step_rows_off_plan"] == [0.0] * 3 and static["placement/step_rows_off_plan"] == [0.0] * 3
    assert res["foremoe_pass_polish"]["summary"]["placement/step_rows_off_plan"] == [0.0] * 3
    # measured, not restated: rows delivered by the all-to-alls add up to the routed pairs, and the expert
    # compute of every layer was timed on every rank
    for other in ("static", "foremoe", "eplb_oracle", "reactive"):
        summary = res[other]["summary"]
        assert summary["placement/step_rows_minus_routed"] == [0.0] * 3, other
        assert min(summary["placement/step_expert_ms_max"]) > 0, other
        assert min(summary["placement/step_expert_ms_max_over_mean"]) >= 1.0, other
    assert min(foremoe["placement/step_replicas"]) > 0 and max(static["placement/step_replicas"]) == 0
    # window 1: one layer of the next micro-step plus the current one's last (unbounded: all 4 layers)
    assert foremoe["max_layers_in_flight"] <= 2 < static["max_layers_in_flight"]
    assert sum(foremoe["transfer/step_moves"]) > 0
    measured_static = sum(static["balance/step_mean_max_over_mean"]) / 3
    measured_foremoe = sum(foremoe["balance/step_mean_max_over_mean"]) / 3
    assert measured_foremoe < measured_static
    assert foremoe["balance/step_mean_max_over_mean"] == foremoe["placement/step_planned_max_over_mean"]
    # reactive: each layer planned in its own forward from the all-gathered counts, replicas moved there
    reactive = res["reactive"]["summary"]
    assert reactive["placement/step_rows_off_plan"] == [0.0] * 3
    assert sum(reactive["transfer/step_moves"]) > 0 and min(reactive["placement/step_replicas"]) > 0
    assert min(reactive["placement/step_plan_ms"]) > 0  # measured in the forwards: all-gather, plan, compile
    assert all(0 < g <= p for g, p in zip(reactive["placement/step_count_gather_ms"], reactive["placement/step_plan_ms"]))
    assert sum(reactive["balance/step_mean_max_over_mean"]) / 3 < measured_static
    # foremoe planned each stage with the simulator's calibrated slot cost of that step's loads ("auto", h100)
    from titan_foremoe.simulator.calibration import load_calibration
    from titan_foremoe.simulator.grouped_mm import slot_tokens

    E, F, D = next(p for n, p in res["foremoe"]["params"].items() if n.endswith("w1_EFD")).shape
    curve = load_calibration("h100").curve(D, F)
    for stage, backward in (("recompute", False), ("update", True)):
        want = [float(slot_tokens(curve, float(l.double().sum(2).mean()), backward=backward))
                for l in res["foremoe"]["loads"]]
        assert foremoe[f"foresight/slot_overhead_tokens_{stage}"] == want, stage
    assert "foresight/slot_overhead_tokens_update" not in static  # only foremoe weighs a slot
