"""EP independent of FSDP: EP = 2 on 4 gloo ranks, with dp_shard = 4 and with dp_replicate = 2 x dp_shard = 2.

torchtitan's expert mesh is ``(dp_replicate, efsdp, ep)`` with ``efsdp = dp_shard / ep``, so
each layout has two EP groups running different batches, each planning from its own
loads. One spawned group of 4 ranks runs, for both layouts:

- one supervised micro-step schedule, compared with one process running the whole
  global batch (loss and every gradient, as ``test_equivalence.py``);
- two RL steps with ``balancer = off`` (torchtitan's dispatch), ``static``, ``foremoe`` with balanced
  owners (re-placed at every step from both groups' loads, weights and moments moved), and
  ``foremoe`` (placement runtime, replicas, transfers; with dp_shard = 4 also over the
  CPU-assisted host path, whose staging gathers the experts over efsdp): the same losses
  and final parameters (fp32, relative difference <= 1e-5), and foremoe follows its plan;
  with efsdp > 1 the runtime never gathers experts between micro-steps (transfers are issued from
  inside the layers' forwards, where FSDP has the experts unsharded).
"""

from __future__ import annotations

import torch

from distributed_helpers import full as _full, logical, run_ranks, sft_step as _sft_step

LAYOUTS = {
    "shard4_ep2": ["--parallelism.expert_parallel_degree=2"],
    "rep2_shard2_ep2": ["--parallelism.expert_parallel_degree=2", "--parallelism.data_parallel_replicate_degree=2"],
}
# foremoe_host: CPU-assisted transfers (host staging); foremoe_balanced: owners re-placed at every step (no
# hysteresis), agreed by both EP groups, weights and moments re-laid out over the FSDP-sharded rows
BALANCERS = ("off", "static", "foremoe", "foremoe_host", "foremoe_balanced")
BALANCED = ["--balance.owner_policy=balanced", "--balance.owner_hysteresis=0"]
SFT = ["--model.expert_dtype=float32", "--training.local_batch_size=2", "--training.global_batch_size=16",
       "--training.seq_len=24", "--metrics.enable_tensorboard=false"]
RL = ["--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0", "--training.steps=2",
      "--training.local_batch_size=2", "--training.global_batch_size=16", "--rl.updates_per_rollout=1",
      "--rl.samples_per_prompt=4", "--balance.spare_slots=1",
      # a spare slot as cheap as an owned one: replicas run rows here (at this tiny shape "auto" prices the spare
      # part above what it saves and empties them), so the returned gradients are not zeros
      "--balance.slot_overhead_tokens=0"]




