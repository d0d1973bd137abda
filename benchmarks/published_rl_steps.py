"""The simulator against published RL step breakdowns of MoE models (docs/simulator.md, "Against published RL step
breakdowns"): each published figure's setting as its source states it (what had to be assumed is listed with it),
the simulator's phase at that setting, and the error.

    python benchmarks/published_rl_steps.py [--decode-efficiency 0.43] [--phases-only] [--markdown] [--json OUT]
    python benchmarks/published_rl_steps.py --nemo-qwen3 [--decode-efficiency 0.43] [--markdown]

``--nemo-qwen3``: the whole step at NeMo-RL's published Qwen3-30B-A3B GRPO setting (``NEMO_QWEN3``: 32 H100, 4k
max length, 64 prompts x 32 samples, on-policy and one step off-policy), on NeMo-RL's engine layout (its
performance recipes: vLLM TP2, colocated on-policy; on 2 nodes of their own one step off-policy) and on the layout
our configs launch (an engine per node, colocated with sleep level 1; 2 engines of 8 GPUs on 16 of their own,
one transfer group), with step time and tokens/s/GPU beside the published figures. Nothing is fitted on them.

Phases: the weight sync (``rollouts/engines/sync_cost.py``'s ``sync_cost``, bucketed and the earlier per-tensor
design) and the rollout (``simulator/rollout.py``) are computed here in a second; the whole step of the
Qwen3-30B-A3B row runs ``scripts/simulate_cluster.py`` at that setting (~20 s; ``--phases-only`` skips it).
``--decode-efficiency`` is the rollout knob (default 1: the kernel tables' speed); the ``fit`` row gives the value
that matches its published generation time, every other row is out of sample.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_foremoe.rollouts.engines.sync_cost import (SyncLinks, SyncSetting, expert_tensor_count,  # noqa: E402
                                                     hf_tensor_bytes, sync_cost)
from titan_foremoe.simulator.calibration import load_calibration  # noqa: E402
from titan_foremoe.simulator.models import get_model  # noqa: E402
from titan_foremoe.simulator.rollout import rollout_ms  # noqa: E402
from titan_foremoe.simulator.simulate import device_costs  # noqa: E402

NEMO = "https://github.com/NVIDIA-NeMo/RL"
PROMPT_TOKENS = 150  # assumed: OpenMathInstruct-2 prompts; the sources give the whole sequence's mean length
ENGINE_MAX_SEQS = 1024  # vLLM 0.28's max_num_seqs on H100 (rollout.py; the KV cache caps it where it must)
SIGMA = 0.5  # assumed spread of the response lengths (log-normal), capped at the sources' maximum


@dataclass(frozen=True)
class Figure:
    """One published figure: source, where and when, the setting, the phase and its value (a range: lo < hi)."""

    key: str
    source: str
    url: str
    date: str
    setting: str
    phase: str  # weight_sync | rollout | step
    lo_s: float
    hi_s: float
    model: str
    role: str = "held out"  # fit: the one figure --decode-efficiency is fitted on
    sim: dict = field(default_factory=dict)  # what the simulator needs: trainer / engine GPUs, lengths, ...
    assumed: str = ""


FIGURES = (
    Figure("nemo_reshard_qwen3", "NeMo-RL, NCCL reshard refit design doc (Expected Performance)",
           f"{NEMO}/blob/main/docs/design-docs/nccl-reshard-refit.md", "2026-07-28 (read at 2026-08-19)",
           "H100, Qwen3-30B-A3B bf16, trainer EP8 x PP2 (16 GPUs) -> vLLM TP8 x DP2 (16 GPUs), non-colocated",
           "weight_sync", 0.74, 1.00, "qwen3_30b_a3b", sim={"T": 16, "E": 16, "g": 8},
           assumed="their design sends each engine rank its own shard; ours broadcasts every byte to every worker"),
    Figure("nemo_reshard_dsv3", "NeMo-RL, NCCL reshard refit design doc (Expected Performance)",
           f"{NEMO}/blob/main/docs/design-docs/nccl-reshard-refit.md", "2026-07-28 (read at 2026-08-19)",
           "H100, DeepSeek-V3 bf16, trainer PP16 x EP16 (256 GPUs) -> vLLM TP32 x DP8 (256 GPUs), non-colocated",
           "weight_sync", 2.39, 2.83, "deepseek_v3", sim={"T": 256, "E": 256, "g": 32},
           assumed="as above"),
    Figure("nemo_nccl_dsv3", "NeMo-RL, checkpoint-engine refit guide (DeepSeek-V3 benchmark, NCCL column)",
           f"{NEMO}/blob/main/docs/guides/checkpoint-engine-refit.md", "2026-07-21",
           "H100, DeepSeek-V3 bf16, 32 policy nodes TP1/PP16/EP16 (256 GPUs) -> 4 rollout nodes vLLM TP32 (32 GPUs), "
           "async refit timer", "weight_sync", 14.21, 14.21, "deepseek_v3", sim={"T": 256, "E": 32, "g": 32},
           assumed="their refit timer spans vLLM's loading (69.95 GiB per rank in 18 batches in the benchmark's "
                   "description), which sync_cost does not charge"),
    Figure("vime_slime_qwen3", "vime issue #175 (slime's colocated flattened-bucket IPC sync, measured beside vime's)",
           "https://github.com/vllm-project/vime/issues/175", "2026-06-07",
           "H200, Qwen3-30B-A3B bf16, 8 GPUs colocated, trainer TP4 x CP2 x EP8, 115 buckets; the sync loop "
           "(21-26 s with the engine's pause, flush and barriers around it)", "weight_sync", 3.0, 3.0,
           "qwen3_30b_a3b", sim={"T": 8, "E": 0, "g": 8, "calibration": "h200"},
           assumed="one engine of the node's 8 GPUs; the loop includes the engine's load_weights (2.5 s of it), "
                   "which sync_cost does not charge"),
    Figure("nemo_dsv3_gen", "NeMo-RL PR #2779 (DSV3 perf recipe, H100 baseline row)", f"{NEMO}/pull/2779",
           "2026-06-11", "H100, DeepSeek-V3 bf16, 256 GPUs colocated, vLLM TP32 (8 engines), 512 samples, "
           "mean sequence 701 tokens, at most 1,536 (the v0.6 performance table's DSV3 on-policy row)",
           "rollout", 57.4, 57.4, "deepseek_v3", role="fit",
           sim={"gpus": 256, "engine_gpus": 32, "n": 512, "mean_seq": 701, "max_seq": 1536},
           assumed=f"{PROMPT_TOKENS}-token prompts; log-normal response lengths (sigma {SIGMA}) of the table's mean, "
                   "capped at its maximum; the PR's run uses the table's setting"),
    Figure("nemo_qwen3_step", "NeMo-RL performance summary, v0.6 table (H100 BF16, Qwen3-30B-A3B on-policy)",
           f"{NEMO}/blob/main/docs/about/performance-summary.md", "2026-04-29",
           "H100, Qwen3-30B-A3B bf16, 32 GPUs colocated, vLLM TP2 (16 engines), trainer TP1 EP8, 2,048 samples "
           "(4 optimizer steps of 512), mean sequence 3,203 tokens, at most 4,096", "step", 192.0, 192.0,
           "qwen3_30b_a3b", sim={"gpus": 32, "engine_gpus": 2, "n": 2048, "mean_seq": 3203, "max_seq": 4096},
           assumed=f"{PROMPT_TOKENS}-token prompts, log-normal lengths as above; our trainer's stages (balancer "
                   "`off`) for Megatron's; one log-prob pass (NeMo may also run the reference policy's)"),
)


def response_lengths(n: int, mean_seq: float, max_seq: int, seed: int = 0) -> tuple[np.ndarray, float]:
    """n log-normal response lengths whose mean + the prompt is ``mean_seq``, capped at ``max_seq`` - prompt; and
    the log-normal median that gives them (for ``--response-lengths lognormal:MEDIAN:SIGMA:CAP``)."""
    cap, mean = max_seq - PROMPT_TOKENS, mean_seq - PROMPT_TOKENS
    lo, hi = 1.0, float(cap) * 10
    for _ in range(60):  # the capped mean grows with the median: bisect
        med = (lo * hi) ** 0.5
        x = np.clip(np.rint(np.random.default_rng(seed).lognormal(np.log(med), SIGMA, n)), 1, cap)
        lo, hi = (med, hi) if x.mean() < mean else (lo, med)
    return x, med


def sync_s(model: str, T: int, E: int, g: int, design: str, link, calibration: str | None = None) -> float:
    if calibration is not None:
        link = device_costs(load_calibration(calibration))
    spec = get_model(model)
    s = SyncSetting(design, T, E, g, 8, state_entries=12 * spec.num_layers + 3,
                    expert_tensors=expert_tensor_count(spec), load="per_tensor")  # their engines' stock loaders
    return float(sync_cost(hf_tensor_bytes(spec, 2), s, SyncLinks.of(link))["sync_s"])


def rollout_s(f: Figure, cal, link, decode_efficiency: float) -> float:
    lens, _ = response_lengths(f.sim["n"], f.sim["mean_seq"], f.sim["max_seq"])
    r = rollout_ms(get_model(f.model), cal, link, lens, f.sim["gpus"], f.sim["engine_gpus"], PROMPT_TOKENS, ENGINE_MAX_SEQS,
                   cal.hbm_GBps * 1e9, decode_efficiency)
    return float(r["rollout_ms"]) / 1e3


def step_s(f: Figure, decode_efficiency: float) -> dict:
    """The whole step at the figure's setting from scripts/simulate_cluster.py (balancer off)."""
    _, med = response_lengths(f.sim["n"], f.sim["mean_seq"], f.sim["max_seq"])
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, str(ROOT / "scripts/simulate_cluster.py"), "--synthetic", "--model", f.model,
               "--gpus", str(f.sim["gpus"]), "--gpus-per-node", "8", "--ep", "8", "--spare-slots", "1",
               "--plan-ms", "2", "--global-batch", str(f.sim["n"] // 4), "--updates-per-rollout", "4",
               "--engine-gpus", str(f.sim["engine_gpus"]), "--prompt-tokens", str(PROMPT_TOKENS),
               "--response-lengths", f"lognormal:{med:.0f}:{SIGMA}:{f.sim['max_seq'] - PROMPT_TOKENS}",
               "--decode-efficiency", str(decode_efficiency), "--engine-load", "per_tensor",  # stock loaders
               "--balancers", "off", "--out", out]
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        s = json.loads((Path(out) / "summary.json").read_text())
    off = s["off"]
    return {"step_s": off["step_ms"] / 1e3, "stage_share": off["stage_share"],
            "command": " ".join(["python"] + [str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT)) else c
                                             for c in cmd[1:-1]] + ["DIR"])}


