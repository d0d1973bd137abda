"""How far foremoe's plans are from the best any plan on the slot runtime could do: a lower bound per layer.

    python benchmarks/placement_bound.py --trace ../shared/traces/gptoss20b_mmlu_routing.npz --model gpt_oss_20b \\
        --gpus 64 --gpus-per-node 8 --ep 8 --spare-slots 1 --out DIR [--time-limit 2] [--micro-steps 4]

(``scripts/simulate_cluster.py``'s workload options: ``--synthetic --model qwen3_30b_a3b``,
``--response-lengths ...``, ``--max-tokens-per-micro-step ...``.) Plans the first EP group's recompute and update
stages with foremoe as the simulator does (the same ``CostModel``s, ``simulate.planner_costs``), then solves, for
every (micro-step, layer), a mixed-integer program (HiGHS through ``scipy.optimize.milp``; scipy is a dev
dependency) for the least time of the layer's slowest rank over every plan the runtime can run: the same owners,
at most S experts in a rank's spare slots, any split of each expert's tokens over its hosts. Each group's time is
bounded below by the lower convex hull of the planner's time table (``CostModel.group_ms``: within 0.5% of it at
500-3,000 rows, a few % at tens of rows), the spare part and the owners' landing as charged, rows continuous,
weight moves free. So its optimum is below every such plan's slowest rank, foremoe's included; HiGHS's dual
bound at the time limit is below that again. Prints per stage the mean per micro-step (ms, summed over layers) of:
foremoe's slowest rank on the table, the bound, and the stage's charge (each pass's slowest rank, summed); writes
DIR/bound.json. Why: issue 48 asks where the last percent to ``ideal`` goes; a plan gap the bound shows small is
not the planner's to close.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from titan_foremoe.planner import CostModel, PlannerConfig, Topology, plan_stage  # noqa: E402
from titan_foremoe.planner.time_polish import layer_ms, rank_ms_LR, table_ms  # noqa: E402

# Legend: L layers, R ranks, C slots per rank (K owned first), E experts, H hull segments, M micro-steps.


def hull_lines(table: tuple, max_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(intercepts_H, slopes_H) of the lower convex hull of one group's time (ms) at 1..max_rows rows: for every
    integer n in that range ``table_ms(n) >= max_h(a_h + b_h n)``."""
    n = np.arange(1, max(int(max_rows), 2) + 1, dtype=np.float64)
    t = table_ms(n, table)
    hull: list[int] = []
    for i in range(len(n)):  # monotone chain, lower side
        while len(hull) >= 2:
            j, k = hull[-2], hull[-1]
            if (n[k] - n[j]) * (t[i] - t[j]) - (t[k] - t[j]) * (n[i] - n[j]) > 0:
                break
            hull.pop()
        hull.append(i)
    hn, ht = n[hull], t[hull]
    b = np.diff(ht) / np.diff(hn) if len(hull) > 1 else np.zeros(1)
    a = ht[:-1] - b * hn[:-1] if len(hull) > 1 else ht
    return a, b


