"""Where a sequence runs does not change the step: the trainer's schedules on 2 gloo ranks, FSDP2 + EP 2.

The same rollout (rows of different lengths on each rank, learning rate 0) runs recompute and one update three
ways: rollout order with padded rows (the previous trainer), the balanced schedule with packed rows (rows move
between the ranks), and the balanced schedule under a token budget (more micro-steps, formed by tokens). Old
log-probs of every sequence (by global id, wherever it ran), every loss metric and every parameter's gradient
agree; every rank runs the same number of micro-steps; the budget holds; the balanced schedule levels the
micro-steps' tokens better than rollout order and computes no padded position.
"""

from __future__ import annotations

import torch

from distributed_helpers import run_ranks

BUDGET = 40


def _rank(rank, world_size, tmp, out_path):
    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer, build_micro_batch

    cfg = load_config("train_configs/debug_tiny_rl.toml", [
        f"--job.dump_folder={tmp}", "--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0",
        "--training.steps=1", "--parallelism.expert_parallel_degree=2", "--balance.balancer=off",
        "--optimizer.lr=0", "--training.max_norm=1e9", "--rl.updates_per_rollout=1",
        "--rl.loss_agg_mode=seq-mean-token-mean", "--rl.max_new_tokens=6",
    ])
    trainer = RLTrainer(cfg)
    rollout, _ = trainer.rollout(0)
    advantages = torch.randn(rollout.tokens_BT.shape[0], generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, policy, budget, pack in [("rollout_order", "rollout_order", None, False),
                                       ("balanced", "balanced", None, True),
                                       ("budget", "balanced", BUDGET, True)]:
        trainer.sequences.policy, trainer.sequences.budget = policy, budget
        step = trainer.schedule(rollout, advantages)
        rows = step.rows
        batches = [build_micro_batch(rows.rollout, seqs, rows.advantages_B, pack=pack) for seqs in step.plan[0]]
        stats = trainer.recompute(batches)
        metrics = trainer.update(batches)
        out[name] = dict(
            old={int(rows.ids_B[s]): mb.rows(mb.old_logp_BL)[i, : int(rows.rollout.lengths_B[s]) - 1]
                 for mb in batches for i, s in enumerate(mb.sequences)},
            micro_steps=len(batches), tokens=[mb.real_tokens() for mb in batches],
            computed=[mb.computed_positions() for mb in batches], gap=stats.logp_max_abs_diff,
            metrics=metrics, schedule=step.metrics, moved=step.moved_fraction,
            grads={n: p.grad.to_local().clone() for n, p in trainer.model.named_parameters()},
        )
    torch.save(out, f"{out_path}.{rank}")
    trainer.close()
    dist.destroy_process_group()


def test_schedules_give_the_same_step(tmp_path):
    out_path = tmp_path / "out.pt"
    run_ranks(_rank, 2, str(tmp_path), str(out_path))
    ranks = [torch.load(f"{out_path}.{r}") for r in range(2)]
    for name in ("rollout_order", "balanced", "budget"):
        assert ranks[0][name]["micro_steps"] == ranks[1][name]["micro_steps"]  # agreed from the schedule
    assert ranks[0]["budget"]["micro_steps"] > ranks[0]["balanced"]["micro_steps"]  # formed by tokens
    assert max(t for r in ranks for t in r["budget"]["tokens"]) <= BUDGET
    base = {s: v for r in ranks for s, v in r["rollout_order"]["old"].items()}
    assert sum(sum(r["rollout_order"]["computed"]) for r in ranks) > sum(sum(r["rollout_order"]["tokens"])
                                                                          for r in ranks)  # padding exists
    for name in ("balanced", "budget"):
        o = [r[name] for r in ranks]
        assert o[0]["moved"] > 0  # rows changed rank
        assert all(sum(x["computed"]) == sum(x["tokens"]) for x in o)  # packed: no padded position
        old = {s: v for x in o for s, v in x["old"].items()}
        assert old.keys() == base.keys()  # every sequence ran exactly once, somewhere
        for s, want in base.items():
            torch.testing.assert_close(old[s], want, rtol=0, atol=1e-5, msg=f"{name} sequence {s}")
        for rank, r in enumerate(ranks):
            for k, v in r["rollout_order"]["metrics"].items():
                if k.startswith("balance/"):  # per micro-step expert balance: other micro-steps
                    continue
                assert abs(r[name]["metrics"][k] - v) <= 1e-5 * max(1.0, abs(v)), (rank, name, k, v)
            for n, g in r["rollout_order"]["grads"].items():
                torch.testing.assert_close(r[name]["grads"][n], g, rtol=1e-4, atol=1e-6, msg=f"{name} {n}")
    order, bal = ranks[0]["rollout_order"]["schedule"], ranks[0]["balanced"]["schedule"]
    assert bal["schedule/tokens_max_over_mean"] < order["schedule/tokens_max_over_mean"]
    assert bal["schedule/tokens_max_over_mean"] <= 1.05
