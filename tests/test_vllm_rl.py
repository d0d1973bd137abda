"""A 3-step GRPO job with ``[rl] rollout_source = "vllm"`` through ``run_train.sh`` (2 gloo ranks, EP=2, fp32,
foresight placement), the trainer launching and owning a real vLLM engine.

- recompute with router replay reproduces the engine's log-probs (``rollout/logprob_gap`` <= 1e-4) and its routes
  (route mismatch 0 at step 1, fp32);
- the foresight loads the trainer planned with equal a brute-force count of the engine's routes (dumped per rank);
- every step after the first, the engine reloaded the updated policy's HF folder in place and the probe's
  log-probs matched the trainer's (else the job stops), and the two weight folders differ;
- the engine is SIGKILLed after step 1: the next call to it (reload, probe, or any rank's generation) finds it
  dead, the trainer restarts it on the current weights (``max_restarts`` = 1) and the job finishes, the final
  checkpoint loads in transformers, and no engine process outlives the job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from vllm_helpers import engine_python

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def _engine_pids(folder: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"api_server --model {folder}"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_grpo_with_a_live_vllm_engine(tmp_path):
    from safetensors.torch import load_file

    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    python = engine_python()
    hf = make_tiny_checkpoint(str(tmp_path / "tiny"), read_texts(str(ROOT / "examples/arithmetic_word_problems.jsonl")),
                              n_layers=2, head_dim=32)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": "2",
           "CONFIG_FILE": str(ROOT / "train_configs/qwen3_moe_hf_vllm.toml")}
    proc = subprocess.Popen(
        [str(ROOT / "run_train.sh"), f"--model.hf_assets_path={hf}", f"--job.dump_folder={out}",
         f"--training.steps={STEPS}", f"--rollout_engine.python={python}", "--rl.dump_rollouts=true",
         "--rollout_engine.max_restarts=1",
         "--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0",
         "--rl.reward_fn=tests.vllm_helpers:length_reward"],  # non-zero advantages: the policy changes every step
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    log, killed = [], False
    deadline = time.monotonic() + 900
    for line in proc.stdout:
        log.append(line)
        if not killed and " step   1 " in line:  # the engine dies between steps: the next sync finds it dead
            for pid in _engine_pids(out / "engine_weights"):
                os.killpg(pid, signal.SIGKILL)
            killed = True
        assert time.monotonic() < deadline, "".join(log[-50:])
    proc.wait(60)
    text = "".join(log)
    assert proc.returncode == 0, text[-5000:]
    assert killed and "died: restarting it" in text, text[-3000:]
    assert not _engine_pids(out / "engine_weights"), "the launched engine outlived the job"

    s = json.loads((out / "summary.json").read_text())
    assert s["rl/recompute_route_mismatch"][0] == 0.0
    assert max(s["rollout/logprob_gap"]) <= 1e-4, s["rollout/logprob_gap"]
    assert max(s["rollout/probe_gap"]) <= 1e-4
    # launch; the killed engine is found dead by step 2's reload, probe or generation (the kill races the job),
    # or (log relayed late) by step 3's reload: one restart, the other steps reload in place
    starts, restarts = s["rollout/engine_starts"], s["rollout/engine_restarts"]
    assert starts[0] == 1.0 and restarts[0] == 0.0 and starts[-1] == 2.0 and restarts[-1] == 1.0, (starts, restarts)
    assert starts == sorted(starts) and [b - a for a, b in zip(starts, restarts)] == [-1.0] * STEPS

    for step in range(STEPS):  # foresight loads vs a brute-force count of the engine's routes
        loads_LE = torch.load(out / "loads" / f"step_{step:05d}.pt")["loads_MLSE"].sum(dim=(0, 2)).numpy()
        count_LE = np.zeros_like(loads_LE)
        for f in sorted((out / "rollouts").glob(f"engine_routes_{step:05d}_rank*.npz")):
            routes_NXK = np.load(f)["routes_NXK"]
            for x in range(routes_NXK.shape[1]):
                for e in routes_NXK[:, x].reshape(-1):
                    count_LE[x, e] += 1
        assert count_LE.sum() > 0 and (loads_LE == count_LE).all(), (step, loads_LE, count_LE)

    w = out / "engine_weights"
    a, b = load_file(str(w / "policy_0/model-00001-of-00001.safetensors")), load_file(
        str(w / "policy_1/model-00001-of-00001.safetensors"))
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])  # the engine got updated weights
    assert not torch.equal(a["model.layers.0.mlp.experts.0.down_proj.weight"],
                           b["model.layers.0.mlp.experts.0.down_proj.weight"])

    from transformers import Qwen3MoeForCausalLM

    Qwen3MoeForCausalLM.from_pretrained(str(out / "checkpoint" / f"step-{STEPS}"), dtype=torch.float32)
