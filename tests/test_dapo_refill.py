"""DAPO dynamic sampling with refill: uniform groups' slots take informative groups of fresh prompts, within
a bounded number of rounds, counted; the default (no refill) takes none of this path."""

from __future__ import annotations

import torch

from titan_foremoe.rollouts.generate import Rollout
from titan_foremoe.rollouts.sources.embedded import EmbeddedSource
from titan_foremoe.routing_log import RoutingLog

SPP = 2


def _part(rewards, tag, width):
    """A fake scored rollout: row b's tokens are [tag, b, ...] (width varies by round), rewards as given."""
    B = len(rewards)
    tokens = torch.full((B, width), 7)
    tokens[:, 0], tokens[:, 1] = tag, torch.arange(B)
    lengths = torch.full((B,), width)
    routes = RoutingLog(torch.randint(0, 4, (B, width, 2, 2), dtype=torch.uint8), lengths.clone(), 4)
    rollout = Rollout(tokens, torch.full((B,), 2), lengths, torch.zeros(B, width), torch.ones(B, dtype=torch.bool),
                      routes)
    examples = [f"{tag}/{b}" for b in range(B)]
    return rollout, examples, [f"c{tag}/{b}" for b in range(B)], torch.tensor(rewards, dtype=torch.float32), \
        torch.zeros(B)


class _Tok:
    pad_id = 0


def _source(rounds, table):
    src = EmbeddedSource(model=None, tokenizer=_Tok(), task=None, reward_fn=None, gen_cfg=None, seed=0, dp_rank=0,
                         prompts_per_rank=3, samples_per_prompt=SPP, num_experts=4, device=torch.device("cpu"),
                         refill_rounds=rounds)
    calls = []

    def scored(step, round=0, prompts=None):
        calls.append((round, prompts))
        return _part(table[round], 10 + round, 5 + round)

    src._scored = scored
    return src, calls


def test_refill_fills_uniform_slots_in_order_within_the_rounds():
    table = {0: [1, 0, 1, 1, 0, 0],  # groups: informative, uniform, uniform
             1: [1, 1, 0, 1],  # 2 fresh prompts: uniform, informative -> slot 1
             2: [0, 1, 0, 0]}  # 1 prompt asked for (this fake answers 2 groups): the first informative one
    src, calls = _source(3, table)
    b = src.next_batch(0)
    assert calls == [(0, None), (1, 2), (2, 1)]  # each round decodes as many prompts as slots are still empty
    assert b.refill == {"rounds": 2, "refilled": 2, "unfilled": 0}
    tags = b.rollout.tokens_BT[:, :2].tolist()
    assert tags == [[10, 0], [10, 1], [11, 2], [11, 3], [12, 0], [12, 1]]
    assert b.rewards_B.tolist() == [1, 0, 0, 1, 0, 1]
    assert b.rollout.tokens_BT.shape == (6, 7) and b.rollout.lengths_B.tolist() == [5, 5, 6, 6, 7, 7]
    assert (b.rollout.tokens_BT[:2, 5:] == 0).all()  # narrower rows right-padded
    assert b.rollout.routes.experts_BTXK.shape == (6, 7, 2, 2)


def test_refill_stops_at_the_bound_and_counts_what_stays_uniform():
    table = {0: [1, 1, 0, 0, 1, 0], 1: [1, 1, 0, 0], 2: [0, 0, 1, 1]}
    src, calls = _source(2, table)
    b = src.next_batch(0)
    assert calls == [(0, None), (1, 2), (2, 2)]
    assert b.refill == {"rounds": 2, "refilled": 0, "unfilled": 2}
    assert b.rewards_B.tolist() == table[0]  # the slots keep the step's own groups (the trainer filters them)


def test_no_refill_is_the_old_path():
    src, calls = _source(0, {0: [1, 1, 0, 0, 1, 0]})
    b = src.next_batch(0)
    assert calls == [(0, None)] and not b.refill and b.rollout.tokens_BT.shape == (6, 5)


def _run(rank, world_size, tmp, out_path):
    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer

    cfg = load_config("train_configs/debug_tiny_rl.toml", [
        f"--job.dump_folder={tmp}", "--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0",
        "--training.steps=1", "--training.local_batch_size=4", "--training.global_batch_size=8",
        "--rl.samples_per_prompt=4", "--rl.updates_per_rollout=1", "--parallelism.expert_parallel_degree=2",
        "--rl.filter_groups=true", "--rl.filter_groups_max_rounds=2",
        "--rl.reward_fn=exact_match"])  # the untrained policy never answers exactly: every group stays uniform
    trainer = RLTrainer(cfg)
    seen = []
    next_batch = trainer.source.next_batch

    def spy(step):
        b = next_batch(step)
        uniform = (b.rewards_B.view(-1, 4) == b.rewards_B.view(-1, 4)[:, :1]).all(-1)
        seen.append({**b.refill, "uniform": int(uniform.sum()), "rows": len(b.rewards_B)})
        return b

    trainer.source.next_batch = spy
    out = trainer.train()
    trainer.close()
    ranks = [None] * world_size
    dist.all_gather_object(ranks, seen)
    if rank == 0:
        torch.save({"out": out, "ranks": ranks}, out_path)
    dist.destroy_process_group()


def test_refill_on_two_ranks_keeps_lockstep(tmp_path):
    """Both ranks lack groups through every round: they decode the same rounds (no hang) up to the bound, and the
    counts add up (refilling a slot is the unit tests' job above)."""
    from distributed_helpers import run_ranks

    out_path = tmp_path / "out.pt"
    run_ranks(_run, 2, str(tmp_path), str(out_path))
    res = torch.load(out_path, weights_only=False)
    out, ranks = res["out"], [r[0] for r in res["ranks"]]
    rounds, refilled, unfilled = out["rl/refill_rounds"][0], out["rl/groups_refilled"][0], out["rl/groups_unfilled"][0]
    assert ranks[0]["rounds"] == ranks[1]["rounds"] == rounds == 2  # lock-step: every rank decoded both rounds
    assert refilled == sum(r["refilled"] for r in ranks) and unfilled == sum(r["unfilled"] for r in ranks)
    for r in ranks:  # one group per rank: refilled means its slot now holds an informative group
        assert r["rows"] == 4 and r["uniform"] == r["unfilled"] and r["refilled"] + r["unfilled"] <= 1
    assert out["rl/groups_filtered"][0] == unfilled  # what stays uniform is what the trainer filters


def test_config_refuses_bad_refill_options():
    from pathlib import Path

    import pytest

    from titan_foremoe.config import ConfigError, load_config
    from titan_foremoe.config.validate import validate

    toml = Path(__file__).resolve().parents[1] / "train_configs" / "debug_tiny_rl.toml"
    for overrides, text in [
        (["--rl.filter_groups=true", "--rl.filter_groups_max_rounds=-1"], "[rl] filter_groups_max_rounds: must be >= 0"),
        (["--rl.filter_groups_max_rounds=2"], "[rl] filter_groups_max_rounds: refills filtered groups: needs filter_groups"),
    ]:
        with pytest.raises(ConfigError) as e:
            validate(load_config(toml, overrides), 4)
        assert text in str(e.value) and "\n" not in str(e.value)
    validate(load_config(toml, ["--rl.filter_groups=true", "--rl.filter_groups_max_rounds=2"]), 4)
