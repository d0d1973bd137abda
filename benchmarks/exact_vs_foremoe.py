"""foremoe vs the MoonEP-style ``exact`` balancer in the cluster simulator, per EP size and load skew.

    python benchmarks/exact_vs_foremoe.py --gpus 64 --out DIR [--eps 8,16,32] [--skews 0.4,0.8,1.2]

Runs ``scripts/simulate_cluster.py``'s ``run_one`` (static, exact, foremoe; ``--plan-ms 2``, exact's device planner
at ``simulate.EXACT_PLAN_US``) on the gpt-oss-20b routing trace and on synthetic Qwen3-30B-A3B loads of each
lognormal skew, at each EP size (8 GPUs per node: EP 16 and 32 cross nodes), and prints one markdown row per
setting: MoE ms per micro-step, recompute / update ms, the RL step, exact's exposed pull, and the MoE parts where
the two differ. Writes DIR/rows.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import simulate_cluster  # noqa: E402

TRACE = str(ROOT.parent / "shared" / "traces" / "gptoss20b_mmlu_routing.npz")  # ../shared beside the checkout
BALANCERS = ("static", "exact", "foremoe")


def one(source: list[str], gpus: int, ep: int) -> dict:
    a = simulate_cluster.parse_args([*source, "--gpus", str(gpus), "--gpus-per-node", "8", "--ep", str(ep),
                                     "--spare-slots", "1", "--plan-ms", "2", "--balancers", ",".join(BALANCERS),
                                     "--out", "/dev/null"])
    cal = simulate_cluster.load_calibration(a.calibration)
    return simulate_cluster.run_one(a, gpus, ep, cal)


def row(name: str, ep: int, res: dict) -> dict:
    out = {"setting": name, "ep": ep}
    for b in BALANCERS:
        s = res[b]
        out[b] = {"moe": s["moe_ms_per_microstep"], "recompute": s["recompute_ms"], "update": s["update_ms"],
                  "train": s["train_ms"], "step": s["step_ms"], "max_over_mean": s["max_over_mean"],
                  "parts": s["moe_parts_ms_per_microstep"], "exposed_transfer": s["exposed_transfer_ms"],
                  "bytes": s["transfer_bytes_per_rank"]}
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| load | EP | MoE ms/micro-step static / exact / foremoe | recompute ms exact / foremoe | update ms "
             "exact / foremoe | step ms exact / foremoe | foremoe x exact (MoE / step) | exact: exposed pull, planning "
             "(ms/micro-step) | foremoe: slot path, exposed moves, planning | imbalance exact / foremoe |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, x, f = r["static"], r["exact"], r["foremoe"]
        lines.append(
            f"| {r['setting']} | {r['ep']} | {s['moe']:.2f} / {x['moe']:.2f} / {f['moe']:.2f} | "
            f"{x['recompute']:.0f} / {f['recompute']:.0f} | {x['update']:.0f} / {f['update']:.0f} | "
            f"{x['step']:.0f} / {f['step']:.0f} | {x['moe'] / f['moe']:.3f} / {x['step'] / f['step']:.3f} | "
            f"{x['parts']['exposed_moves']:.2f}, {x['parts']['planning']:.2f} | "
            f"{f['parts']['slot_gather']:.2f}, {f['parts']['exposed_moves']:.2f}, {f['parts']['planning']:.2f} | "
            f"{x['parts']['imbalance']:.2f} / {f['parts']['imbalance']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--eps", default="8,16,32")
    ap.add_argument("--skews", default="0.4,0.8,1.2")
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sources = ([] if a.no_trace else [("gpt-oss trace", ["--trace", TRACE, "--model", "gpt_oss_20b"])]) + [
        (f"qwen3 synthetic skew {k}", ["--synthetic", "--model", "qwen3_30b_a3b", "--skew", k])
        for k in a.skews.split(",")]
    rows = []
    for ep in (int(e) for e in a.eps.split(",")):
        for name, src in sources:
            rows.append(row(name, ep, one(src, a.gpus, ep)))
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()
