"""Time the MoE layers of the recompute and update stages under each balancer.

Replays real routes (the gpt-oss-20b trace) through the placement runtime on
EP ranks: every micro-step, each rank feeds ``--responses-per-rank`` trace
responses with their recorded experts (router replay), so loads are exactly
the trace's. For each balancer the same micro-steps run as a recompute stage
(forward) and an update stage (forward + backward, no optimizer step, so all
balancers see the same weights). Reported per balancer:

* ``moe_fwd_ms``: wall time inside the MoE layers' forward (median micro-step, max over ranks),
* ``expert_ms_straggler``: per layer, the slowest rank's grouped-GEMM time, summed over layers
  (what balancing shortens; on a shared CPU ranks time-share cores, so wall times blur it),
* ``expert_cpu_ms_straggler``: the same with each rank's grouped GEMMs (``grouped_swiglu``, slot gathers included,
  weight transfers not) timed as its thread's CPU time (``time.thread_time``, one intra-op thread): what the rank
  computed, not when the scheduler let it run,
* ``stage_ms``: whole micro-step time of each stage,
* ``exposed_transfer_ms`` / ``transfer_mb``: replica transfer time not hidden behind compute, and bytes moved,
* ``measured_max_over_mean``: per-rank expert rows measured by the runtime.

    torchrun --nproc_per_node 4 benchmarks/bench_moe_runtime.py --trace ../shared/traces/gptoss20b_mmlu_routing.npz \\
        --layers 4 --responses-per-rank 2 --micro-steps 8 --out /tmp/bench_moe

Runs on CPU (gloo) and, unchanged, on GPUs (NCCL) when launched there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_patches  # noqa: E402

torchtitan_patches.apply_all()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from titan_foremoe.config import load_config  # noqa: E402
from titan_foremoe.loads import gather_source_loads, sequence_loads  # noqa: E402
import titan_foremoe.models.moe as moe_module  # noqa: E402
from titan_foremoe.models.moe import MaskedMoE  # noqa: E402
from titan_foremoe.models.seams import routing  # noqa: E402
from titan_foremoe.placement.runtime import PlacementRuntime  # noqa: E402
from titan_foremoe.planner.balancers import plan_stage  # noqa: E402
from titan_foremoe.planner.trace import load_trace  # noqa: E402
from titan_foremoe.planner.types import CostModel, PlannerConfig, Topology  # noqa: E402
from titan_foremoe.routing_log import RoutingLog  # noqa: E402
from titan_foremoe.train.trainer import Trainer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True)
    p.add_argument("--layers", type=int, default=4, help="first N MoE layers of the trace")
    p.add_argument("--responses-per-rank", type=int, default=2)
    p.add_argument("--micro-steps", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256, help="cap on tokens per response")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--moe-hidden-dim", type=int, default=256)
    p.add_argument("--spare-slots", type=int, default=1)
    p.add_argument("--ranks-per-node", type=int, default=0)
    p.add_argument("--transfer-path", default="direct", choices=["direct", "host", "auto"])
    p.add_argument("--balancers", default="static,eplb_history,eplb_oracle,foremoe")
    p.add_argument("--expert-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


class Timers:
    """Wall time inside MoE forwards and inside each layer's grouped GEMMs, per micro-step; the grouped GEMMs
    also as thread CPU time (4 ranks time-sharing 2 cores make wall time a scheduling artefact)."""

    def __init__(self, model):
        self.moe_s = 0.0
        self.expert_s_L: list[float] = []
        self.expert_cpu_s_L: list[float] = []
        self._layer = 0
        moe_module.grouped_swiglu = self._timed_gemms(moe_module.grouped_swiglu)
        self.layers = [m for m in model.modules() if isinstance(m, MaskedMoE)]
        for i, moe in enumerate(self.layers):
            moe.register_forward_pre_hook(lambda mod, args: setattr(mod, "_t0", time.perf_counter()))
            moe.register_forward_hook(lambda mod, args, out: self._add_moe(mod))
            experts = moe.routed_experts.inner_experts
            experts.register_forward_pre_hook(lambda mod, args, i=i: self._start(i, mod, args))
            experts.register_forward_hook(lambda mod, args, out, i=i: self._add_expert(i, mod))

    def _start(self, i, mod, args):  # returns None: a pre-hook's return value would replace the inputs
        mod._t0 = time.perf_counter()
        self._layer = i

    def _timed_gemms(self, fn):
        """grouped_swiglu timed as this thread's CPU time: the GEMMs (slot gathers included), not the weight
        transfers the placement seam waits for or copies before them."""
        def timed(*args, **kwargs):
            c0 = time.thread_time()
            out = fn(*args, **kwargs)
            self.expert_cpu_s_L[self._layer] += time.thread_time() - c0
            return out
        return timed

    def reset(self):
        self.moe_s = 0.0
        self.expert_s_L = [0.0] * len(self.layers)
        self.expert_cpu_s_L = [0.0] * len(self.layers)

    def _add_moe(self, mod):
        self.moe_s += time.perf_counter() - mod._t0

    def _add_expert(self, i, mod):
        self.expert_s_L[i] += time.perf_counter() - mod._t0


def build_batches(args, experts, offsets, rank, R, num_experts):
    """Per micro-step: this rank's token ids, valid mask and replayed routes."""
    rng = np.random.default_rng(args.seed)
    need = args.micro_steps * R * args.responses_per_rank
    order = rng.permutation(len(offsets) - 1)[:need]
    if len(order) < need:
        raise ValueError(f"trace has {len(offsets) - 1} responses, {need} needed")
    batches = []
    for m in range(args.micro_steps):
        start = (m * R + rank) * args.responses_per_rank
        rows = order[start : start + args.responses_per_rank]
        routes = [torch.from_numpy(experts[offsets[i] : offsets[i + 1]][: args.max_tokens, : args.layers].astype(np.int64))
                  for i in rows]
        lengths = [len(r) + 1 for r in routes]  # a response's last token has no route
        log = RoutingLog.from_sequences(routes, lengths, num_experts)
        L = max(lengths) - 1
        mask = torch.arange(L)[None] < torch.tensor(lengths)[:, None] - 1
        tokens = torch.randint(3, 60, (len(rows), L), generator=torch.Generator().manual_seed(args.seed + m))
        batches.append((tokens, mask, log.routes_for_inputs(L), log))
    return batches