def layer_bound(load_E: np.ndarray, owner_E: np.ndarray, num_ranks: int, spare_slots: int, cost: CostModel,
                lines: tuple[np.ndarray, np.ndarray], time_limit: float = 2.0) -> dict:
    """The least slowest-rank time (ms) of one layer over every plan with these owners and ``spare_slots`` spare
    slots per rank, on the hull ``lines`` of the group time (``hull_lines``). Returns ``bound`` (HiGHS's dual
    bound: below the optimum), ``value`` (its best plan's objective on the hull), ``optimal``, ``slots_RC`` and
    ``tok_RC`` (that plan, integer rows)."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # a dev dependency (pyproject.toml)
    from scipy.sparse import coo_array

    E, R = len(load_E), num_ranks
    a_H, b_H = lines
    H = len(a_H)
    owned_ER = np.zeros((E, R), bool)
    owned_ER[np.arange(E), owner_E] = True
    load = np.asarray(load_E, np.float64)
    n = E * R
    ix, iz, iu, iw, iT = 0, n, 2 * n, 3 * n, 3 * n + R  # x rows, z group runs, u group ms, w owner lands, T
    nv = iT + 1
    rows, cols, vals, lo, hi = [], [], [], [], []
    k = 0

    def add(cs, vs, lb, ub):
        nonlocal k
        rows.extend([k] * len(cs)); cols.extend(cs); vals.extend(vs); lo.append(lb); hi.append(ub); k += 1

    er = np.arange(n)
    e_of, r_of = er // R, er % R
    for e in range(E):  # every token of an expert runs somewhere
        add(list(ix + e * R + np.arange(R)), [1.0] * R, load[e], load[e])
    for j in er:  # rows only where the group runs
        add([ix + j, iz + j], [1.0, -load[e_of[j]]], -np.inf, 0.0)
        for h in range(H):  # a group's time above every hull line once it runs
            add([iu + j, iz + j, ix + j], [1.0, -a_H[h], -b_H[h]], 0.0, np.inf)
    for r in range(R):  # at most S spare slots run rows
        js = [iz + e * R + r for e in range(E) if not owned_ER[e, r]]
        add(js, [1.0] * len(js), 0.0, float(spare_slots))
    for j in er:  # an owner lands its replicas' gradients (the fixed part once)
        if not owned_ER[e_of[j], r_of[j]]:
            add([iw + owner_E[e_of[j]], iz + j], [1.0, -1.0], 0.0, np.inf)
    for r in range(R):  # T above every rank's time
        cs, vs = [iT], [-1.0]
        for e in range(E):
            j = e * R + r
            cs.append(iu + j); vs.append(1.0)
            if not owned_ER[e, r]:
                cs += [iz + j, ix + j]; vs += [cost.spare_part_ms, cost.spare_row_ms]
            else:
                others = [iz + e * R + q for q in range(R) if q != r]
                cs += others; vs += [cost.landing_ms] * len(others)
        cs.append(iw + r); vs.append(cost.landing_fixed_ms)
        add(cs, vs, -np.inf, 0.0)
    A = coo_array((vals, (rows, cols)), shape=(k, nv)).tocsr()
    c = np.zeros(nv)
    c[iT] = 1.0
    integ = np.zeros(nv)
    integ[iz:iz + n] = 1
    integ[iw:iw + R] = 1
    ub = np.full(nv, np.inf)
    ub[ix:ix + n] = np.repeat(load, R)
    ub[iz:iz + n] = 1.0
    ub[iw:iw + R] = 1.0
    res = milp(c, constraints=LinearConstraint(A, lo, hi), integrality=integ, bounds=Bounds(np.zeros(nv), ub),
               options={"time_limit": float(time_limit), "mip_rel_gap": 1e-6})
    if res.x is None:
        raise RuntimeError(f"placement_bound: HiGHS found no plan in {time_limit} s ({res.message})")
    x_ER = res.x[ix:ix + n].reshape(E, R)
    z_ER = res.x[iz:iz + n].reshape(E, R) > 0.5
    K = E // R
    slots_RC = np.full((R, K + spare_slots), -1)
    tok_RC = np.zeros((R, K + spare_slots), np.int64)
    xi = np.floor(x_ER + 1e-6).astype(np.int64)
    for e in range(E):  # integer rows: the remainder to the hosts with the largest fractions
        hosts = np.flatnonzero(z_ER[e] | owned_ER[e])
        rest = int(load_E[e] - xi[e].sum())
        order = hosts[np.argsort(-(x_ER[e, hosts] - xi[e, hosts]), kind="stable")]
        for q in range(rest):
            xi[e, order[q % len(order)]] += 1
    for r in range(R):
        own = np.flatnonzero(owned_ER[:, r])
        spare = np.flatnonzero(z_ER[:, r] & ~owned_ER[:, r])
        slots_RC[r, :len(own)] = own
        slots_RC[r, K:K + len(spare)] = spare
        tok_RC[r, :len(own)] = xi[own, r]
        tok_RC[r, K:K + len(spare)] = xi[spare, r]
    bound = float(getattr(res, "mip_dual_bound", None) or res.fun)
    return {"bound": min(bound, float(res.fun)), "value": float(res.fun), "optimal": res.status == 0,
            "slots_RC": slots_RC, "tok_RC": tok_RC}


def tok_LRC_of(slots_LRC: np.ndarray, assign_LER: np.ndarray) -> np.ndarray:
    """Rows of each slot from a plan's ``slots_LRC`` and ``assign_LER``."""
    tok = np.zeros(slots_LRC.shape, np.int64)
    l, r, c = np.nonzero(slots_LRC >= 0)
    tok[l, r, c] = assign_LER[l, slots_LRC[l, r, c], r]
    return tok


