#!/usr/bin/env python
"""Trace-driven cluster simulator: what each expert balancer costs per RL step at 8-1024 GPUs.

python scripts/simulate_cluster.py --trace ../shared/traces/gptoss20b_mmlu_routing.npz --model gpt_oss_20b \\
    --gpus 64 --gpus-per-node 8 --ep 8 --spare-slots 1 --out DIR
python scripts/simulate_cluster.py --synthetic --model qwen3_30b_a3b --gpus 64 --gpus-per-node 8 --ep 8 \\
    --spare-slots 1 --out DIR [--sweep-gpus 8,16,32,64,128,256,1024]
    [--sequence-schedule balanced|rollout_order] [--no-pack] [--response-lengths lognormal:1500:1.0:8192]

One MoE layer of any shape (prints one JSON object: experts_forward_ms, forward_ms and backward_ms with
dispatch, experts, combine):
python scripts/simulate_cluster.py --layer --device h100 --hidden 2048 --moe-ffn 768 --experts 128 --top-k 8 \
    --tokens-per-rank 8192 --ep 8 [--shared-ffn S] [--gpus-per-node 8] [--distribution power_law_1.2]

Writes DIR/summary.json (and DIR/step_vs_gpus.png with --sweep-gpus). Exit code 2 on bad input.
See titan_foremoe/simulator/ for the model; calibrations/h100_measured.json (NVIDIA's measured kernel tables)
is the default device, --calibration h200 / h100_public (datasheet) for the others.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from titan_foremoe.simulator.calibration import DEFAULT_CALIBRATION, EXPERT_KERNELS, load_calibration  # noqa: E402
from titan_foremoe.simulator.models import MODELS, get_model  # noqa: E402
from titan_foremoe.simulator.simulate import ALL_BALANCERS, ClusterSpec, RolloutSpec, device_costs, simulate  # noqa: E402
from titan_foremoe.simulator.sequences import (LENGTHS_HELP, SequenceLayout, flops_cost, parse_lengths,  # noqa: E402
                                               scheduled_synthetic_work, scheduled_trace_work)
from titan_foremoe.schedule import DenseCost  # noqa: E402
from titan_foremoe.simulator.workload import RLSchedule  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="routing trace .npz (experts, offsets)")
    src.add_argument("--synthetic", action="store_true", help="synthetic skewed loads (planner.synthetic)")
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--spare-slots", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=None,
                   help="responses per optimizer step, whole cluster (default: 2 micro-steps per EP group)")
    p.add_argument("--responses-per-microstep", type=int, default=None,
                   help="responses per micro-step per EP group (default: 4 per rank)")
    p.add_argument("--updates-per-rollout", type=int, default=2)
    p.add_argument("--calibration", default=str(DEFAULT_CALIBRATION))
    p.add_argument("--nvlink-gbps", type=float, help="GB/s per direction per GPU (default: calibration)")
    p.add_argument("--ib-gbps", type=float, help="GB/s per GPU across nodes (default: calibration)")
    p.add_argument("--h2d-gbps", type=float, help="pinned host-to-device GB/s (default: calibration)")
    p.add_argument("--transfer-path", choices=("direct", "host", "auto"), default="auto")
    p.add_argument("--balancers", default=",".join(ALL_BALANCERS))
    p.add_argument("--reactive-plan-us", type=float, default=None,
                   help="planning time charged per layer to 'reactive' (default: measured, our Python planner)")
    p.add_argument("--exact-plan-us", type=float, default=None,
                   help="device planning time charged per layer to 'exact' (default: simulate.EXACT_PLAN_US)")
    p.add_argument("--plan-ms", type=float, default=None,
                   help="charge every foresight plan this many ms per micro-step instead of timing our planner here "
                        "(reproducible figures on a loaded machine; 'reactive' keeps --reactive-plan-us)")
    p.add_argument("--owner-hysteresis", type=float, default=None,
                   help="foremoe_balanced: re-place owners only if the max rank load drops by more than this x mean "
                        "(default: PlannerConfig's)")
    p.add_argument("--planner-slot-tokens", default="auto",
                   help="the planner's CostModel.slot_overhead_tokens: balance tokens + this per slot a rank runs "
                        "(default auto: a slot's fixed cost in tokens from the calibrated expert model, the one the "
                        "simulator charges, as the trainer plans by default; 0: token counts)")
    p.add_argument("--handoffs", action="store_true",
                   help="planner with whole-expert handoffs before splits (PlannerConfig.whole_handoffs; they pay "
                        "where a slot's fixed cost is about an expert's load)")
    p.add_argument("--slot-cost-starts", default="1",
                   help="comma-separated multiples of the slot's fixed cost foremoe plans each micro-step from, each "
                        "layer keeping the fastest plan on the time table (PlannerConfig.slot_cost_starts; default 1: "
                        "one start; 0.5,1,2 plans 2.3-2.9x longer for 0.1-0.2%% of the trainer's stages)")
    p.add_argument("--polish-chain-depth", type=int, default=1,
                   help="ranks per layer that may shed in foremoe's time polish when the straggler is stuck "
                        "(PlannerConfig.polish_chain_depth; 1: the straggler only; 3: 1.1-1.4x the planning time at EP 8, 2.1x at EP 64)")
    p.add_argument("--pass-polish", action="store_true",
                   help="foremoe's last polish lowers the update stage's forward and backward maxima apart, not their "
                        "sum per rank (PlannerConfig.pass_polish, [balance] pass_polish; 1.3-1.5x the update stage's planning time)")
    p.add_argument("--slot-path", choices=("gather", "inplace"), default="inplace",
                   help="how the runtime's slot GEMM reads a rank's slots: inplace (the runtime's: owned slots read in "
                        "place, the spare slots' bank rows gathered) or gather (all C slots copied per call: the "
                        "runtime before 2026-11-25 late, and EPLB-style plans)")
    p.add_argument("--expert-kernel", choices=EXPERT_KERNELS, default="grouped_mm",
                   help="measured calibrations: torch._grouped_mm as the runtime runs it (default) or vLLM's fused MoE")
    p.add_argument("--prompt-tokens", type=int, default=RolloutSpec.prompt_tokens,
                   help="rollout: prompt tokens per response (the trace holds generated tokens only)")
    p.add_argument("--engine-gpus", type=int, default=0, help="rollout: GPUs per inference engine (0: one node)")
    p.add_argument("--rollout-batch", type=int, default=RolloutSpec.max_batch,
                   help="rollout: concurrent sequences per engine (vLLM max_num_seqs: 1024, its default on GPUs of >= 70 GiB; the KV cache may cap it)")
    p.add_argument("--decode-efficiency", type=float, default=RolloutSpec.decode_efficiency,
                   help="rollout: the engine's decode speed end to end as a share of the kernel tables' (default 1; "
                        "0.43 is fitted on a published generation time, docs/simulator.md)")
    p.add_argument("--hbm-gbps", type=float, default=None,
                   help="HBM GB/s for the optimizer step and the rollout (default: the calibration's; before "
                        "2026-11-25 the simulator charged 2680)")
    p.add_argument("--max-staleness", type=int, default=0, choices=(0, 1),
                   help="[rl] max_staleness: 0 synchronous step (rollout, sync, train in turn); 1 one-step "
                        "off-policy (the engine generates step N+1 while the trainer trains step N): step_ms is then "
                        "max(rollout, train) + sync with --rollout-gpus, the synchronous step when colocated")
    p.add_argument("--weight-sync", default="bucketed", choices=("bucketed", "current", "reload"),
                   help="the weight sync's design charged (rollouts/engines/sync_cost.py)")
    p.add_argument("--weight-sync-senders", type=int, default=1,
                   help="bucketed, disaggregated: sender groups into the engine (1: vLLM's one source; > 1: "
                        "SGLang's named groups, [sglang_engine] weight_sync_senders, default 4 there)")
    p.add_argument("--engine-load", default="stacked", choices=("stacked", "per_tensor"),
                   help="the engine's load of each sync (sync_cost.engine_load_s): stacked (vLLM with our "
                        "vllm_fused_load extension, [rollout_engine] fused_expert_load, the default) or per_tensor "
                        "(the engines' stock loaders; SGLang's several senders always)")
    p.add_argument("--rollout-gpus", type=int, default=0,
                   help="GPUs of --gpus that run the inference engines only (disaggregated; the trainer gets the "
                        "rest); 0: engines and trainer share all GPUs (colocated)")
    p.add_argument("--engines", type=int, default=0,
                   help="rollout: inference engines ([rollout_engine] engines; 0: the layout's default, one per "
                        "--engine-gpus GPUs of the job colocated, --rollout-gpus / --engine-gpus disaggregated)")
    p.add_argument("--config", default=None,
                   help="take the fleet from a training config ([rollout_engine] engines, gpus_per_engine, "
                        "colocated, sleep_level; [rl] samples_per_prompt, max_new_tokens, rollout_source), as the "
                        "runtime launches it (rollouts/fleet/layout.py); explicit flags of the same meaning win")
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="rollout: responses per request (a prompt's samples go to one engine; [rl] samples_per_prompt)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="rollout: the response estimate the fleet client deals on (prompt + n x this; 0: the longest "
                        "response, the cap; [rl] max_new_tokens)")
    p.add_argument("--sleep-level", type=int, default=0, choices=(0, 1, 2),
                   help="colocated engines: [rollout_engine] sleep_level charged per step (rollout.sleep_wake_ms)")
    p.add_argument("--fleet-sync", default="one_group", choices=("one_group", "node_forward", "per_engine"),
                   help="disaggregated engines' bucketed sync (sync_cost.FLEET_DESIGNS; default one_group, what the "
                        "runtime runs: one transfer group of every engine's workers)")
    p.add_argument("--rollout-source", default="engine", choices=("engine", "embedded"),
                   help="engine: the vLLM fleet; embedded: the trainer's own loop (rollouts/generate.py, "
                        "simulator/embedded_rollout.py)")
    p.add_argument("--embedded-lockstep", default="world", choices=("world", "ep_group"),
                   help="embedded: the ranks that step together (world: the runtime's flag; ep_group: per group)")
    p.add_argument("--embedded-attention", default="math", choices=("math", "fused"),
                   help="embedded: the decode attention kernel charged (math: SDPA with a boolean mask, what runs)")
    p.add_argument("--no-rollout", action="store_true", help="step = the trainer's stages only (no rollout, no sync)")
    p.add_argument("--sequence-schedule", choices=("balanced", "rollout_order"), default="balanced",
                   help="[rl] sequence_schedule: balanced (every sequence of the step on a rank and micro-step so "
                        "each micro-step's dense work is level, titan_foremoe/schedule) or rollout_order (each rank "
                        "keeps its rows in order)")
    p.add_argument("--no-pack", action="store_true",
                   help="[training] pack_sequences = false: each rank's micro-batch is padded to its longest row and "
                        "the dense and attention work is charged on the padded positions (default: packed, real "
                        "tokens and each sequence's causal pairs)")
    p.add_argument("--max-tokens-per-micro-step", type=int, default=None,
                   help="[training] max_tokens_per_micro_step: micro-steps formed by this per-rank token budget (the "
                        "schedule's count, the same on every rank) instead of --responses-per-microstep rows")
    p.add_argument("--recompute-merge", type=int, default=1,
                   help="[rl] recompute_merge: the recompute runs every k consecutive micro-steps of a rank as one "
                        "forward (their loads, tokens and pairs summed; ideal's too); 1: the update's micro-steps")
    p.add_argument("--schedule-cost", choices=("flops", "tokens"), default="flops",
                   help="what balanced levels: flops (default, the trainer's train/sequence_plan.dense_cost: tokens, "
                        "with their dense and routed-expert FLOPs, and causal attention pairs, as the simulator "
                        "charges them) or "
                        "tokens (DenseCost(): tokens only, for comparison)")
    p.add_argument("--response-lengths", default=None, metavar=LENGTHS_HELP,
                   help="--synthetic only: every response's length from a log-normal (median, sigma, cap), e.g. "
                        "lognormal:1500:1.0:8192 (default: the synthetic model's lengths, one per source and micro-step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float, default=0.8,
                   help="--synthetic: lognormal sigma of the experts' popularity (0: uniform; 0.8 the default)")
    p.add_argument("--sweep-gpus", default=None, help="comma list of GPU counts: plot step time vs GPUs")
    p.add_argument("--sweep-ep", choices=("fixed", "grow"), default="fixed",
                   help="fixed: keep --ep; grow: EP = min(GPUs, experts) (EP across nodes)")
    p.add_argument("--best-split", action="store_true",
                   help="also search the engine / trainer split (engine-size units) and k in 1,2,4,8 with the most "
                        "tokens/s/GPU per balancer for sync_colocated, async (k steps in flight) and partial "
                        "rollouts (simulator/best_split.py); writes DIR/best_split.json; needs --rollout-gpus 0")
    p.add_argument("--rollout-token-budget", default="0.5",
                   help="--best-split's partial rollouts: comma list of [rl] rollout_token_budget values searched, a "
                        "fraction in (0, 1] of the responses in flight that must finish per step or an integer > 1 "
                        "of tokens the finished responses must hold (default 0.5)")
    p.add_argument("--partial-max-staleness", type=int, default=1,
                   help="--best-split's partial rollouts: [rl] partial_max_staleness, a response that could only "
                        "train more than this many steps after its first token is dropped (default 1)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    explicit = {x.split("=")[0] for x in (argv if argv is not None else sys.argv[1:]) if x.startswith("--")}
    if a.config:
        try:
            from_config(a, explicit)
        except (ValueError, OSError) as exc:
            p.error(f"--config {a.config}: {exc}")
    a.balancer_list = [b for b in a.balancers.split(",") if b]
    bad = [b for b in a.balancer_list if b not in ALL_BALANCERS]
    if bad or not a.balancer_list:
        p.error(f"unknown balancer(s) {bad}; choose from {list(ALL_BALANCERS)}")
    for name in ("gpus", "gpus_per_node", "ep", "updates_per_rollout", "weight_sync_senders", "recompute_merge"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.recompute_merge > 1 and a.no_pack:  # as the trainer refuses it (config/validate_rl.py)
        p.error("--recompute-merge > 1 needs packed rows (drop --no-pack): merged padded rows are not modelled")
    if a.planner_slot_tokens != "auto":
        try:
            a.planner_slot_tokens = int(a.planner_slot_tokens)
        except ValueError:
            p.error("--planner-slot-tokens must be 'auto' or an integer")
    try:
        a.slot_cost_starts = tuple(float(x) for x in str(a.slot_cost_starts).split(","))
        assert all(x > 0 for x in a.slot_cost_starts)
    except (ValueError, AssertionError):
        p.error(f"--slot-cost-starts {a.slot_cost_starts}: comma-separated positive numbers, e.g. 0.5,1,2")
    if a.spare_slots < 0 or (a.planner_slot_tokens != "auto" and a.planner_slot_tokens < 0):
        p.error("--spare-slots and --planner-slot-tokens must be >= 0")
    if a.prompt_tokens < 0 or a.engine_gpus < 0 or a.rollout_batch < 1:
        p.error("--prompt-tokens and --engine-gpus must be >= 0, --rollout-batch >= 1")
    if not 0 < a.decode_efficiency <= 1:
        p.error(f"--decode-efficiency {a.decode_efficiency} must be in (0, 1]")
    if not 0 <= a.rollout_gpus < a.gpus:
        p.error(f"--rollout-gpus {a.rollout_gpus} must be >= 0 and leave the trainer GPUs of --gpus {a.gpus}")
    try:
        a.lengths = parse_lengths(a.response_lengths)
    except ValueError as exc:
        p.error(str(exc))
    if a.lengths is not None and a.trace:
        p.error("--response-lengths applies to --synthetic loads; a trace brings its own lengths")
    if min(a.engines, a.max_tokens) < 0 or a.samples_per_prompt < 1:
        p.error("--engines and --max-tokens must be >= 0, --samples-per-prompt >= 1")
    if a.rollout_source == "embedded" and a.rollout_gpus:
        p.error("--rollout-source embedded runs on the trainer's GPUs: drop --rollout-gpus")
    if a.sleep_level and a.rollout_gpus:
        p.error("--sleep-level applies to colocated engines (--rollout-gpus 0)")
    if a.best_split and (a.rollout_gpus or a.no_rollout or a.rollout_source == "embedded"):
        p.error("--best-split searches the split itself from the colocated run: drop --rollout-gpus, --no-rollout "
                "and --rollout-source embedded")
    if a.best_split:
        from titan_foremoe.simulator.partial_rollout import Budget
        try:
            [Budget.parse(x) for x in a.rollout_token_budget.split(",") if x]
        except ValueError as exc:
            p.error(str(exc))
    if (a.rollout_gpus or a.max_staleness) and a.no_rollout:
        p.error("--rollout-gpus and --max-staleness need the rollout (drop --no-rollout)")
    return a


def from_config(a: argparse.Namespace, explicit: set) -> None:
    """Fill the rollout flags from ``a.config`` as the runtime reads it (``fleet_of``), and the flags that shape the
    trainer's stages as the config sets them (its micro-steps, their packing and merged recompute, its sequence
    schedule, spare slots and planner levers); flags given on the command line win."""
    from titan_foremoe.config.loader import load_config
    from titan_foremoe.simulator.fleet import fleet_of_config

    cfg = load_config(a.config)
    eng, rl = cfg.rollout_engine, cfg.rl
    colocated = eng.colocated
    trainer = a.gpus - (0 if colocated else a.rollout_gpus)
    lay = fleet_of_config(cfg, trainer, a.gpus_per_node)
    given = {"--engines": ("engines", lay.count), "--engine-gpus": ("engine_gpus", lay.engines[0].gpus),
             "--sleep-level": ("sleep_level", eng.sleep_level if colocated else 0),
             "--samples-per-prompt": ("samples_per_prompt", rl.samples_per_prompt),
             "--max-tokens": ("max_tokens", rl.max_new_tokens),
             "--rollout-source": ("rollout_source", "embedded" if rl.rollout_source == "embedded" else "engine")}
    t, bal = cfg.training, cfg.balance
    given |= {"--updates-per-rollout": ("updates_per_rollout", rl.updates_per_rollout),
              "--max-tokens-per-micro-step": ("max_tokens_per_micro_step", t.max_tokens_per_micro_step or None),
              "--no-pack": ("no_pack", not t.pack_sequences),
              "--recompute-merge": ("recompute_merge", rl.recompute_merge),
              "--sequence-schedule": ("sequence_schedule", rl.sequence_schedule),
              "--spare-slots": ("spare_slots", bal.spare_slots),
              "--slot-cost-starts": ("slot_cost_starts", ",".join(str(x) for x in bal.slot_cost_starts)),
              "--polish-chain-depth": ("polish_chain_depth", bal.polish_chain_depth),
              "--pass-polish": ("pass_polish", bal.pass_polish)}
    for flag, (name, value) in given.items():
        if flag not in explicit:
            setattr(a, name, value)
    if not colocated and rl.rollout_source != "embedded" and "--rollout-gpus" not in explicit:
        a.rollout_gpus = lay.engine_gpus


def parse_layer_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="simulate_cluster.py --layer", description="One MoE layer of any shape (see --help "
                                "without --layer for the cluster mode).")
    p.add_argument("--layer", action="store_true", required=True)
    p.add_argument("--device", default="h100", help="h100 | h200 (measured tables) | h100_public (datasheet) | a JSON path")
    p.add_argument("--hidden", type=int, required=True, help="model dim D")
    p.add_argument("--moe-ffn", type=int, required=True, help="routed expert hidden size F")
    p.add_argument("--experts", type=int, required=True)
    p.add_argument("--top-k", type=int, required=True)
    p.add_argument("--shared-ffn", type=int, default=0, help="shared expert hidden size (0: none)")
    p.add_argument("--tokens-per-rank", type=int, required=True)
    p.add_argument("--ep", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--distribution", default="balanced", choices=("balanced", "power_law_1.01", "power_law_1.2"))
    p.add_argument("--expert-kernel", choices=EXPERT_KERNELS, default="grouped_mm",
                   help="torch._grouped_mm as the runtime runs it (default) or vLLM's fused MoE (measured rows)")
    return p.parse_args(argv)


def layer_main(argv) -> int:
    from titan_foremoe.simulator.layer import LayerShape, layer_times

    a = parse_layer_args(argv)
    try:
        cal = load_calibration(a.device)
        shape = LayerShape(a.hidden, a.moe_ffn, a.experts, a.top_k, a.shared_ffn)
        link = device_costs(cal, min(a.ep, a.gpus_per_node))
        res = layer_times(cal, link, shape, a.tokens_per_rank, a.ep, a.gpus_per_node, a.distribution,
                          kernel=a.expert_kernel)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"device": a.device, "shape": vars(shape), "tokens_per_rank": a.tokens_per_rank, "ep": a.ep,
                      "gpus_per_node": a.gpus_per_node, **res}))
    return 0


def build_work(a: argparse.Namespace, gpus: int, ep: int, gb_scale: float = 1.0):
    """(model, trainer cluster, schedule, every EP group's work, sequence layout, engine GPUs, global batch,
    responses per micro-step) of the command line at ``gpus``: what ``run_one`` simulates (and
    ``benchmarks/placement_bound.py`` plans)."""
    model = get_model(a.model)
    roll_gpus = a.rollout_gpus * gpus // a.gpus
    if a.rollout_gpus and (a.rollout_gpus * gpus % a.gpus or not 0 < roll_gpus < gpus):
        raise ValueError(f"--rollout-gpus {a.rollout_gpus} of {a.gpus} does not scale to {gpus} GPUs")
    cluster = ClusterSpec(gpus - roll_gpus, a.gpus_per_node, ep)
    rpm = a.responses_per_microstep or 4 * ep
    gb = a.global_batch or 2 * rpm * (gpus // ep)
    gb = int(round(gb * gb_scale))
    sched = RLSchedule(gb, rpm, a.updates_per_rollout)
    layout = SequenceLayout(a.sequence_schedule, not a.no_pack, a.lengths,
                            flops_cost(model) if a.schedule_cost == "flops" else DenseCost(),
                            a.max_tokens_per_micro_step)
    if a.trace:
        # expert ids must fit the model (load_trace names the bad field); E pads up to the model's count
        work, E, seq = scheduled_trace_work(a.trace, ep, cluster.groups, sched, a.seed, layout,
                                            num_experts=model.num_experts)
    else:
        work, E, seq = scheduled_synthetic_work(a.model, ep, cluster.groups, sched, a.seed, layout, a.skew)
    if E % ep:
        raise ValueError(f"{E} experts do not divide over --ep {ep}")
    return model, cluster, sched, work, seq, roll_gpus, gb, rpm


def run_one(a: argparse.Namespace, gpus: int, ep: int, cal, gb_scale: float = 1.0, plan_ms=None) -> dict:
    """gpus: the whole cluster; with --rollout-gpus the trainer runs on the rest (the engines' share of the
    cluster kept across a sweep), and the default global batch stays the colocated cluster's (same work)."""
    model, cluster, sched, work, seq, roll_gpus, gb, rpm = build_work(a, gpus, ep, gb_scale)
    link = device_costs(cal, min(ep, a.gpus_per_node), nvlink_GBps=a.nvlink_gbps, ib_GBps=a.ib_gbps, h2d_GBps=a.h2d_gbps,
                     transfer_path=a.transfer_path)
    if plan_ms is None and a.plan_ms is not None:
        plan_ms = {b: {"rec": (a.plan_ms, None), "upd": (a.plan_ms, None)} for b in a.balancer_list if b != "reactive"}
    t0 = time.perf_counter()
    res = simulate(work, model, cluster, sched, cal, link, a.spare_slots, a.balancer_list,
                   reactive_plan_us=a.reactive_plan_us, plan_ms_given=plan_ms,
                   **({} if a.exact_plan_us is None else {"exact_plan_us": a.exact_plan_us}), owner_hysteresis=a.owner_hysteresis,
                   slot_overhead_tokens=a.planner_slot_tokens, expert_kernel=a.expert_kernel, slot_path=a.slot_path,
                   hbm_GBps=a.hbm_gbps, whole_handoffs=a.handoffs, slot_cost_starts=a.slot_cost_starts,
                   pass_polish=a.pass_polish, polish_chain_depth=a.polish_chain_depth,
                   recompute_merge=a.recompute_merge,
                   rollout=None if a.no_rollout else RolloutSpec(a.prompt_tokens, a.engine_gpus, a.rollout_batch,
                                                                 roll_gpus, a.max_staleness, a.weight_sync,
                                                                 decode_efficiency=a.decode_efficiency,
                                                                 sync_senders=a.weight_sync_senders,
                                                                 sync_load=a.engine_load, engines=a.engines * gpus // a.gpus,
                                                                 samples_per_prompt=a.samples_per_prompt,
                                                                 max_tokens=a.max_tokens, sleep_level=a.sleep_level,
                                                                 fleet_sync=a.fleet_sync, source=a.rollout_source,
                                                                 embedded_lockstep=a.embedded_lockstep,
                                                                 embedded_attention=a.embedded_attention))
    res["setting"] = {"gpus": gpus, "train_gpus": cluster.gpus, "rollout_gpus": roll_gpus, "ep": ep, "groups": cluster.groups, "gpus_per_node": a.gpus_per_node,
                      "global_batch": gb, "responses_per_microstep": rpm,
                      "updates_per_rollout": a.updates_per_rollout,
                      "micro_steps_per_step_per_group": seq.micro_steps,
                      "spare_slots": a.spare_slots, "link": vars(link), "sim_s": time.perf_counter() - t0,
                      "sequence_schedule": a.sequence_schedule, "pack": not a.no_pack, "schedule_cost": a.schedule_cost,
                      "max_tokens_per_micro_step": a.max_tokens_per_micro_step, "recompute_merge": a.recompute_merge,
                      "response_lengths": a.response_lengths or ("trace" if a.trace else "synthetic model"),
                      "schedule_micro_steps": seq.micro_steps}
    res["_lens"] = np.concatenate([w.response_lens for w in work])  # --best-split's lengths; not written
    res["_link"] = link
    return res


