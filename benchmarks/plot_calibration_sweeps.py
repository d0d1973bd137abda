#!/usr/bin/env python
"""Side-by-side plot of simulate_cluster.py sweeps run with different calibrations (one panel each).

    python scripts/simulate_cluster.py ... --calibration h100_public --sweep-gpus 8,16,...,1024 --out A
    python scripts/simulate_cluster.py ... --calibration h100 --sweep-gpus 8,16,...,1024 --out B
    python benchmarks/plot_calibration_sweeps.py A/summary.json B/summary.json --out step_vs_gpus.png

Same balancers, same y axis in every panel, panel titles name the calibration's device and kind.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("summaries", nargs="+", help="summary.json files written with --sweep-gpus")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    runs = []
    for s in a.summaries:
        try:
            r = json.loads(Path(s).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"error: {s}: {exc}", file=sys.stderr)
            return 2
        if "sweep" not in r:
            print(f"error: {s} has no sweep (run simulate_cluster.py with --sweep-gpus)", file=sys.stderr)
            return 2
        runs.append(r)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    balancers = runs[0]["config"]["balancers"].split(",")
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4.2), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], runs):
        g = sorted(int(k) for k in r["sweep"])
        for b in balancers:
            ax.plot(g, [r["sweep"][str(x)][b]["step_ms"] / 1e3 for x in g], marker="o", ms=3, label=b)
        ax.set_xscale("log", base=2)
        ax.set_xticks(g, [str(x) for x in g])
        ax.set_xlabel("GPUs")
        c = r["calibration"]
        ax.set_title(f"{Path(c['path']).stem}: {c['kind']}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("simulated RL step, s")
    axes[0][0].legend(fontsize=7)
    if a.title:
        fig.suptitle(a.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    plt.close(fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