def _summed(n: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([n])
    dist.all_reduce(t)
    return int(t.item())


def _all_configs(rank, world_size, tmp, out_path):
    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer
    from titan_foremoe.train.trainer import Trainer

    from torch.distributed.tensor import DTensor

    from titan_foremoe.placement.runtime import PlacementRuntime
    from titan_foremoe.planner.owners import physical_rows_LE

    # expert gathers the placement runtime causes outside the model's forward (DTensor redistributions
    # inside ``PlacementRuntime.prefetch``, which the trainer calls between micro-steps and after a step)
    gathers, inside = [0], [0]
    redistribute, prefetch = DTensor.redistribute, PlacementRuntime.prefetch

    def counting_redistribute(self, *a, **k):
        gathers[0] += inside[0] > 0
        return redistribute(self, *a, **k)

    def counting_prefetch(self, m):
        inside[0] += 1
        try:
            return prefetch(self, m)
        finally:
            inside[0] -= 1

    DTensor.redistribute, PlacementRuntime.prefetch = counting_redistribute, counting_prefetch
    results = {}
    for name, layout in LAYOUTS.items():
        cfg = load_config("train_configs/debug_tiny_cpu.toml", SFT + layout + [f"--job.dump_folder={tmp}/{name}/sft"])
        trainer = Trainer(cfg)
        ep_groups = [None] * world_size
        dist.all_gather_object(ep_groups, dist.get_process_group_ranks(trainer.ep_group))
        results[(name, "sft")] = {**_sft_step(trainer), "ep_groups": ep_groups}
        trainer.close()
        for balancer in BALANCERS:
            if balancer == "foremoe_host" and name != "shard4_ep2":
                continue
            path = "host" if balancer == "foremoe_host" else "auto"
            cfg = load_config("train_configs/debug_tiny_rl.toml", RL + layout + [
                f"--job.dump_folder={tmp}/{name}/{balancer}", f"--balance.balancer={balancer.split('_')[0]}",
                f"--balance.transfer_path={path}"] + (BALANCED if balancer == "foremoe_balanced" else []))
            trainer = RLTrainer(cfg)
            gathers[0] = 0
            summary = trainer.train()
            rt = trainer.runtime
            rows_LE = None if trainer.placement is None else physical_rows_LE(trainer.placement.layout.owner_LE,
                                                                               trainer.resolved.ep)
            results[(name, balancer)] = {
                "summary": summary, "params": {n: logical(n, _full(p), rows_LE)
                                               for n, p in trainer.model.named_parameters()},
                "gathers": gathers[0], "deferred": rt.deferred if rt is not None else 0,
                "async_returns": rt.engine.async_returns if rt is not None else 0,
                "early_landings": rt.engine.early_landings if rt is not None else 0,
                "early_returns": _summed(rt.engine.early_returns if rt is not None else 0)}  # every rank's
            trainer.close()
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


def _reference(cfg, world_size: int, params: dict[str, torch.Tensor]):
    """One process, the whole global batch (every rank's micro-batches), from the ranks' initial weights."""
    from titan_foremoe.config.validate import model_args, validate
    from titan_foremoe.data.sft import sft_micro_batch
    from titan_foremoe.data.tasks import build_task
    from titan_foremoe.data.tokenizer import CharTokenizer
    from titan_foremoe.distributed.parallelize import build_model
    from titan_foremoe.train.trainer import token_loss_sum

    resolved = validate(cfg, world_size)
    tok, task = CharTokenizer(), build_task(cfg.data)
    model = build_model(cfg, model_args(cfg, vocab_size=tok.vocab_size), None, torch.device("cpu"))
    model.load_state_dict(params, strict=False)
    batches = [
        sft_micro_batch(task, tok, seed=cfg.job.seed, step=0, micro_step=m, dp_rank=r,
                        batch_size=cfg.training.local_batch_size, seq_len=cfg.training.seq_len)
        for m in range(resolved.micro_steps) for r in range(resolved.dp_degree)
    ]
    denominator = float(sum(b.num_label_tokens for b in batches))
    loss = sum(token_loss_sum(model(b.inputs_BL), b.labels_BL) for b in batches) / denominator
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_ep2_with_fsdp_and_hsdp(tmp_path):
    from titan_foremoe.config import load_config

    out_path = tmp_path / "out.pt"
    run_ranks(_all_configs, 4, str(tmp_path), str(out_path))
    res = torch.load(out_path, weights_only=False)
    # two EP groups of two ranks (EP is the innermost mesh axis)
    assert res[("shard4_ep2", "sft")]["ep_groups"] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for name, layout in LAYOUTS.items():
        sft = res[(name, "sft")]
        cfg = load_config("train_configs/debug_tiny_cpu.toml", SFT + layout + [f"--job.dump_folder={tmp_path}"])
        ref_loss, ref_grads = _reference(cfg, 4, sft["params"])
        assert abs(sft["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), name
        assert set(sft["grads"]) == set(ref_grads)
        for g, ref_g in ref_grads.items():
            assert ref_g.abs().sum() > 0, g
            torch.testing.assert_close(sft["grads"][g], ref_g, rtol=1e-5, atol=1e-7, msg=f"{name} {g}")

        base = res[(name, "static")]
        for other in ("off", "foremoe", "foremoe_balanced") + (("foremoe_host",) if name == "shard4_ep2" else ()):
            got = res[(name, other)]
            assert len(got["summary"]["loss"]) == 2
            for a, b in zip(base["summary"]["loss"], got["summary"]["loss"]):
                assert abs(a - b) <= 1e-5 * max(abs(a), 1e-3), (name, other)
            assert got["summary"]["rl/reward_mean"] == base["summary"]["rl/reward_mean"], (name, other)
            for p, ref_p in base["params"].items():
                assert _rel(got["params"][p], ref_p) <= 1e-5, (name, other, p)
        balanced = res[(name, "foremoe_balanced")]["summary"]
        assert sum(balanced["relayout/experts_moved"]) > 0 and balanced["placement/step_rows_off_plan"] == [0.0, 0.0]
        foremoe = res[(name, "foremoe")]["summary"]
        assert foremoe["placement/step_rows_off_plan"] == [0.0, 0.0]
        assert min(foremoe["placement/step_replicas"]) > 0 and sum(foremoe["transfer/step_moves"]) > 0
        # the parameters moved: the comparison above is not between untouched initial weights
        assert max(_rel(base["params"][p], sft["params"][p]) for p in sft["params"]) > 1e-3
    # efsdp = 2 (shard4_ep2): no expert gather between micro-steps; each step's first micro-step is issued
    # from inside the layers' forwards (deferred). efsdp = 1 (rep2_shard2_ep2): reading owned experts is free.
    for b in ("foremoe", "foremoe_host"):
        assert res[("shard4_ep2", b)]["gathers"] == 0 and res[("shard4_ep2", b)]["deferred"] > 0, b
    assert res[("rep2_shard2_ep2", "foremoe")]["deferred"] == 0
    # replica gradients were returned asynchronously and added before FSDP's reduce-scatter (the equal
    # parameters above are the evidence that they landed in the right place)
    # every one of them landed on the landing stream from the owned DTensor parameters' post-accumulate-grad
    # hooks (FSDP2's unsharded parameters), before the block's gate (``transfer/landing.py``)
    for key in (("shard4_ep2", "foremoe"), ("shard4_ep2", "foremoe_host"), ("rep2_shard2_ep2", "foremoe")):
        assert res[key]["async_returns"] > 0, key
        assert res[key]["early_landings"] == res[key]["async_returns"], key
        assert res[key]["early_returns"] > 0, key  # issued from the fused SwiGLU's backward, before its owned part
    host = res[("shard4_ep2", "foremoe_host")]["summary"]  # every move went through the host copies
    assert sum(host["transfer/step_moves"]) > 0 and host["placement/step_rows_off_plan"] == [0.0, 0.0]
    # the same global batch in both layouts: the same RL losses
    for a, b in zip(res[("shard4_ep2", "static")]["summary"]["loss"], res[("rep2_shard2_ep2", "static")]["summary"]["loss"]):
        assert abs(a - b) <= 1e-5 * max(abs(a), 1e-3)
