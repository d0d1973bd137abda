"""``[rl] recompute_merge``: the recompute stage runs k of the update's micro-steps as one forward.

1. the merged micro-batches split back exactly: each update micro-batch's old / reference log-probs are the ones
   its own positions got in the merged row (oracle: the rollout's per-position behaviour log-probs, which every
   layout carries for its own positions), packed and padded, with empty micro-steps and a short last group;
2. two gloo ranks (EP 2, foremoe, packed rows): the job with the recompute merged trains as the job without it
   (the log-probs of the same positions, so the same losses and parameters up to rounding), in half the
   recompute micro-steps, each planned from the merged loads (the placement's rows equal the merged counts);
3. the same in combination: DAPO's filter_groups, a k3 KL reference, asynchronous RL with plan_from_stream (the next
   step's merged micro-batches built and planned ahead), and a k = 2 run resumed from its step-1 checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from titan_foremoe.rl.losses import LossNorm, PolicyLossConfig, policy_loss
from titan_foremoe.schedule.merge import merged_cells
from titan_foremoe.train.rl_batches import build_micro_batch, loss_references, split_recomputed

from distributed_helpers import run_ranks
from test_packed_sequences import _rollout

LENGTHS = [7, 12, 3, 9, 5, 6, 4]
PROMPTS = [3, 4, 2, 5, 1, 2, 2]


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("k", [2, 3])
def test_merged_log_probs_split_back_to_each_micro_step(pack, k):
    rollout = _rollout(LENGTHS, PROMPTS)
    adv = torch.randn(len(LENGTHS), dtype=torch.float64)
    cells = [[3, 0], [], [2], [6, 1], [5], [], [4]]  # empty micro-steps, 7 cells: a short last group for k = 2, 3
    parts = [build_micro_batch(rollout, c, adv, pack=pack) for c in cells]
    merged_seqs = merged_cells(cells, k)
    assert merged_seqs == [[s for c in cells[i : i + k] for s in c] for i in range(0, len(cells), k)]
    merged = [build_micro_batch(rollout, c, adv, pack=pack) for c in merged_seqs]
    for mb in merged:  # a "recompute": each position's log-prob is a function of (sequence, position) alone
        mb.old_logp_BL, mb.ref_logp_BL = mb.rollout_logp_BL.clone(), 2 * mb.rollout_logp_BL
    split_recomputed(merged, parts, k)
    for part in parts:
        assert part.old_logp_BL.shape == part.inputs_BL.shape
        assert torch.equal(part.old_logp_BL, part.rollout_logp_BL)
        assert torch.equal(part.ref_logp_BL, 2 * part.rollout_logp_BL)


def test_an_empty_micro_step_compares_its_masked_position_with_its_own_log_prob():
    """A merged recompute hands an empty micro-step a filler (0); the masked position still enters the loss as
    value x 0, so with k3's exp(ref - logp) overflowing the step would be NaN: the update compares it with its
    own log-prob instead (what k = 1's own forward gave, up to the weights' step), and a sequence keeps its own."""
    rollout = _rollout(LENGTHS, PROMPTS)
    adv = torch.randn(len(LENGTHS), dtype=torch.float64)
    parts = [build_micro_batch(rollout, c, adv, pack=True) for c in ([], [3, 0])]
    merged = [build_micro_batch(rollout, [3, 0], adv, pack=True)]
    merged[0].old_logp_BL = merged[0].ref_logp_BL = merged[0].rollout_logp_BL.float()
    split_recomputed(merged, parts, 2)
    cfg = PolicyLossConfig(kl_coef=0.1, kl_estimator="k3")
    empty = parts[0]
    logp = torch.full((1, 1), -100.0, requires_grad=True)  # far below the filler: exp(0 - (-100)) overflows fp32
    for old, ref, finite in ((empty.old_logp_BL, empty.ref_logp_BL, False), (*loss_references(empty, logp), True)):
        loss, _ = policy_loss(logp, old, torch.zeros(1), empty.loss_mask_BL, cfg, ref_logp_BL=ref,
                              norm=LossNorm(1.0, 1.0))
        loss.backward()
        assert bool(torch.isfinite(loss)) == finite and bool(torch.isfinite(logp.grad).all()) == finite
        logp.grad = None
    full = parts[1]
    assert all(a is b for a, b in zip(loss_references(full, torch.zeros(1, 1)), (full.old_logp_BL, full.ref_logp_BL)))


def test_merging_needs_packed_rows(tmp_path):
    from titan_foremoe.config import ConfigError, load_config
    from titan_foremoe.config.validate import validate

    rl = "train_configs/debug_tiny_rl.toml"
    with pytest.raises(ConfigError, match=r"\[rl\] recompute_merge.*pack_sequences"):
        validate(load_config(rl, ["--rl.recompute_merge=2", "--training.pack_sequences=false"]), 4)
    with pytest.raises(ConfigError, match=r"\[rl\] recompute_merge.*>= 1"):
        validate(load_config(rl, ["--rl.recompute_merge=0"]), 4)
    validate(load_config(rl, ["--rl.recompute_merge=3", "--training.pack_sequences=true"]), 4)


def _train(rank, world_size, tmp, out_path, extra=(), runs=(("m1", 1), ("m2", 2)), stream=False):
    """The runs ``(name, k)`` of one job on two gloo ranks with ``extra`` overrides; a name ending in ``_resumed`` goes
    on from the step-1 checkpoint of the run it names (its step-2 checkpoint removed). ``stream``: asynchronous RL
    with ``plan_from_stream`` (``_StaleSource``)."""
    import shutil

    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer

    results = {}
    for name, merge in runs:
        dump = f"{tmp}/{name.removesuffix('_resumed')}"
        if name.endswith("_resumed"):
            if rank == 0:
                shutil.rmtree(f"{dump}/checkpoint/step-2")
            dist.barrier()
        cfg = load_config("train_configs/debug_tiny_rl.toml", [
            f"--job.dump_folder={dump}", "--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0",
            "--training.steps=2", "--parallelism.expert_parallel_degree=2", "--training.global_batch_size=32",
            "--balance.balancer=foremoe", "--balance.spare_slots=1", "--training.pack_sequences=true",
            f"--rl.recompute_merge={merge}", *extra,
        ])
        trainer = RLTrainer(cfg)
        if stream:  # validated with the synchronous loop (the embedded source): asynchronous from here on
            trainer.source = _StaleSource(trainer.source)
            trainer.cfg.rl.max_staleness, trainer.cfg.rl.plan_from_stream = 1, True
        stages = []
        real_start = trainer.runtime.start_stage

        def start_stage(plan, loads_MLSE, *a, name="stage", **kw):
            stages.append((name, int(loads_MLSE.shape[0]), loads_MLSE.sum().item()))
            return real_start(plan, loads_MLSE, *a, name=name, **kw)

        trainer.runtime.start_stage = start_stage
        metrics = []
        real_step = trainer.rl_step
        trainer.rl_step = lambda step: metrics.append(real_step(step)) or metrics[-1]
        summary = trainer.train()
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in trainer.model.named_parameters()}
        results[name] = {"loss": summary["loss"], "params": params, "stages": stages,
                         "metrics": [{k: v for k, v in m.items() if k.startswith(("schedule/", "rl/", "loss",
                                                                                   "foresight/prepared_at"))}
                                     for m in metrics]}
        trainer.close()
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()


class _StaleSource:
    """The embedded source as an asynchronous one (``[rl] max_staleness = 1`` needs live vLLM engines otherwise):
    step N + 1's rows are generated at step N's first poll (point 0, after its recompute, from step N's weights), so
    ``StreamAhead`` prepares step N + 1 there (``ahead=True``: its merged micro-batches built, both stages planned
    in the planner's worker) while step N updates."""

    def __init__(self, inner):
        self.inner, self.rows = inner, {}

    def poll(self, step, wait=False):
        if step not in self.rows:
            self.rows[step] = self.inner.next_batch(step)
        return self.rows[step]

    def next_batch(self, step):
        return self.rows.pop(step) if step in self.rows else self.inner.next_batch(step)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def three_digits_uniform(task, example, completion):
    """``[rl] reward_fn`` for filter_groups: a prompt of 3 digits scores 0 whatever the completion (its group is
    uniform: filtered), the others the task's credit plus a length term (not uniform)."""
    return 0.0 if len(example.answer) == 3 else task.reward(example, completion) + 0.1 * len(completion)


def _same_training(one, two):
    rec1 = [s for s in one["stages"] if s[0] == "recompute"]
    rec2 = [s for s in two["stages"] if s[0] == "recompute"]
    upd2 = [s for s in two["stages"] if s[0] == "update"]
    rec1 = rec1[len(rec1) - len(rec2):]  # a resumed run's steps: the last ones
    assert len(rec1) == len(rec2) == len(upd2) == len(two["metrics"])
    for (_, m1, n1), (_, m2, n2), (_, mu, nu) in zip(rec1, rec2, upd2):
        assert m2 == (m1 + 1) // 2 and mu == m1 > 1  # half the micro-steps, the same routed pairs
        assert n2 == n1 == nu
    for a, b in zip(one["metrics"][-len(two["metrics"]):], two["metrics"]):
        assert b["schedule/recompute_micro_steps"] == (a["schedule/recompute_micro_steps"] + 1) // 2
        assert b["schedule/micro_steps"] == a["schedule/micro_steps"] == a["schedule/recompute_micro_steps"]
        assert b["rl/reward_mean"] == a["rl/reward_mean"]  # the same rollouts
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        assert b.get("rl/kl", 0.0) == pytest.approx(a.get("rl/kl", 0.0), rel=1e-5, abs=1e-7)
    for name, p in one["params"].items():
        torch.testing.assert_close(two["params"][name], p, rtol=1e-5, atol=1e-6, msg=name)


def test_two_ranks_train_the_same_with_the_recompute_merged(tmp_path):
    out = tmp_path / "out.pt"
    run_ranks(_train, 2, str(tmp_path), str(out))
    for rank in range(2):
        res = torch.load(f"{out}.{rank}")
        assert len(res["m2"]["metrics"]) == 2
        _same_training(res["m1"], res["m2"])


RESUME = ["--checkpoint.enable=true", "--checkpoint.interval=1", "--checkpoint.keep_latest_k=0"]


@pytest.mark.parametrize("combo", ["filter_groups", "kl_k3", "async_plan_from_stream", "resume"])
def test_merged_recompute_trains_the_same_in_combination(tmp_path, combo):
    """k = 2 trains as k = 1 (two gloo ranks, EP 2, foremoe, packed rows) with: DAPO's filter_groups (groups of
    uniform rewards in both steps, in the loss with an empty mask); a k3 KL reference (its forward merged too);
    asynchronous RL with plan_from_stream (step 2 prepared ahead at step 1's first point); and a k = 2 run resumed
    from its step-1 checkpoint (its step 2 as the uninterrupted run's)."""
    extra = {"filter_groups": ["--rl.filter_groups=true", "--rl.reward_fn=test_recompute_merge:three_digits_uniform"],
             "kl_k3": ["--rl.kl_coef=0.1", "--rl.kl_estimator=k3"],
             "async_plan_from_stream": ["--rl.rollout_is=token"], "resume": RESUME}[combo]
    runs = (("m1", 1), ("m2", 2)) + ((("m2_resumed", 2),) if combo == "resume" else ())
    out = tmp_path / "out.pt"
    run_ranks(_train, 2, str(tmp_path), str(out), extra, runs, combo == "async_plan_from_stream")
    for rank in range(2):
        res = torch.load(f"{out}.{rank}")
        assert len(res["m2"]["metrics"]) == 2
        _same_training(res["m1"], res["m2"])
        steps = res["m2"]["metrics"]
        if combo == "filter_groups":
            assert all(0 < m["rl/groups_filtered"] and 0 < m["rl/nonzero_advantage_frac"] < 1 for m in steps)
        if combo == "kl_k3":
            assert steps[1]["rl/kl"] > 0  # the policy moved off the reference at step 1
        if combo == "async_plan_from_stream":
            assert [m["foresight/prepared_at"] for m in steps] == [0.0, -1.0]  # step 2 prepared at step 1's point 0
        if combo == "resume":
            resumed = res["m2_resumed"]
            assert len(resumed["metrics"]) == 1  # step 2 only
            _same_training(res["m1"], resumed)
            assert resumed["loss"][-1] == pytest.approx(res["m2"]["loss"][-1], rel=1e-6, abs=1e-7)
            for name, p in res["m2"]["params"].items():
                torch.testing.assert_close(resumed["params"][name], p, rtol=1e-6, atol=1e-7, msg=name)


def test_simulator_charges_the_recompute_it_runs():
    """The simulator's recompute with ``recompute_merge`` k is its recompute of the merged work, stage for stage
    (plans, the planner's prices at the merged groups, ``ideal``'s levelled dense work); the update is the
    unmerged one's; the merge groups the micro-steps as ``merged_cells`` does (the last one shorter)."""
    import importlib.util
    from pathlib import Path

    import numpy as np

    from titan_foremoe.simulator.simulate import device_costs, simulate
    from titan_foremoe.simulator.calibration import load_calibration
    from titan_foremoe.simulator.workload import merged_work

    spec = importlib.util.spec_from_file_location("sim", Path(__file__).resolve().parents[1] / "scripts/simulate_cluster.py")
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    a = sim.parse_args(["--synthetic", "--model", "gpt_oss_20b", "--gpus", "8", "--gpus-per-node", "4", "--ep", "4",
                        "--responses-per-microstep", "4", "--global-batch", "24", "--updates-per-rollout", "1",
                        "--out", "/unused"])
    model, cluster, sched, work, *_ = sim.build_work(a, 8, 4)
    M = len(work[0].loads_MLSE)
    assert M == 3  # 3 micro-steps: k = 2 leaves a short last group
    merged = [merged_work(w, 2) for w in work]
    for w, mw in zip(work, merged):
        cells = [[m] for m in range(M)]
        for x, mx in ((w.loads_MLSE, mw.loads_MLSE), (w.tokens_MS, mw.tokens_MS), (w.pairs_MS, mw.pairs_MS)):
            assert np.array_equal(mx, np.stack([x[c].sum(axis=0) for c in merged_cells(cells, 2)]))
    cal = load_calibration("h100")
    link = device_costs(cal, 4)
    plan_ms = {b: {"rec": (1.0, None), "upd": (1.0, None)} for b in ("static", "foremoe", "ideal")}
    kw = dict(balancers=("static", "foremoe", "ideal"), plan_ms_given=plan_ms, rollout=None)
    run = simulate(work, model, cluster, sched, cal, link, 1, recompute_merge=2, **kw)
    plain = simulate(work, model, cluster, sched, cal, link, 1, **kw)
    as_input = simulate(merged, model, cluster, sched, cal, link, 1, **kw)
    for b in ("static", "foremoe", "ideal"):
        assert run[b]["recompute_ms"] == pytest.approx(as_input[b]["recompute_ms"], rel=1e-12), b
        assert run[b]["max_over_mean_recompute"] == as_input[b]["max_over_mean_recompute"], b
        assert run[b]["max_over_mean"] == plain[b]["max_over_mean"], b  # the update's plans are the unmerged ones
    assert run["foremoe"]["recompute_ms"] < plain["foremoe"]["recompute_ms"]  # fewer, larger forwards
    with pytest.raises(SystemExit) as e:  # padded rows are refused, as the trainer refuses them
        sim.parse_args(["--synthetic", "--model", "gpt_oss_20b", "--no-pack", "--recompute-merge", "2", "--out", "/x"])
    assert e.value.code == 2
