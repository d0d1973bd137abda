"""Synchronous vs asynchronous RL (``[rl] max_staleness`` 0 vs 1) on the live vLLM worked example, engine and
trainer pinned to different cores: step wall time, the generation the trainer no longer waits for, the reward.

One engine (a user-run one, ``[rollout_engine] url``) is started pinned to ``--engine-cores``; each job runs with
``run_train.sh`` pinned to ``--trainer-cores``, one after the other, on the same engine and the same
checkpoint, so the two columns are a ratio from one run. Prints a table (markdown) and writes ``OUT/async.json``.

    python benchmarks/bench_async_rl.py --out /tmp/bench_async [--steps 20] [--engine-cores 1 --trainer-cores 0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cores(text: str) -> set[int]:
    return {int(c) for c in text.split(",")}


def _job(out: Path, hf: str, url: str, steps: int, cores: set[int], staleness: int, extra: list[str]) -> dict:
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable), "NGPU": "2",
           "CONFIG_FILE": str(ROOT / "train_configs/qwen3_moe_hf_vllm.toml")}
    flags = [f"--model.hf_assets_path={hf}", f"--job.dump_folder={out}", f"--rollout_engine.url={url}",
             "--rollout_engine.launch=false", f"--training.steps={steps}", "--metrics.enable_tensorboard=false",
             f"--rl.max_staleness={staleness}", "--rl.rollout_is=token", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run([str(ROOT / "run_train.sh"), *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, cores))
    if proc.returncode != 0:
        raise SystemExit(f"job failed (max_staleness {staleness}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    s = json.loads((out / "summary.json").read_text())
    s["wall_s"] = time.perf_counter() - t0
    return s


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def _median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20, help="GRPO steps per job (after the config's 10 SFT steps)")
    ap.add_argument("--engine-cores", default="1")
    ap.add_argument("--trainer-cores", default="0")
    ap.add_argument("--python", default=os.path.expanduser("~/.cache/titan_foremoe/vllm-venv/bin/python"))
    ap.add_argument("extra", nargs="*", help="more --section.key=value overrides for both jobs")
    a = ap.parse_args(argv)
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts
    from titan_foremoe.rollouts.engines.vllm_server import LaunchSpec, VLLMServer

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    hf = make_tiny_checkpoint(str(out / "tiny"), read_texts(str(ROOT / "examples/arithmetic_word_problems.jsonl")),
                              n_layers=2, head_dim=32)
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _cores(a.engine_cores))  # the engine's processes inherit it
    server = VLLMServer(LaunchSpec(python=a.python, model=hf, dtype="float32", max_model_len=256,
                                   log_path=str(out / "engine.log"),
                                   extra_args=("--enforce-eager", "--gpu-memory-utilization", "0.2")))
    try:
        url = server.start()
        os.sched_setaffinity(0, mine)
        runs = {k: _job(out / f"staleness{k}", hf, url, a.steps, _cores(a.trainer_cores), k, a.extra) for k in (0, 1)}
    finally:
        server.close()
    rows = {}
    for k, s in runs.items():
        n = len(s["rl/reward_mean"])  # GRPO steps (the history's last n entries of keys the SFT steps log too)
        pick = lambda key: s[key][-n:][1:]  # noqa: E731 - after the first (the engine's first requests)
        gen, wait = _mean(pick("rollout/generate_s")), _mean(pick("rollout/wait_s"))
        third = max(1, n // 3)
        rows[k] = {"step_s": _mean(pick("step_time_s")), "step_s_median": _median(pick("step_time_s")),
                   "generate_s": gen, "wait_s": wait, "overlap": 1 - wait / gen,
                   "reward_first_third": _mean(s["rl/reward_mean"][:third]),
                   "reward_last_third": _mean(s["rl/reward_mean"][-third:]),
                   "exact_first_third": _mean(s["rl/exact_match"][:third]),
                   "exact_last_third": _mean(s["rl/exact_match"][-third:]), "staleness": _mean(pick("rollout/staleness")),
                   "logprob_gap": _mean(pick("rollout/logprob_gap")),
                   "plan_lead_s": _mean(pick("foresight/plan_lead_s")), "wall_s": s["wall_s"],
                   "finite": all(x == x for x in s["loss"])}
    (out / "async.json").write_text(json.dumps(rows, indent=1))
    print("| | max_staleness 0 | max_staleness 1 |\n|---|---:|---:|")
    for key in rows[0]:
        print(f"| {key} | {rows[0][key]:.4g} | {rows[1][key]:.4g} |")
    print(f"step time ratio (sync / async): mean {rows[0]['step_s'] / rows[1]['step_s']:.3f}, median "
          f"{rows[0]['step_s_median'] / rows[1]['step_s_median']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