NEMO_QWEN3_RECIPE = f"{NEMO}/blob/main/examples/configs/recipes/llm/performance/grpo-qwen3-30ba3b-4n8g.yaml"
NEMO_QWEN3 = (  # (policy, max_staleness, published step s, published tokens/s/GPU), v0.6 performance table
    ("on-policy", 0, 192.0, 1102.0),
    ("1-step off-policy", 1, 152.0, 1414.0),
)
NEMO_SAMPLES, NEMO_PROMPTS, NEMO_MEAN_SEQ, NEMO_MAX_SEQ = 2048, 64, 3203, 4096


def nemo_layouts(staleness: int) -> dict:
    """Engine layouts at NeMo-RL's setting: NeMo-RL's recipe (grpo-qwen3-30ba3b-4n8g[-async-1off].yaml: vLLM TP2;
    on-policy colocated on the 32 GPUs, 16 engines; async non-colocated, 2 nodes of engines = 8 engines, 16
    trainer GPUs, one optimizer step of 2,048) and ours (one engine per node: 4 colocated with sleep level 1, or 2 on
    16 GPUs of their own synced by one transfer group). Their loaders are vLLM's stock ones."""
    if staleness == 0:
        common = ["--global-batch", str(NEMO_SAMPLES // 4), "--updates-per-rollout", "4", "--sleep-level", "1"]
        return {"NeMo-RL's: vLLM TP2, 16 colocated engines": common + ["--engine-gpus", "2", "--engine-load",
                                                                         "per_tensor"],
                "ours: an engine per node, 4 colocated (sleep level 1)": common + ["--engine-gpus", "8"]}
    common = ["--global-batch", str(NEMO_SAMPLES), "--updates-per-rollout", "1", "--max-staleness", "1",
              "--rollout-gpus", "16"]
    return {"NeMo-RL's: vLLM TP2, 8 engines on 16 GPUs of their own": common + ["--engine-gpus", "2",
                                                                                 "--engine-load", "per_tensor"],
            "ours: 2 engines of 8 on 16 GPUs of their own, one transfer group": common + ["--engine-gpus", "8"]}


def nemo_qwen3_rows(decode_efficiency: float) -> list[dict]:
    """The whole step at NeMo-RL's Qwen3-30B-A3B setting per policy and layout (``nemo_layouts``), from
    scripts/simulate_cluster.py (balancer off); tokens/s/GPU = samples x mean sequence / step / 32 GPUs (NeMo-RL's
    definition: the tokens of the batch over the step and all GPUs)."""
    _, med = response_lengths(NEMO_SAMPLES, NEMO_MEAN_SEQ, NEMO_MAX_SEQ)
    cap = NEMO_MAX_SEQ - PROMPT_TOKENS
    rows = []
    for policy, staleness, pub_s, pub_tps in NEMO_QWEN3:
        for layout, extra in nemo_layouts(staleness).items():
            with tempfile.TemporaryDirectory() as out:
                cmd = [sys.executable, str(ROOT / "scripts/simulate_cluster.py"), "--synthetic", "--model",
                       "qwen3_30b_a3b", "--gpus", "32", "--gpus-per-node", "8", "--ep", "8", "--spare-slots", "1",
                       "--plan-ms", "2", "--prompt-tokens", str(PROMPT_TOKENS), "--response-lengths",
                       f"lognormal:{med:.0f}:{SIGMA}:{cap}", "--samples-per-prompt", str(NEMO_SAMPLES // NEMO_PROMPTS),
                       "--max-tokens", str(cap), "--decode-efficiency", str(decode_efficiency), *extra,
                       "--balancers", "off", "--out", out]
                subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
                s = json.loads((Path(out) / "summary.json").read_text())
            off, roll = s["off"], s["rollout"]
            step = off["step_ms"] / 1e3
            tps = NEMO_SAMPLES * NEMO_MEAN_SEQ / step / 32
            rows.append({"policy": policy, "layout": layout, "published_step_s": pub_s, "published_tps": pub_tps,
                         "step_s": step, "tokens_per_s_per_gpu": tps, "error": step / pub_s - 1,
                         "engines": roll["fleet"]["engines"], "stage_ms": off["stage_ms"],
                         "command": " ".join(["python"] + [str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT))
                                                           else c for c in cmd[1:-1]] + ["DIR"])})
    return rows


def nemo_markdown(rows: list[dict], decode_efficiency: float) -> list[str]:
    out = []
    for r in rows:
        st = r["stage_ms"]
        train = (st["recompute"] + st["update"] + st["optimizer"]) / 1e3
        out.append(f"| {r['policy']} | {r['layout']} | efficiency {decode_efficiency:g} | {r['published_step_s']:.0f} s / "
                   f"{r['published_tps']:,.0f} | **{r['step_s']:.0f} s / {r['tokens_per_s_per_gpu']:,.0f}** "
                   f"({r['error']:+.0%}) | {st['rollout'] / 1e3:.0f} / {st['sleep_wake'] / 1e3:.1f} / "
                   f"{st['weight_sync'] / 1e3:.2f} / {train:.0f} |")
    return out


def simulate_figures(decode_efficiency: float = 1.0, phases_only: bool = False) -> list[dict]:
    """Every figure with its simulated value(s) and error(s) (simulated / published midpoint - 1)."""
    cal = load_calibration(None)
    link = device_costs(cal)
    rows = []
    for f in FIGURES:
        sims: dict = {}
        if f.phase == "weight_sync":
            sims = {d: sync_s(f.model, f.sim["T"], f.sim["E"], f.sim["g"], d, link, f.sim.get("calibration"))
                    for d in ("bucketed", "current")}
        elif f.phase == "rollout":
            sims = {"rollout": rollout_s(f, cal, link, decode_efficiency)}
        elif not phases_only:
            st = step_s(f, decode_efficiency)
            sims = {"step": st["step_s"]}
        mid = (f.lo_s + f.hi_s) / 2
        row = {**{k: v for k, v in asdict(f).items() if k != "sim"}, "published_s": mid,
               "simulated_s": sims, "error": {k: v / mid - 1 for k, v in sims.items()}}
        if f.phase == "step" and sims:
            row["stage_share"], row["command"] = st["stage_share"], st["command"]
        rows.append(row)
    return rows


def fitted_efficiency() -> float:
    """--decode-efficiency that makes the ``fit`` figure's simulated rollout equal its published time."""
    f = next(f for f in FIGURES if f.role == "fit")
    cal = load_calibration(None)
    full = rollout_ms(get_model(f.model), cal, device_costs(cal), response_lengths(f.sim["n"], f.sim["mean_seq"],
                      f.sim["max_seq"])[0], f.sim["gpus"], f.sim["engine_gpus"], PROMPT_TOKENS, ENGINE_MAX_SEQS,
                      cal.hbm_GBps * 1e9)
    # decode scales with 1 / efficiency, prefill does not
    return float(full["decode_ms"] / (f.lo_s * 1e3 - full["prefill_ms"]))


def cell(row: dict, design: str, decode_efficiency: float) -> str:
    """The simulated cell of docs/simulator.md's table (a sync does not depend on the decode efficiency)."""
    sim, err = row["simulated_s"][design], row["error"][design]
    if row["phase"] == "weight_sync":
        return f"{row['key']} | {design} {sim:.2f} s ({err:+.0%})"
    return f"{row['key']} | efficiency {decode_efficiency:g}: {sim:.2f} s ({err:+.0%})"


def markdown(rows: list[dict], decode_efficiency: float) -> list[str]:
    out = []
    for r in rows:
        pub = f"{r['lo_s']:g}" + (f"-{r['hi_s']:g}" if r["hi_s"] != r["lo_s"] else "")
        for design in r["simulated_s"]:
            out.append(f"| [{r['source']}]({r['url']}), {r['date']} | {r['setting']} | {r['phase']} ({r['role']}) | "
                       f"{pub} s | {cell(r, design, decode_efficiency)} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode-efficiency", type=float, default=1.0)
    p.add_argument("--phases-only", action="store_true", help="skip the whole-step row (scripts/simulate_cluster.py)")
    p.add_argument("--markdown", action="store_true", help="also print docs/simulator.md's table rows")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--nemo-qwen3", action="store_true",
                   help="the whole step at NeMo-RL's Qwen3-30B-A3B setting, their layout and ours (NEMO_QWEN3)")
    a = p.parse_args()
    if not 0 < a.decode_efficiency <= 1:
        p.error(f"--decode-efficiency {a.decode_efficiency} must be in (0, 1]")
    if a.nemo_qwen3:
        rows = nemo_qwen3_rows(a.decode_efficiency)
        for r in rows:
            print(f"{r['policy']:18s} {r['layout']:64s} step {r['step_s']:6.1f} s ({r['error']:+.0%} vs "
                  f"{r['published_step_s']:.0f}), {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU (published "
                  f"{r['published_tps']:,.0f}), {r['engines']} engines")
        if a.markdown:
            print("\n".join(nemo_markdown(rows, a.decode_efficiency)))
        if a.json:
            a.json.write_text(json.dumps({"decode_efficiency": a.decode_efficiency, "rows": rows}, indent=1))
        return
    rows = simulate_figures(a.decode_efficiency, a.phases_only)
    print(f"fitted decode efficiency (on {next(f.key for f in FIGURES if f.role == 'fit')}): "
          f"{fitted_efficiency():.3f}; this run: {a.decode_efficiency}")
    for r in rows:
        sims = ", ".join(f"{k} {v:.2f} s ({r['error'][k]:+.0%})" for k, v in r["simulated_s"].items())
        pub = f"{r['lo_s']:.2f}" + (f"-{r['hi_s']:.2f}" if r["hi_s"] != r["lo_s"] else "")
        print(f"{r['key']:<20} {r['phase']:<12} published {pub} s | simulated {sims or '-'} [{r['role']}]")
        if "stage_share" in r:
            print("    shares: " + ", ".join(f"{k} {v:.1%}" for k, v in r["stage_share"].items() if v))
    if a.markdown:
        print("\n".join(markdown(rows, a.decode_efficiency)))
    if a.json:
        a.json.write_text(json.dumps({"decode_efficiency": a.decode_efficiency, "fitted": fitted_efficiency(),
                                      "figures": rows}, indent=1))


if __name__ == "__main__":
    main()
