"""File-mode RL reproduces embedded-mode RL on the same sequences (4 gloo ranks, EP=4, foremoe placement).

Two embedded RL steps record every rollout (tokens, routes, log-probs); rank 0
writes them as vLLM, SGLang, verl and slime engine files, imports each (all four
directories must hold identical rows), then a fresh trainer with the same seed
trains from an imported directory in file mode: the same losses, rewards and
foresight loads, no recompute route mismatch, and the imported behaviour
log-probs match the recompute as closely as the embedded ones do.
"""

from __future__ import annotations

import glob
import os

import torch

from distributed_helpers import run_ranks, train_recording_samples

OVERRIDES = ["--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0", "--training.steps=2",
             "--training.local_batch_size=4", "--training.global_batch_size=16", "--rl.samples_per_prompt=4",
             "--rl.updates_per_rollout=2", "--rl.save_loads=true"]
FORMATS = ("vllm", "sglang", "verl", "slime")


def _run(rank, world_size, tmp, out_path):
    import numpy as np
    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.rollouts import ModelSpec, RolloutStore, import_rollouts
    from titan_foremoe.rollouts.export import write_engine_file
    from titan_foremoe.train.rl_trainer import RLTrainer

    def trainer_for(name, extra=()):
        cfg = load_config("train_configs/debug_tiny_rl.toml", [f"--job.dump_folder={tmp}/{name}", *OVERRIDES, *extra])
        return RLTrainer(cfg)

    metrics, samples = train_recording_samples(trainer_for("embedded"), rank, world_size, samples_per_prompt=4)
    results = {"embedded": metrics}
    if rank == 0:  # samples in global row order: step, then data-parallel rank, then the rank's rows
        spec = ModelSpec(4, 2, 8, 64)
        for fmt in FORMATS:
            write_engine_file(fmt, samples, f"{tmp}/{fmt}.jsonl", samples_per_prompt=4)
            import_rollouts(fmt, [f"{tmp}/{fmt}.jsonl"], f"{tmp}/rollouts_{fmt}", spec, rows_per_shard=24)
        stores = {fmt: RolloutStore(f"{tmp}/rollouts_{fmt}") for fmt in FORMATS}
        for i, s in enumerate(samples):
            for fmt, st in stores.items():
                row = st.read(i)
                assert np.array_equal(row.tokens_T, s.tokens_T) and row.prompt_len == s.prompt_len, (fmt, i)
                assert np.array_equal(row.routes_RXK, s.routes_RXK), (fmt, i)
                assert np.array_equal(row.logprobs_T, s.logprobs_T, equal_nan=True), (fmt, i)
                assert row.answer == s.answer and row.reward != row.reward, (fmt, i)  # reward NaN: computed
    dist.barrier()
    file_mode = ["--rl.rollout_source=file"]
    trainer = trainer_for("file_sglang", [*file_mode, f"--rl.rollout_dir={tmp}/rollouts_sglang"])
    results["sglang"] = trainer.train()
    trainer.close()
    # verl, interrupted after step 1 and resumed from the checkpoint: step 2 must take the second batch
    ckpt = [*file_mode, f"--rl.rollout_dir={tmp}/rollouts_verl", "--checkpoint.enable=true", "--checkpoint.interval=1"]
    first = trainer_for("file_verl", ckpt)
    out = first.run_job_step(0)  # what train() does for step 0, then "crash" after its checkpoint
    first.step = 1
    first.checkpointer.save(1)
    first.close()
    part1 = {k: [v] for k, v in out.items()}
    resumed = trainer_for("file_verl", ckpt)
    part2 = resumed.train()
    resumed.close()
    results["verl"] = {k: part1[k] + part2[k] for k in ("loss", "rl/reward_mean", "rl/exact_match",
                       "rl/recompute_route_mismatch", "rollout/logprob_gap", "rollouts/truncated",
                       "placement/step_rows_off_plan", "foresight/step_static_max_over_mean")}
    results["verl_resumed_at"] = part2["steps"]
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


def test_file_mode_reproduces_embedded_training(tmp_path):
    out_path = tmp_path / "out.pt"
    run_ranks(_run, 4, str(tmp_path), str(out_path))
    res = torch.load(out_path, weights_only=False)
    emb = res["embedded"]
    assert res["verl_resumed_at"] == 2 and len(res["verl"]["loss"]) == 2  # one step before, one after the restart
    for fmt in ("sglang", "verl"):
        got = res[fmt]
        assert len(got["loss"]) == 2
        for a, b in zip(emb["loss"], got["loss"]):
            assert abs(a - b) <= 1e-6 * max(abs(a), 1e-3), (fmt, emb["loss"], got["loss"])
        assert got["rl/reward_mean"] == emb["rl/reward_mean"]
        assert got["rl/exact_match"] == emb["rl/exact_match"]
        assert got["rl/recompute_route_mismatch"] == [0.0, 0.0]
        assert max(got["rollout/logprob_gap"]) < 1e-5
        assert got["rollouts/truncated"] == [0.0, 0.0]
        assert got["placement/step_rows_off_plan"] == [0.0, 0.0]
        assert got["foresight/step_static_max_over_mean"] == emb["foresight/step_static_max_over_mean"]
        emb_loads = sorted(glob.glob(str(tmp_path / "embedded" / "loads" / "*.pt")))
        file_loads = sorted(glob.glob(str(tmp_path / f"file_{fmt}" / "loads" / "*.pt")))
        assert [os.path.basename(p) for p in emb_loads] == [os.path.basename(p) for p in file_loads] and emb_loads
        for a, b in zip(emb_loads, file_loads):
            assert torch.equal(torch.load(a)["loads_MLSE"], torch.load(b)["loads_MLSE"])