def run_stage(trainer, runtime, plan, loads_MLSE, batches, timers, backward: bool):
    model, group = trainer.model, trainer.ep_group
    rows = []
    runtime.start_stage(plan, loads_MLSE)
    for m, (tokens, mask, routes, _) in enumerate(batches):
        timers.reset()
        t0 = time.perf_counter()
        with runtime.micro_step(m), routing(model, token_mask_BL=mask, logged_BLXK=routes):
            with torch.set_grad_enabled(backward):
                out = model(tokens)
            runtime.prefetch(m + 1)
            if backward:
                out.float().pow(2).mean().backward()
        step_s = time.perf_counter() - t0
        rep = runtime.report(m)
        mine = torch.tensor([step_s, timers.moe_s, rep.transfers.exposed_s, *timers.expert_s_L,
                             *rep.measured_rows_L, *timers.expert_cpu_s_L], dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        g = torch.stack(gathered)  # [R, 3 + 2L]
        L = len(timers.expert_s_L)
        moved = torch.tensor([sum(rep.transfers.bytes_by_path.values())], dtype=torch.float64)
        dist.all_reduce(moved, group=group)
        rows_RL = g[:, 3 + L : 3 + 2 * L]
        rows.append({
            "stage_ms": float(g[:, 0].max()) * 1e3,
            "moe_fwd_ms": float(g[:, 1].max()) * 1e3,
            "exposed_transfer_ms": float(g[:, 2].max()) * 1e3,
            "expert_ms_straggler": float(g[:, 3 : 3 + L].max(0).values.sum()) * 1e3,
            "expert_cpu_ms_straggler": float(g[:, 3 + 2 * L :].max(0).values.sum()) * 1e3,
            "transfer_mb": float(moved) / 2**20,
            "measured_max_over_mean": float((rows_RL.max(0).values / rows_RL.mean(0)).mean()),
        })
        if backward:
            model.zero_grad(set_to_none=True)
    runtime.end_stage()
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {
        "transfer_mb_total": sum(r["transfer_mb"] for r in rows)
    }


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    experts, offsets, num_experts = load_trace(args.trace)
    top_k = experts.shape[2]
    if args.layers > experts.shape[1]:
        raise SystemExit(f"--layers {args.layers} exceeds the trace's {experts.shape[1]} layers")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(None, [
        f"--model.n_layers={args.layers}", f"--model.num_experts={num_experts}", f"--model.top_k={top_k}",
        f"--model.dim={args.dim}", f"--model.moe_hidden_dim={args.moe_hidden_dim}",
        f"--model.expert_dtype={args.expert_dtype}", f"--parallelism.expert_parallel_degree={world}",
        f"--training.seq_len={args.max_tokens}", "--metrics.enable_tensorboard=false",
        f"--job.dump_folder={args.out}/run",
    ])
    trainer = Trainer(cfg)
    R = trainer.resolved.ep
    ep_rank = trainer.parallel_dims.get_mesh("ep").get_local_rank() if R > 1 else 0
    topo = Topology.from_ranks(R, args.ranks_per_node or R)
    batches = build_batches(args, experts, offsets, ep_rank, R, num_experts)
    loads_MLE = torch.stack([sequence_loads(log) for _, _, _, log in batches])
    loads_MLSE = gather_source_loads(loads_MLE, trainer.ep_group).numpy()
    runtime = PlacementRuntime(trainer.model, trainer.ep_group, ep_rank, R, topo.node_of_rank_R(),
                               path=args.transfer_path, cost=CostModel())
    timers = Timers(trainer.model)
    results = {}
    history = loads_MLSE.sum(axis=(0, 2))  # eplb_history: a previous step with the same statistics
    for name in args.balancers.split(","):
        kw = {"history_LE": history} if name == "eplb_history" else {}
        t0 = time.perf_counter()
        plan = plan_stage(name, loads_MLSE, topo, PlannerConfig(spare_slots=args.spare_slots), **kw)
        plan_ms = (time.perf_counter() - t0) * 1e3 / args.micro_steps
        run_stage(trainer, runtime, plan, loads_MLSE, batches, timers, backward=True)  # warm-up
        recompute = run_stage(trainer, runtime, plan, loads_MLSE, batches, timers, backward=False)
        update = run_stage(trainer, runtime, plan, loads_MLSE, batches, timers, backward=True)
        results[name] = {"plan_ms_per_micro_step": plan_ms, "recompute": recompute, "update": update}
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        summary = {"config": vars(args), "ranks": R, "experts": num_experts, "top_k": top_k,
                   "device": str(trainer.device), "results": results}
        Path(args.out, "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"{'balancer':14} {'stage':9} {'max/mean':>8} {'moe fwd ms':>10} {'expert ms (straggler)':>21} "
              f"{'step ms':>8} {'exposed ms':>10} {'MB moved':>8}")
        for name, r in results.items():
            for stage in ("recompute", "update"):
                s = r[stage]
                print(f"{name:14} {stage:9} {s['measured_max_over_mean']:8.3f} {s['moe_fwd_ms']:10.1f} "
                      f"{s['expert_ms_straggler']:21.1f} {s['stage_ms']:8.1f} {s['exposed_transfer_ms']:10.2f} "
                      f"{s['transfer_mb_total']:8.2f}")
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
