"""An engine we did not write, end to end: transformers' Qwen3-MoE rolls out, file mode trains on it.

A tiny random HF folder is made here; transformers' ``generate`` samples
completions for chat-templated prompts of the example prompt file (temperature
0.7, seeded); a forward with ``output_router_logits=True`` over each sequence's
fed tokens gives every position's top-k experts and the behaviour log-probs at
that temperature. They are written as vLLM and SGLang files, imported with the
CLI against the HF folder (``--hf-assets-path``), and a 2-rank trainer (FSDP2 +
EP=2, fp32) loads the same folder and trains from the vLLM directory. At the
first step our router, replaying, must pick exactly transformers' experts
(recompute route mismatch 0), our recompute must give transformers' log-probs,
and the saved foresight loads must equal a brute-force bincount of
transformers' routes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from distributed_helpers import run_ranks

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, SAMPLES, NEW_TOKENS, TEMPERATURE = 4, 2, 8, 0.7
STEPS, ROWS_PER_STEP, RANKS = 2, 4, 2  # 2 RL steps x (global batch 4 x 1 update); 2 rows per rank and step


def _transformers_rollouts(hf: str) -> list:
    """RolloutSamples whose tokens, routes and log-probs all come from transformers."""
    from titan_foremoe.data.tiny_hf import SYSTEM_PROMPT
    from titan_foremoe.rollouts.export import samples_from_transformers

    rows = [json.loads(line) for line in (ROOT / "examples/arithmetic_word_problems.jsonl").read_text().splitlines()]
    return samples_from_transformers(hf, [(r["prompt"], r["answer"]) for r in rows[:PROMPTS]],
                                     system_prompt=SYSTEM_PROMPT, samples_per_prompt=SAMPLES,
                                     max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE, seed=0)


def _train(rank, world_size, hf, rollout_dir, dump, out_path):
    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer

    cfg = load_config("train_configs/qwen3_moe_hf_grpo.toml", [
        f"--model.hf_assets_path={hf}", f"--job.dump_folder={dump}", "--metrics.enable_tensorboard=false",
        "--rl.sft_warmup_steps=0", f"--training.steps={STEPS}", "--training.local_batch_size=2",
        f"--training.global_batch_size={ROWS_PER_STEP}", f"--rl.samples_per_prompt={SAMPLES}",
        "--rl.updates_per_rollout=1", f"--rl.temperature={TEMPERATURE}", "--rl.dump_rollouts=false",
        "--rl.save_loads=true", "--rl.rollout_source=file", f"--rl.rollout_dir={rollout_dir}",
        f"--parallelism.expert_parallel_degree={world_size}", "--checkpoint.last_save_in_hf=false",
        "--checkpoint.interval=1000",
    ])
    trainer = RLTrainer(cfg)
    res = trainer.train()  # loads the HF folder first (initial_load_in_hf)
    trainer.close()
    if rank == 0:
        torch.save(res, out_path)
    dist.destroy_process_group()


def test_transformers_rollouts_train_in_file_mode(tmp_path):
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts
    from titan_foremoe.rollouts import RolloutStore
    from titan_foremoe.rollouts.__main__ import main as cli
    from titan_foremoe.rollouts.export import write_engine_file

    hf = make_tiny_checkpoint(str(tmp_path / "tiny"), read_texts(str(ROOT / "examples/arithmetic_word_problems.jsonl")))
    samples = _transformers_rollouts(hf)
    assert len(samples) == STEPS * ROWS_PER_STEP
    for fmt in ("vllm", "sglang"):
        write_engine_file(fmt, samples, tmp_path / f"{fmt}.jsonl", samples_per_prompt=SAMPLES)
        assert cli(["import", "--format", fmt, str(tmp_path / f"{fmt}.jsonl"), "--out", str(tmp_path / fmt),
                    "--hf-assets-path", hf]) == 0
    stores = [RolloutStore(tmp_path / fmt) for fmt in ("vllm", "sglang")]
    for i, s in enumerate(samples):  # both engines' encodings give transformers' rows back
        for st in stores:
            row = st.read(i)
            assert np.array_equal(row.tokens_T, s.tokens_T) and row.prompt_len == s.prompt_len
            assert np.array_equal(row.routes_RXK, s.routes_RXK)
            assert np.array_equal(row.logprobs_T, s.logprobs_T, equal_nan=True)

    out_path = tmp_path / "res.pt"
    run_ranks(_train, RANKS, hf, str(tmp_path / "vllm"), str(tmp_path / "run"), str(out_path))
    res = torch.load(out_path, weights_only=False)
    assert res["rl/recompute_route_mismatch"][0] == 0.0  # our router = transformers' top-k, every position
    assert res["rollout/logprob_gap"][0] < 1e-4  # transformers' log-probs at temperature 0.7
    assert res["rollouts/truncated"] == [0.0] * STEPS

    # foresight loads = brute-force bincount of transformers' routes: [micro-step, layer, source rank, expert]
    E, per_rank = 8, ROWS_PER_STEP // RANKS
    for b in range(STEPS):
        saved = torch.load(tmp_path / "run" / "loads" / f"step_{b:05d}.pt")["loads_MLSE"]
        L = samples[0].routes_RXK.shape[1]
        want = np.zeros((1, L, RANKS, E), dtype=np.int64)
        for s_rank in range(RANKS):
            for r in range(b * ROWS_PER_STEP + s_rank * per_rank, b * ROWS_PER_STEP + (s_rank + 1) * per_rank):
                for layer in range(L):
                    want[0, layer, s_rank] += np.bincount(samples[r].routes_RXK[:, layer].ravel(), minlength=E)
        # the sequence schedule may move rows between ranks: each micro-step's loads over the source ranks
        assert saved.shape == want.shape and np.array_equal(saved.numpy().sum(2), want.sum(2)), (b, saved, want)
