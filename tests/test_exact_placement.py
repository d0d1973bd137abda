"""The ``exact`` balancer (``placement/exact.py``) trains as ``off`` does: two RL steps on 4 gloo ranks, EP 4
in one node, the same losses and final parameters as ``static`` (fp32, relative difference <= 1e-5), every rank
computing exactly its quota of the group's rows in every layer (measured rows), duplicates made where the routes
are skewed, and nothing planned on the host (no stage plan, no transfers on the engine)."""

from __future__ import annotations

import torch

from distributed_helpers import run_ranks


def _two_steps(rank, world_size, tmp, out_path):
    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer

    results = {}
    for balancer in ("static", "exact"):
        cfg = load_config("train_configs/debug_tiny_rl.toml", [
            f"--job.dump_folder={tmp}/{balancer}", "--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0",
            "--training.steps=2", f"--balance.balancer={balancer}", "--balance.spare_slots=1",
        ])
        trainer = RLTrainer(cfg)
        summary = trainer.train()
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in trainer.model.named_parameters()}
        results[balancer] = {"summary": summary, "params": params,
                             "moves": trainer.placement.runtime.engine.take_stats().transfers}
        trainer.close()
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


def test_exact_matches_static_with_exact_quotas(tmp_path):
    out_path = tmp_path / "out.pt"
    run_ranks(_two_steps, 4, str(tmp_path), str(out_path))
    res = torch.load(out_path)
    static, exact = res["static"]["summary"], res["exact"]["summary"]
    assert len(exact["loss"]) == 2
    for a, b in zip(static["loss"], exact["loss"]):
        assert abs(a - b) <= 1e-5 * max(abs(a), 1e-3)
    for name, p in res["static"]["params"].items():
        q = res["exact"]["params"][name]
        assert ((p - q).norm() / p.norm()).item() <= 1e-5, name
    assert exact["placement/step_rows_minus_routed"] == [0.0] * 2  # every routed pair computed once
    # exact quotas: the measured max/mean rank load is 1 up to the integer remainder
    assert max(exact["balance/step_mean_max_over_mean"]) < 1.01 < min(static["balance/step_mean_max_over_mean"])
    assert min(exact["placement/step_replicas"]) > 0  # hot experts duplicated
    assert min(exact["placement/step_plan_ms"]) > 0
    assert res["exact"]["moves"] == 0  # no transfer-engine moves: the experts are gathered in the layer
