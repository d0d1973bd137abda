"""The HF example job through ``run_train.sh``: load an HF folder, SFT + GRPO on a prompt file, save an HF folder.

Run at sampling temperature 0.7, so the rollout's behaviour log-probs and the
recompute's must agree at that temperature (not at 1); the rollouts are dumped
per step; the final checkpoint loads in transformers with changed weights.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SFT, RL = 2, 2


def test_hf_job_trains_and_saves_an_hf_folder(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    hf = make_tiny_checkpoint(str(tmp_path / "tiny"), read_texts(str(ROOT / "examples/arithmetic_word_problems.jsonl")),
                              n_layers=2)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": "4",
           "CONFIG_FILE": str(ROOT / "train_configs/qwen3_moe_hf_grpo.toml")}
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), f"--model.hf_assets_path={hf}", f"--job.dump_folder={out}",
         f"--rl.sft_warmup_steps={SFT}", f"--training.steps={RL}", "--rl.temperature=0.7",
         "--metrics.enable_tensorboard=false", "--balance.balancer=off"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == SFT + RL
    assert summary["rl/recompute_route_mismatch"] == [0.0] * RL
    assert max(summary["rollout/logprob_gap"]) < 1e-4  # same temperature on both sides

    dumps = sorted((out / "rollouts").glob("step_*.jsonl"))
    assert [d.name for d in dumps] == [f"step_{s:05d}.jsonl" for s in range(SFT, SFT + RL)]
    rows = [json.loads(line) for line in dumps[0].read_text().splitlines()]
    assert len(rows) == 64 * 2  # global batch x updates per rollout
    tok = AutoTokenizer.from_pretrained(hf)
    for row in rows[:4]:
        assert {"prompt_ids", "completion_ids", "prompt", "completion", "reward", "answer"} <= set(row)
        assert row["prompt"] in tok.decode(row["prompt_ids"])

    final = out / "checkpoint" / f"step-{SFT + RL}"
    assert not (final / "sharded").exists()
    model = Qwen3MoeForCausalLM.from_pretrained(str(final), dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(str(final)).chat_template
    before = load_file(os.path.join(hf, "model.safetensors"))
    after = dict(model.state_dict())
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])  # trained
    assert before["lm_head.weight"].shape == after["lm_head.weight"].shape


def test_nan_in_an_hf_expert_weight_is_named_before_any_step(tmp_path):
    """Issue 31: the pre-flight reads safetensors headers only; one NaN in an expert's weights failed at sampling
    with torch's "probability tensor contains ... nan". The loaded weights are checked: one line, exit 2."""
    from safetensors.torch import load_file, save_file

    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    hf = make_tiny_checkpoint(str(tmp_path / "tiny"), read_texts(str(ROOT / "examples/arithmetic_word_problems.jsonl")),
                              n_layers=2)
    weights = load_file(os.path.join(hf, "model.safetensors"))
    name = next(k for k in weights if ".experts.3." in k and k.endswith("up_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": "1",
           "CONFIG_FILE": str(ROOT / "train_configs/qwen3_moe_hf_grpo.toml")}
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), f"--model.hf_assets_path={hf}", f"--job.dump_folder={tmp_path / 'run'}",
         "--parallelism.expert_parallel_degree=1", "--training.global_batch_size=8", "--rl.sft_warmup_steps=1",
         "--training.steps=1", "--metrics.enable_tensorboard=false", "--balance.balancer=off"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    *shown, last = proc.stderr.strip().splitlines()  # the launcher repeats the worker's line last (issue 40)
    (line,) = [x for x in shown if "config error" in x]
    assert last == line.removeprefix("[rank0]:"), proc.stderr[-3000:]
    assert re.fullmatch(rf"(\[rank0\]:)?config error: \[model\] hf_assets_path: {re.escape(hf)}: the loaded weights hold "
                        r"NaN or inf values: layers\.0\.\S*w3_EFD", line), line  # up_proj is our w3
    assert "probability tensor" not in proc.stderr and "step   1" not in proc.stdout
