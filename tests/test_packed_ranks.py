"""Packed vs padded micro-batches in the real trainer: 2 gloo ranks, FSDP2 + EP 2, routes replayed.

The same rollout rows run the recompute and update stages three ways (learning rate 0, so the weights stay):

- padded: two micro-steps per rank, one right-padded row per sequence (``pack_sequences = false``);
- packed: the same micro-steps, each one row;
- packed with an empty micro-step: rank 1 runs all its sequences in its first micro-step and nothing in its
  second (one masked position: no routed token, no loss), so every collective of the forward, the expert
  all-to-alls and the FSDP reduce-scatters still pair up with rank 0's.

Old log-probs, the rollout gap and route mismatch, every loss metric and every parameter's gradient agree
(the loss is normalized over the step, so where a sequence runs does not change it).
"""

from __future__ import annotations

import torch

from distributed_helpers import run_ranks


def _rank(rank, world_size, tmp, out_path):
    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer, build_micro_batch

    cfg = load_config("train_configs/debug_tiny_rl.toml", [
        f"--job.dump_folder={tmp}", "--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0",
        "--training.steps=1", "--parallelism.expert_parallel_degree=2", "--balance.balancer=off",
        "--optimizer.lr=0", "--training.max_norm=1e9", "--rl.loss_agg_mode=seq-mean-token-mean",
        "--rl.rollout_is=sequence", "--rl.entropy_coef=0.01", "--rl.max_new_tokens=6",
    ])
    trainer = RLTrainer(cfg)
    rollout, _ = trainer.rollout(0)
    B = rollout.tokens_BT.shape[0]
    advantages = torch.randn(B, generator=torch.Generator().manual_seed(rank))
    rows = list(range(B))
    halves = [rows[: B // 2 - 1], rows[B // 2 - 1 :]]  # uneven micro-steps
    plans = {"padded": (False, halves), "packed": (True, halves),
             "empty": (True, halves if rank == 0 else [rows, []])}
    out = {"lengths": rollout.lengths_B}
    for name, (pack, plan) in plans.items():
        batches = [build_micro_batch(rollout, seqs, advantages, pack=pack) for seqs in plan]
        stats = trainer.recompute(batches)
        metrics = trainer.update(batches)
        out[name] = dict(
            # old log-probs of each sequence, in rollout-row order, whatever the layout
            old={s: mb.rows(mb.old_logp_BL)[i, : int(rollout.lengths_B[s]) - 1]
                 for mb in batches for i, s in enumerate(mb.sequences)},
            gap=stats.logp_max_abs_diff, mismatched=stats.mismatched, compared=stats.compared,
            metrics=metrics,
            grads={n: p.grad.to_local().clone() for n, p in trainer.model.named_parameters()},
            computed=[mb.computed_positions() for mb in batches], real=[mb.real_tokens() for mb in batches],
        )
    torch.save(out, f"{out_path}.{rank}")
    trainer.close()
    dist.destroy_process_group()


def test_packed_equals_padded_on_two_ranks_with_an_empty_micro_step(tmp_path):
    out_path = tmp_path / "out.pt"
    run_ranks(_rank, 2, str(tmp_path), str(out_path))
    for rank in range(2):
        out = torch.load(f"{out_path}.{rank}")
        pad = out["padded"]
        assert len(set(out["lengths"].tolist())) > 1  # the rows differ in length: padding exists
        assert sum(pad["computed"]) > sum(pad["real"])
        for name in ("packed", "empty"):
            o = out[name]
            assert sum(o["computed"]) == sum(o["real"]) + (name == "empty" and rank == 1)  # no padding computed
            assert o["old"].keys() == pad["old"].keys()
            for s, want in pad["old"].items():
                torch.testing.assert_close(o["old"][s], want, rtol=0, atol=1e-5, msg=f"rank {rank} {name} row {s}")
            assert o["mismatched"] == pad["mismatched"] == 0 and o["compared"] == pad["compared"] > 0
            assert o["gap"] < 1e-5
            for k, v in pad["metrics"].items():
                if name == "empty" and k.startswith("balance/"):  # per micro-step expert balance: other micro-steps
                    continue
                assert abs(o["metrics"][k] - v) <= 1e-5 * max(1.0, abs(v)), (rank, name, k, v, o["metrics"][k])
            for n, g in pad["grads"].items():
                assert g.abs().sum() > 0 or "moe" in n, n
                torch.testing.assert_close(o["grads"][n], g, rtol=1e-4, atol=1e-6, msg=f"rank {rank} {name} {n}")
        if rank == 1:
            assert out["empty"]["real"][1] == 0 and out["empty"]["computed"][1] == 1


def _rank_planned(rank, world_size, tmp, out_path):
    """A whole RL step with foremoe plans, twice from the same rollout: the schedule as made, then with rank 1's
    last micro-step of each update emptied (its rows run in the update's first micro-step)."""
    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer

    cfg = load_config("train_configs/debug_tiny_rl.toml", [
        f"--job.dump_folder={tmp}", "--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0",
        "--training.steps=1", "--parallelism.expert_parallel_degree=2", "--optimizer.lr=0",
        "--training.max_norm=1e9", "--rl.max_new_tokens=6", "--training.global_batch_size=32",
    ])
    trainer = RLTrainer(cfg)
    made = trainer.schedule

    def emptied(*args, **kwargs):
        step = made(*args, **kwargs)
        if rank == 1:
            step.plan = [[update[0] + update[-1], *update[1:-1], []] for update in step.plan]
        return step

    outs = [trainer.rl_step(0)]
    trainer.schedule = emptied
    outs.append(trainer.rl_step(0))
    torch.save(outs, f"{out_path}.{rank}")
    trainer.close()
    dist.destroy_process_group()


def test_planned_step_with_an_empty_micro_step(tmp_path):
    out_path = tmp_path / "out.pt"
    run_ranks(_rank_planned, 2, str(tmp_path), str(out_path))
    made, emptied = torch.load(f"{out_path}.0")
    for out in (made, emptied):
        assert out["placement/step_rows_off_plan"] == 0 and out["placement/step_rows_minus_routed"] == 0
        assert out["rl/recompute_route_mismatch"] == 0 and out["rollout/logprob_gap"] < 1e-5
    for k in ("loss", "rl/clip_frac", "rl/kl", "rl/entropy", "grad_norm"):
        assert abs(emptied[k] - made[k]) <= 1e-5 * max(1.0, abs(made[k])), (k, made[k], emptied[k])