def print_table(res: dict, balancers) -> None:
    print(f"{'balancer':16} {'step ms':>9} {'train ms':>9} {'moe ms/us':>9} {'exposed ms':>10} {'max/mean':>8} "
          f"{'MB/rank':>8} {'owner moves/step':>16} {'relayout MB/rank/step':>21} {'relayout exposed ms':>19} "
          f"{'step x':>7} {'moe x':>7}")
    sp, mx = res.get("speedup_of_foremoe", {}), res.get("moe_speedup_of_foremoe", {})
    for b in balancers:
        s = res[b]
        x = f"{sp[b]:.3f}" if b in sp else "-"
        y = f"{mx[b]:.3f}" if b in mx else "-"
        moves = "/".join(str(n) for n in s["owner_moves_per_step"])
        mb = "/".join(f"{v / 2**20:.0f}" for v in s["owner_move_bytes_per_rank_per_step"])
        print(f"{b:16} {s['step_ms']:9.1f} {s['train_ms']:9.1f} {s['moe_ms_per_microstep']:9.2f} "
              f"{s['exposed_transfer_ms']:10.2f} {s['max_over_mean']:8.3f} {s['transfer_bytes_per_rank'] / 2**20:8.0f} "
              f"{moves:>16} {mb:>21} {s['exposed_relayout_ms']:19.2f} {x:>7} {y:>7}")
    print("step ms synchronous / one-step off-policy (overlap): " + ", ".join(
        f"{b} {res[b]['step_ms_sync']:.0f} / {res[b]['step_ms_async']:.0f} ({res[b]['overlap_ms']:.0f})"
        for b in balancers if "step_ms_sync" in res[b]))
    b = balancers[0]
    print(f"dense work ({b}): tokens max/mean {res[b]['tokens_max_over_mean']:.3f}, pairs max/mean "
          f"{res[b]['pairs_max_over_mean']:.3f}, padding {res[b]['padding_fraction']:.1%}")
    print("stage share (" + b + "): " + ", ".join(f"{k} {v:.1%}" for k, v in res[b]["stage_share"].items()))