def stage_bound(loads_MLSE: np.ndarray, topo: Topology, cfg: PlannerConfig, cost: CostModel,
                micro_steps_per_step: int | None, time_limit: float, micro_steps: int | None = None) -> dict:
    """foremoe's plan of the stage against the bound, per micro-step (ms summed over layers)."""
    plan = plan_stage("foremoe", loads_MLSE, topo, cfg, cost, micro_steps_per_step=micro_steps_per_step)
    M, L, _, E = loads_MLSE.shape
    R = topo.num_ranks
    K = E // R
    lines = hull_lines(cost.group_ms, int(loads_MLSE.sum(axis=2).max()))
    out = {k: [] for k in ("foremoe_max_ms", "foremoe_charged_ms", "bound_ms", "milp_plan_ms", "milp_plan_charged_ms",
                           "optimal_layers")}
    for m in range(M if micro_steps is None else min(M, micro_steps)):
        slots, tok = plan.slots_MLRC[m], tok_LRC_of(plan.slots_MLRC[m], plan.assign_MLER[m])
        out["foremoe_max_ms"].append(float(rank_ms_LR(tok, cost, K, slots).max(axis=-1).sum()))
        out["foremoe_charged_ms"].append(float(layer_ms(tok, cost, K, slots)[0].sum()))
        sols = [layer_bound(loads_MLSE[m, l].sum(axis=0), plan.owner_MLE[m, l], R, cfg.spare_slots, cost, lines,
                            time_limit) for l in range(L)]
        out["bound_ms"].append(float(sum(s["bound"] for s in sols)))
        s_LRC, t_LRC = np.stack([s["slots_RC"] for s in sols]), np.stack([s["tok_RC"] for s in sols])
        out["milp_plan_ms"].append(float(rank_ms_LR(t_LRC, cost, K, s_LRC).max(axis=-1).sum()))
        out["milp_plan_charged_ms"].append(float(layer_ms(t_LRC, cost, K, s_LRC)[0].sum()))
        out["optimal_layers"].append(int(sum(s["optimal"] for s in sols)))
    return out


def main(argv=None) -> int:
    import simulate_cluster
    from titan_foremoe.simulator.simulate import planner_costs
    from titan_foremoe.simulator.workload import merged_work

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    p.add_argument("--time-limit", type=float, default=2.0, help="HiGHS's seconds per layer (default 2)")
    p.add_argument("--micro-steps", type=int, default=None, help="bound only the first N micro-steps of each stage")
    own, rest = p.parse_known_args(argv)
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        print("placement_bound: needs scipy (a dev dependency: pip install -e '.[dev]')", file=sys.stderr)
        return 2
    a = simulate_cluster.parse_args(rest)
    cal = simulate_cluster.load_calibration(a.calibration)
    model, cluster, sched, work, *_ = simulate_cluster.build_work(a, a.gpus, a.ep)
    curve = cal.curve(model.dim, model.moe_hidden, a.expert_kernel, a.slot_path)
    rec_work = [merged_work(w, a.recompute_merge) for w in work]  # the recompute's micro-steps (--recompute-merge)
    cost = planner_costs(work, curve, a.spare_slots, a.planner_slot_tokens, True, rec_work)
    if cost["upd"].group_ms is None:
        print("placement_bound: the planner has no time table here (needs --planner-slot-tokens auto and the "
              "grouped_mm expert kernel)", file=sys.stderr)
        return 2
    cfg = PlannerConfig(spare_slots=a.spare_slots, slot_cost_starts=tuple(a.slot_cost_starts),
                        pass_polish=a.pass_polish, polish_chain_depth=a.polish_chain_depth)
    mps = len(work[0].loads_MLSE) // sched.updates_per_rollout
    topo = cluster.topology()
    t0 = time.perf_counter()
    res = {}
    for stage, steps, loads_MLSE in (("rec", None, rec_work[0].loads_MLSE), ("upd", mps, work[0].loads_MLSE)):
        r = stage_bound(loads_MLSE, topo, cfg, cost[stage], steps, own.time_limit, own.micro_steps)
        mean = {k: float(np.mean(v)) for k, v in r.items()}
        res[stage] = {"per_micro_step": r, "mean": mean}
        print(f"{stage}: per micro-step, all {work[0].loads_MLSE.shape[1]} layers: foremoe slowest rank "
              f"{mean['foremoe_max_ms']:.3f} ms (charged, passes apart {mean['foremoe_charged_ms']:.3f}), bound "
              f"{mean['bound_ms']:.3f} ms, the MILP's own plan {mean['milp_plan_ms']:.3f} ms (charged "
              f"{mean['milp_plan_charged_ms']:.3f}); foremoe above the "
              f"bound {mean['foremoe_max_ms'] - mean['bound_ms']:.3f} ms ({mean['optimal_layers']:.1f} of "
              f"{work[0].loads_MLSE.shape[1]} layers proven optimal)", flush=True)
    res["setting"] = {"argv": list(argv if argv is not None else sys.argv[1:]), "wall_s": time.perf_counter() - t0}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bound.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
