"""Router replay on 4 gloo ranks with EP=4: recompute reproduces the rollout exactly.

With unchanged weights the recompute stage (routes replayed from the rollout's
log) gives the rollout's log-probs and no route mismatch; with replay off and
perturbed router weights the live routes drift from the log.
"""

from __future__ import annotations

import torch

from distributed_helpers import run_ranks
from titan_foremoe.config import load_config


def _check(rank, world_size, tmp, out_path):
    import torch.distributed as dist

    from titan_foremoe.models.seams import routers
    from titan_foremoe.train.rl_trainer import RLTrainer, build_micro_batch

    cfg = load_config("train_configs/debug_tiny_rl.toml", [
        f"--job.dump_folder={tmp}", "--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0",
        "--training.steps=1",
    ])
    trainer = RLTrainer(cfg)
    rollout, _ = trainer.rollout(0)
    advantages = torch.zeros(rollout.tokens_BT.shape[0])
    step = trainer.schedule(rollout, advantages)  # every rank's rows on their scheduled ranks
    batches = [build_micro_batch(step.rows.rollout, seqs, step.rows.advantages_B) for update in step.plan
               for seqs in update]

    same = trainer.recompute(batches)
    with torch.no_grad():
        for router in routers(trainer.model):
            router.gate.weight.mul_(-1.0)  # same perturbation on every rank
    trainer.cfg.rl.router_replay = False
    perturbed = trainer.recompute(batches)

    stats = torch.tensor([same.mismatched, same.compared, perturbed.mismatched, perturbed.compared],
                         dtype=torch.float64)
    dist.all_reduce(stats)
    gap = torch.tensor(same.logp_max_abs_diff)
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    if rank == 0:
        torch.save({"stats": stats, "gap": float(gap), "tokens": int(rollout.lengths_B.sum())}, out_path)
    dist.destroy_process_group()


def test_recompute_replays_the_rollout(tmp_path):
    out_path = tmp_path / "out.pt"
    run_ranks(_check, 4, str(tmp_path), str(out_path))
    out = torch.load(out_path)
    same_mis, same_cmp, pert_mis, pert_cmp = out["stats"].tolist()
    assert same_cmp > 0 and same_mis == 0  # replay on, unchanged weights: identical routes
    assert out["gap"] < 1e-5  # recompute log-probs equal the rollout's
    assert pert_cmp == same_cmp
    assert pert_mis / pert_cmp > 0.1  # replay off, perturbed router: live routes differ