def print_split(split: dict, balancers) -> None:
    print(f"best split of {split['setting']['gpus']} GPUs (search {split['setting']['search_s']:.1f} s): balancer, "
          "mode: engine GPUs + trainer GPUs, k, step s, tokens/s/GPU")
    for b in balancers:
        print(f"  {b:16} " + "; ".join(f"{m} {r['engine_gpus']}+{r['trainer_gpus']} k{r['k']} {r['step_s']:.2f} s "
                                       f"{r['tokens_per_s_per_gpu']:.0f}" for m, r in split[b].items()
                                       if m != "curves" and "step_s" in r))


def plot_sweep(sweep: dict, balancers, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = sorted(int(k) for k in sweep)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b in balancers:
        ax.plot(g, [sweep[str(x)][b]["step_ms"] / 1e3 for x in g], marker="o", label=b)
    ax.set_xscale("log", base=2)
    ax.set_xticks(g, [str(x) for x in g])
    ax.set_xlabel("GPUs")
    ax.set_ylabel("simulated RL step, s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--layer" in argv:
        return layer_main(argv)
    a = parse_args(argv)
    out = Path(a.out)
    try:
        cal = load_calibration(a.calibration)
        res = run_one(a, a.gpus, a.ep, cal)
        lens, link = res.pop("_lens"), res.pop("_link")
        if a.best_split:
            from titan_foremoe.simulator.best_split import search_of_run

            split = search_of_run(a, res, get_model(a.model), cal, link, lens)
            out.mkdir(parents=True, exist_ok=True)
            (out / "best_split.json").write_text(json.dumps(split, indent=1, default=float))
            print_split(split, a.balancer_list)
        summary = {"config": {k: v for k, v in vars(a).items() if k != "balancer_list"},
                   "calibration": {"path": a.calibration, "kind": cal.kind, "device": cal.raw.get("device")},
                   **res}
        print_table(res, a.balancer_list)
        if a.sweep_gpus:
            sweep = {}
            E = get_model(a.model).num_experts
            for g in [int(x) for x in a.sweep_gpus.split(",") if x]:
                ep = min(g, a.ep) if a.sweep_ep == "fixed" else min(g, E)
                scale = g / a.gpus if a.global_batch else 1.0  # weak scaling: responses per group constant
                # same EP group shape: charge the main run's planning times (one measurement, no noise)
                sweep[str(g)] = run_one(a, g, ep, cal, scale, res["plan_ms"] if ep == a.ep else None)
                sweep[str(g)].pop("_lens"), sweep[str(g)].pop("_link")
                print(f"-- {g} GPUs (ep {ep}): " + ", ".join(f"{b} {sweep[str(g)][b]['step_ms']:.0f} ms" for b in a.balancer_list))
            summary["sweep"] = sweep
            out.mkdir(parents=True, exist_ok=True)
            src = "trace " + Path(a.trace).name if a.trace else "synthetic"
            plot_sweep(sweep, a.balancer_list, out / "step_vs_gpus.png",
                       f"{a.model}, {src}, EP {a.sweep_ep} ({a.ep}), {a.spare_slots} spare slot(s), {cal.kind}")
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
