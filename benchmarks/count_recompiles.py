"""RL steps eager or under torch.compile: per-step dynamo counters, graph-break reasons, losses, parameters.

2 gloo ranks, EP 2, ``train_configs/debug_tiny_rl.toml`` with bf16 experts and no SFT warm-up. With
``--compile`` the blocks run under torchtitan's per-block compile as RL configures it
(``distributed/parallelize.py: apply_rl_compile``). Writes ``DIR/summary.json``:
``graphs`` / ``frames`` / ``recompiles``: cumulative dynamo counts after each step (graphs compiled, frames
compiled, frames compiled again after their guards failed, from dynamo's ``recompiles`` log, with the first
failing guard in ``recompile_reasons``); ``graph_breaks``: reason -> count; ``steps``: each step's metrics.

    python benchmarks/count_recompiles.py --compile --backend inductor --steps 10 --out /tmp/recompiles
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def run_steps(rank, world_size, overrides, steps, out_path):
    """``steps`` RL steps on this rank; rank 0 saves counters, metrics and the full parameters."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from distributed_helpers import full
    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer

    os.chdir(ROOT)
    cfg = load_config("train_configs/debug_tiny_rl.toml", [
        "--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0", f"--training.steps={steps}",
        "--parallelism.expert_parallel_degree=2", "--model.expert_dtype=bfloat16", "--metrics.log_freq=1000",
        *overrides,
    ])
    recompiles = _count_recompiles()
    trainer = RLTrainer(cfg)
    logps = []
    recompute = trainer.recompute

    def keep_logps(batches, stage=None):  # the recomputed old log-probs, what the update's ratios start from
        res = recompute(batches, stage)
        logps.append(torch.cat([mb.old_logp_BL[mb.loss_mask_BL] for mb in batches]))
        return res

    trainer.recompute = keep_logps
    res = {"graphs": [], "frames": [], "recompiles": [], "steps": [], "seconds": []}
    for step in range(steps):
        t0 = time.perf_counter()
        res["steps"].append(trainer.rl_step(step))
        res["seconds"].append(time.perf_counter() - t0)
        res["graphs"].append(counters["stats"]["unique_graphs"])
        res["frames"].append(counters["frames"]["total"])
        res["recompiles"].append(sum(not r.startswith("LIMIT") for r in recompiles))
    res["graph_breaks"] = dict(counters["graph_break"])
    res["recompile_reasons"] = recompiles
    res["logps"] = logps
    res["params"] = {name: full(p).float() for name, p in trainer.model.named_parameters()}
    if rank == 0:
        torch.save(res, out_path)
    dist.destroy_process_group()


def _count_recompiles() -> list[str]:
    """A list that grows by one guard-failure reason per recompile (dynamo's ``recompiles`` log)."""
    import logging

    reasons: list[str] = []

    class Count(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if "Recompiling function" in msg:
                lines = msg.splitlines()
                reasons.append(" | ".join(" ".join(line.split()) for line in lines[:1] + lines[2:3]))
            elif "recompile_limit" in msg:  # dynamo gave up on a frame: it runs eagerly from now on
                reasons.append("LIMIT | " + " ".join(msg.splitlines()[0].split()))

    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(Count())
    return reasons


def max_entries_per_frame(reasons: list[str]) -> int:
    """The most cache entries any one frame holds: 1 + its recompiles (dynamo's ``[frame/entry]`` ids)."""
    per_frame: dict[str, int] = {}
    for r in reasons:
        if r.startswith("LIMIT"):
            continue
        frame = r.split("|")[0]
        per_frame[frame] = per_frame.get(frame, 1) + 1
    return max(per_frame.values(), default=1)


def run(out_path: Path, steps: int, compile_backend: str | None, extra: list[str] = ()) -> dict:
    from distributed_helpers import run_ranks

    out_path.parent.mkdir(parents=True, exist_ok=True)
    overrides = [f"--job.dump_folder={out_path.parent / 'job'}", *extra]
    if compile_backend is not None:
        overrides += ["--compile.enable=true", f"--compile.backend={compile_backend}"]
    run_ranks(run_steps, 2, overrides, steps, str(out_path))
    return torch.load(out_path, weights_only=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--balancer", default="foremoe")
    ap.add_argument("--activation-checkpoint", default="none", choices=["none", "full", "selective"],
                    help="[activation_checkpoint] mode (compiled: the block inside the checkpoint wrapper)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = run(a.out / "run.pt", a.steps, a.backend if a.compile else None, [f"--balance.balancer={a.balancer}",
                                                                  f"--activation_checkpoint.mode={a.activation_checkpoint}"])
    summary = {
        "compile": a.compile, "backend": a.backend if a.compile else "eager", "balancer": a.balancer,
        "activation_checkpoint": a.activation_checkpoint,
        "graphs": res["graphs"], "frames": res["frames"], "recompiles": res["recompiles"],
        "graph_breaks": res["graph_breaks"], "recompile_reasons": res["recompile_reasons"],
        "frames_over_recompile_limit": [r for r in res["recompile_reasons"] if r.startswith("LIMIT")],
        "max_entries_per_frame": max_entries_per_frame(res["recompile_reasons"]),
        "step_seconds": [round(s, 2) for s in res["seconds"]],
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "reward_mean": [s["rl/reward_mean"] for s in res["steps"]], "loss": [s["loss"] for s in res["steps"]],
    }
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
