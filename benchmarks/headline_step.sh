#!/bin/bash
# The README headline step figures (docs/simulator.md, "Against published RL step breakdowns"): gpt-oss trace
# on 64 H100 (all balancers) and H200, Qwen3-30B-A3B synthetic, one-step off-policy on 48 engine + 16 trainer GPUs.
# The engines as the configs launch them (rollouts/fleet/layout.py): colocated, one per node (8) put to sleep at
# level 1 around the trainer's stages; disaggregated, 6 engines of one node synced by one transfer group.
# Run from the repository root: T=TRACE O=OUT_DIR PY=python benchmarks/headline_step.sh [EXTRA simulate_cluster flags]
set -e
T=${T:-../shared/traces/gptoss20b_mmlu_routing.npz}
O=${O:-/tmp/headline_step}
PY=${PY:-python}
C="--gpus 64 --gpus-per-node 8 --ep 8 --spare-slots 1 --plan-ms 2 --reactive-plan-us 40"
S="--sleep-level 1"
$PY scripts/simulate_cluster.py --trace $T --model gpt_oss_20b $C $S "$@" --out $O/gptoss_h100
$PY scripts/simulate_cluster.py --trace $T --model gpt_oss_20b $C $S --calibration h200 --balancers off,static,foremoe,ideal "$@" --out $O/gptoss_h200
$PY scripts/simulate_cluster.py --synthetic --model qwen3_30b_a3b $C $S --balancers off,static,foremoe,ideal "$@" --out $O/qwen3_h100
$PY scripts/simulate_cluster.py --trace $T --model gpt_oss_20b $C --max-staleness 1 --rollout-gpus 48 --balancers off,static,foremoe,ideal "$@" --out $O/gptoss_async48
# foremoe's speedups (step / trainer's stages / MoE) over each balancer and foremoe's stage shares, per run
$PY - "$O" <<'PYEOF'
import json, sys
for run in ("gptoss_h100", "gptoss_h200", "qwen3_h100", "gptoss_async48"):
    s = json.load(open(f"{sys.argv[1]}/{run}/summary.json"))
    f = s["foremoe"]
    x = {b: f"{s[b]['step_ms'] / f['step_ms']:.3f} / {s[b]['train_ms'] / f['train_ms']:.3f} / "
            f"{s[b]['moe_ms_per_microstep'] / f['moe_ms_per_microstep']:.3f}" for b in ("off", "static", "reactive") if b in s}
    gap = f["train_ms"] / s["ideal"]["train_ms"] - 1
    share = ", ".join(f"{k} {v:.1%}" for k, v in f["stage_share"].items() if v)
    fl = s["rollout"]["fleet"]
    print(f"{run}: {fl['engines']} engines of {fl['gpus_per_engine']} GPUs ({'colocated' if fl['colocated'] else 'own GPUs'}); step {f['step_ms']:.0f} ms, sync {s['rollout']['weight_sync_ms']:.0f} ms ({s['rollout']['weight_sync_ms'] / f['step_ms']:.1%} "
          f"of the step); foremoe x {x}; stages {gap:+.1%} above ideal; shares of the synchronous step: {share}")
PYEOF
