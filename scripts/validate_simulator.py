#!/usr/bin/env python
"""Compare the simulator's grouped-GEMM model with a bench_moe_runtime.py run on the same CPU.

    python scripts/calibrate_gpu.py --device cpu --models "" --shape 128x256 --clock thread --out CAL.json
    torchrun --nproc_per_node 4 benchmarks/bench_moe_runtime.py --trace TRACE --out BENCH
    python scripts/validate_simulator.py --bench BENCH/summary.json --calibration CAL.json --trace TRACE

Prints, per balancer, the predicted and measured straggler expert time as ratios to static.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_foremoe.simulator.calibration import load_calibration  # noqa: E402
from titan_foremoe.simulator.validate import predict  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", required=True, help="summary.json of benchmarks/bench_moe_runtime.py")
    p.add_argument("--calibration", required=True, help="calibrate_gpu.py JSON measured on the same machine")
    p.add_argument("--trace", required=True)
    p.add_argument("--clock", default="auto", choices=["auto", "thread", "wall"],
                   help="measured expert time: thread CPU time (expert_cpu_ms_straggler) or wall; auto: thread if recorded")
    p.add_argument("--out", default=None, help="write the comparison JSON here")
    a = p.parse_args(argv)
    try:
        res = predict(json.loads(Path(a.bench).read_text()), load_calibration(a.calibration), a.trace, a.clock)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{'balancer':14} {'predicted':>9} {'measured recompute':>18} {'measured update':>15} {'error rec':>9} {'error upd':>9}")
    for b, r in res.items():
        print(f"{b:14} {r['predicted_ratio']:9.3f} {r['measured_ratio_recompute']:18.3f} {r['measured_ratio_update']:15.3f} "
              f"{r['ratio_error_recompute']:+9.1%} {r['ratio_error_update']:+9.1%}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
