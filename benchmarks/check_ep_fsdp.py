"""EP independent of FSDP at 8 gloo ranks (2 "nodes" x 4): ``off`` / ``static`` / ``foremoe`` agree.

Too slow for CI on two cores, so a script: it spawns ``--world`` ranks, runs ``--steps`` RL steps
of the debug job with each balancer for each layout, and prints the largest relative loss and
parameter differences from ``static``.

    python benchmarks/check_ep_fsdp.py --world 8 --ep 4 --ranks-per-node 4
    python benchmarks/check_ep_fsdp.py --world 8 --ep 4 --ranks-per-node 4 --replicate 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

BALANCERS = ("off", "static", "foremoe")


def _ranks(rank, world_size, overrides, tmp, out_path):
    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer

    results = {}
    for balancer in BALANCERS:
        t0 = time.perf_counter()
        trainer = RLTrainer(load_config("train_configs/debug_tiny_rl.toml", overrides + [
            f"--job.dump_folder={tmp}/{balancer}", f"--balance.balancer={balancer}"]))
        summary = trainer.train()
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in trainer.model.named_parameters()}
        results[balancer] = {"summary": summary, "params": params, "seconds": time.perf_counter() - t0}
        trainer.close()
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


def main() -> int:
    from distributed_helpers import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--replicate", type=int, default=1)
    ap.add_argument("--ranks-per-node", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    a, extra = ap.parse_known_args()  # extra: config overrides
    overrides = [
        "--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0", f"--training.steps={a.steps}",
        "--training.local_batch_size=2", f"--training.global_batch_size={4 * a.world}", "--rl.updates_per_rollout=1",
        "--rl.samples_per_prompt=4", "--balance.spare_slots=1", f"--parallelism.expert_parallel_degree={a.ep}",
        f"--parallelism.data_parallel_replicate_degree={a.replicate}",
        f"--balance.ranks_per_node={min(a.ranks_per_node, a.ep)}", *extra,
    ]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        t0 = time.perf_counter()
        run_ranks(_ranks, a.world, overrides, tmp, out)
        wall = time.perf_counter() - t0
        res = torch.load(out, weights_only=False)
    base = res["static"]
    print(f"world {a.world}, EP {a.ep}, dp_replicate {a.replicate}, {a.steps} RL steps, wall {wall:.0f} s")
    for name in BALANCERS:
        r = res[name]
        loss = max(abs(x - y) / max(abs(y), 1e-3) for x, y in zip(r["summary"]["loss"], base["summary"]["loss"]))
        par = max(((r["params"][p] - q).norm() / q.norm()).item() for p, q in base["params"].items())
        worst = sorted(((((r["params"][p] - q).norm() / q.norm()).item(), p) for p, q in base["params"].items()),
                       reverse=True)[:3]
        extra = f"  worst {[(p, float('%.1e' % d)) for d, p in worst]}" if worst[0][0] > 0 else ""
        if name == "foremoe":
            s = r["summary"]
            extra += (f"  rows off plan {sum(s['placement/step_rows_off_plan']):.0f}, moves {sum(s['transfer/step_moves']):.0f},"
                     f" measured max/mean {sum(s['balance/step_mean_max_over_mean']) / a.steps:.3f}")
        print(f"{name:8s} losses {['%.6f' % x for x in r['summary']['loss']]}  max rel loss diff {loss:.1e}  "
              f"max rel param diff {par:.1e}  ({r['seconds']:.0f} s){extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
