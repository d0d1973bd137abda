"""``benchmarks/placement_bound.py``: the per-layer lower bound on any slot-runtime plan (issue 48's "where the last
percent goes"). Its mixed-integer program against brute force over every spare-slot placement, each split solved
as a linear program (``scipy.optimize.linprog``); the hull below the time table; foremoe's plans above the bound."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
scipy_optimize = pytest.importorskip("scipy.optimize")  # a dev dependency (pyproject.toml)

import placement_bound as pb  # noqa: E402

from titan_foremoe.planner import CostModel, PlannerConfig, Topology  # noqa: E402
from titan_foremoe.planner.time_polish import table_ms  # noqa: E402

# a group's time: a launch, a slow start (small groups), then a line: like the calibrated tables, not a line
ROWS = (1, 16, 64, 128, 256, 512, 1024, 4096)
TABLE = (ROWS, tuple(0.02 + 0.0004 * n + 0.01 * (1 - np.exp(-n / 40)) for n in ROWS))
COST = CostModel(group_ms=TABLE, spare_part_ms=0.006, spare_row_ms=0.00002, landing_ms=0.004, landing_fixed_ms=0.001)


def _brute_force(load_E, owner_E, R, S, cost, lines):
    """Least slowest-rank time over every spare placement (each rank: nothing or S of its non-owned experts) and
    every choice of which owners of replicated experts still run rows, each split an LP on the same hull."""
    E = len(load_E)
    a_H, b_H = lines
    best = np.inf
    choices = [[()] + [c for k in range(1, S + 1) for c in itertools.combinations(
        [e for e in range(E) if owner_E[e] != r], k)] for r in range(R)]
    for spare in itertools.product(*choices):
        replicated = sorted({e for r in range(R) for e in spare[r]})
        for off in itertools.product((True, False), repeat=len(replicated)):
            owner_runs = dict(zip(replicated, off))
            groups = [(e, int(owner_E[e])) for e in range(E) if owner_runs.get(e, True)]
            groups += [(e, r) for r in range(R) for e in spare[r]]
            if any(not any(g[0] == e for g in groups) for e in range(E)):
                continue
            G = len(groups)  # variables: x_G, u_G, T
            c = np.zeros(2 * G + 1)
            c[-1] = 1.0
            A_eq = np.zeros((E, 2 * G + 1))
            for g, (e, r) in enumerate(groups):
                A_eq[e, g] = 1.0
            A_ub, b_ub = [], []
            for g in range(G):
                for a, b in zip(a_H, b_H):  # u >= a + b x
                    row = np.zeros(2 * G + 1)
                    row[g], row[G + g] = b, -1.0
                    A_ub.append(row)
                    b_ub.append(-a)
            for r in range(R):
                row = np.zeros(2 * G + 1)
                row[-1] = -1.0
                const = 0.0
                for g, (e, q) in enumerate(groups):
                    if q == r:
                        row[G + g] = 1.0
                        if owner_E[e] != r:
                            row[g] = cost.spare_row_ms
                            const += cost.spare_part_ms
                landed = sum(1 for (e, q) in groups if owner_E[e] == r and q != r)
                const += landed * cost.landing_ms + (landed > 0) * cost.landing_fixed_ms
                A_ub.append(row)
                b_ub.append(-const)
            res = scipy_optimize.linprog(c, A_ub=np.array(A_ub), b_ub=b_ub, A_eq=A_eq, b_eq=load_E,
                                         bounds=[(0, None)] * (2 * G + 1), method="highs")
            if res.status == 0:
                best = min(best, res.fun)
    return best


def test_hull_is_below_the_table_and_touches_it():
    a_H, b_H = pb.hull_lines(TABLE, 3000)
    n = np.arange(1, 3001)
    hull = np.max(a_H[:, None] + b_H[:, None] * n[None, :], axis=0)
    t = table_ms(n, TABLE)
    assert np.all(hull <= t + 1e-12)
    assert np.isclose(hull[0], t[0]) and np.isclose(hull[-1], t[-1])  # the ends are hull vertices
    assert (np.abs(hull - t) < 1e-12).sum() >= len(a_H)  # it touches the table at each segment's ends


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_milp_equals_brute_force_over_every_placement(seed):
    rng = np.random.default_rng(seed)
    R, E, S = 3, 6, 1
    owner_E = np.repeat(np.arange(R), E // R)
    load_E = rng.integers(20, 400, E).astype(np.float64)
    load_E[rng.integers(E)] *= 4  # one hot expert: replicas pay
    lines = pb.hull_lines(COST.group_ms, int(load_E.max()))
    sol = pb.layer_bound(load_E, owner_E, R, S, COST, lines, time_limit=30.0)
    assert sol["optimal"]
    want = _brute_force(load_E, owner_E, R, S, COST, lines)
    assert sol["bound"] == pytest.approx(want, rel=1e-6), (sol["bound"], want)
    assert sol["value"] == pytest.approx(want, rel=1e-6)
    # its plan: owned experts first, at most S spare experts per rank, every token placed
    slots, tok = sol["slots_RC"], sol["tok_RC"]
    assert all(set(slots[r, :E // R]) == set(np.flatnonzero(owner_E == r)) for r in range(R))
    assert ((slots[:, E // R:] >= 0).sum(axis=1) <= S).all()
    placed = np.zeros(E, np.int64)
    np.add.at(placed, slots[slots >= 0], tok[slots >= 0])
    assert (placed == load_E).all()


def test_foremoe_is_above_the_bound_and_the_bound_below_the_milps_plan():
    rng = np.random.default_rng(3)
    M, L, R, E = 2, 3, 4, 8
    loads_MLSE = rng.poisson(rng.lognormal(3.5, 0.8, (1, L, 1, E)), (M, L, R, E)).astype(np.int64)
    r = pb.stage_bound(loads_MLSE, Topology(1, R), PlannerConfig(spare_slots=1), COST, None, time_limit=10.0)
    f, bnd, mp = (np.array(r[k]) for k in ("foremoe_max_ms", "bound_ms", "milp_plan_ms"))
    assert (bnd <= f + 1e-9).all() and (bnd <= mp + 1e-9).all(), r
    assert (np.array(r["foremoe_charged_ms"]) >= f - 1e-9).all()  # each pass's slowest rank, summed
