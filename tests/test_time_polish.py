"""foremoe's last token polish levels the ranks on the grouped GEMMs' time table (``planner/time_polish.py``).

Oracles: an exhaustive scan of every split of a shared expert between two ranks (the polish must reach the scan's
best straggler time, up to one token); on the simulator's calibrated model of the runtime's kernels
(``grouped_mm.group_ms_table``) the polish never raises a layer's straggler, keeps every expert's tokens and its
hosts, and lowers the straggler's *time* below what the token proxy (``rebalance_split_time``) leaves.
"""

from __future__ import annotations

import numpy as np
import pytest

from titan_foremoe.planner import CostModel, PlannerConfig, Topology, plan_stage
from titan_foremoe.planner.time_polish import level_time, table_ms
from titan_foremoe.simulator.calibration import load_calibration
from titan_foremoe.simulator.grouped_mm import group_ms_table, spare_row_ms


def _curve():
    return load_calibration("h100").curve(2880, 2880)


def slot_tokens_MLRC(p):
    """A plan's tokens per slot (from its tokens per expert and rank)."""
    tok = np.zeros(p.slots_MLRC.shape, dtype=np.int64)
    m, l, r, c = np.nonzero(p.slots_MLRC >= 0)
    tok[m, l, r, c] = p.assign_MLER[m, l, p.slots_MLRC[m, l, r, c], r]
    return tok


def star_layers(count: int):
    """``count`` small layers (slots [1, 3, 3], tokens, the six experts' loads n): three ranks with two owned experts
    each; rank 0, the heaviest, shares its two with the other ranks' spare slots."""
    rng = np.random.default_rng(0)
    slots = np.array([[[0, 1, -1], [2, 3, 0], [4, 5, 1]]])
    for _ in range(count):
        n = rng.integers(60, 600, size=6)
        n[:2] += 500
        tok0 = np.zeros((1, 3, 3), dtype=np.int64)
        tok0[0, 0, :2], tok0[0, 1, :2], tok0[0, 2, :2] = n[:2], n[2:4], n[4:]
        yield slots, tok0, n


def check_tokens_kept(p, loads):
    """Every expert's tokens kept, and run only where the plan holds the expert."""
    assert (p.assign_MLER.sum(axis=3) == loads.sum(axis=2)).all()
    hosts = np.zeros(p.assign_MLER.shape, dtype=bool)
    m, l, r, c = np.nonzero(p.slots_MLRC >= 0)
    hosts[m, l, p.slots_MLRC[m, l, r, c], r] = True
    assert not ((p.assign_MLER > 0) & ~hosts).any()


def test_two_ranks_reach_the_exhaustive_split():
    curve = _curve()
    table = group_ms_table(curve, 600.0)
    cost = CostModel(group_ms=table)
    rng = np.random.default_rng(0)
    for _ in range(10):
        a, b, n = (int(x) for x in rng.integers(50, 2000, size=3))
        # rank 0 owns experts 0 (a rows) and 1 (n rows, shared), rank 1 owns 2 (b rows) and hosts a copy of 1
        slots = np.array([[[0, 1, -1], [2, 3, 1]]])
        tok = np.array([[[a, n, 0], [b, 0, 0]]], dtype=np.int64)
        best = min(max(table_ms(a, table) + table_ms(n - x, table), table_ms(b, table) + table_ms(x, table))
                   for x in range(n + 1))
        got = level_time(slots, tok.copy(), 16, cost, 2)
        t = table_ms(got[0], table).sum(axis=1)
        assert got[0, 0, 1] + got[0, 1, 2] == n and got[0, 0, 0] == a and got[0, 1, 0] == b
        step = max(table_ms(n, table) / n, 1e-9) * 2  # a token or two of slack
        assert t.max() <= best + step, (a, b, n, t.max(), best)


def test_planner_levels_time_not_just_tokens():
    curve = _curve()
    rng = np.random.default_rng(1)
    loads = rng.poisson(rng.lognormal(4.0, 1.0, size=(2, 6, 8, 32))).astype(np.int64)
    per_slot = float(loads.sum(axis=2).mean())
    base = CostModel(slot_overhead_tokens=40)
    timed = CostModel(slot_overhead_tokens=40, group_ms=group_ms_table(curve, per_slot),
                      spare_row_ms=spare_row_ms(curve))
    topo = Topology.from_ranks(8, 8)
    one = PlannerConfig(slot_cost_starts=(1.0,))  # one start: the same copies with and without the table
    p0 = plan_stage("foremoe", loads, topo, one, base, micro_steps_per_step=2)
    p1 = plan_stage("foremoe", loads, topo, one, timed, micro_steps_per_step=2)
    assert (p1.slots_MLRC == p0.slots_MLRC).all()  # the same copies: only tokens move
    check_tokens_kept(p1, loads)

    def straggler(p):
        tok = p.assign_MLER.transpose(0, 1, 3, 2)
        return (curve.rank_ms(tok, False) + curve.rank_ms(tok, True)).max(axis=2)

    s0, s1 = straggler(p0), straggler(p1)
    assert (s1 <= s0 + 1e-9).mean() > 0.9 and s1.mean() < s0.mean()


def test_slot_cost_starts_keep_each_layers_fastest_plan():
    """Planned from several multiples of the slot cost, each layer keeps the start whose straggler is fastest on
    the table (with ``slot_cost_starts_gap`` only where the first start left it that far above its mean rank): never slower than
    the one start alone (layer by layer, and on the simulator's kernel model, which
    the table was taken from, on most layers), every expert's tokens kept, tokens only where the plan hosts."""
    curve = _curve()
    rng = np.random.default_rng(2)
    loads = rng.poisson(rng.lognormal(5.0, 1.0, size=(3, 8, 8, 32))).astype(np.int64)
    per_slot = float(loads.sum(axis=2).mean())
    cost = CostModel(slot_overhead_tokens=60, group_ms=group_ms_table(curve, per_slot),
                     spare_row_ms=spare_row_ms(curve))
    topo = Topology.from_ranks(8, 8)
    one = plan_stage("foremoe", loads, topo, PlannerConfig(slot_cost_starts=(1.0,)), cost, micro_steps_per_step=3)
    starts = (0.5, 1.0, 2.0)
    many = plan_stage("foremoe", loads, topo, PlannerConfig(slot_cost_starts=starts), cost, micro_steps_per_step=3)
    gap = plan_stage("foremoe", loads, topo, PlannerConfig(slot_cost_starts=starts, slot_cost_starts_gap=0.01), cost,
                     micro_steps_per_step=3)
    assert PlannerConfig().slot_cost_starts == (1.0,)  # opt-in: 2.3-2.9x the planning time (docs/simulator.md)
    check_tokens_kept(many, loads)

    def table_top(p):
        tok = slot_tokens_MLRC(p)
        extra = np.where(np.arange(tok.shape[3]) >= 4, cost.spare_row_ms, 0.0)
        return (table_ms(tok, cost.group_ms) + extra * tok).sum(axis=3).max(axis=2)

    def kernel_top(p):
        tok = p.assign_MLER.transpose(0, 1, 3, 2)
        return (curve.rank_ms(tok, False) + curve.rank_ms(tok, True)).max(axis=2)

    # the first micro-step starts from the same residents: per layer, the kept start is at least as fast
    assert (table_top(many)[0] <= table_top(one)[0] + 1e-9).all()
    assert (table_top(many)[0] < table_top(one)[0] - 1e-9).any()  # and the other starts win somewhere
    # with a gap of 1%, a layer the first start levelled within 1% is not planned again
    tok0 = one.assign_MLER[0].transpose(0, 2, 1)
    t0 = (table_ms(tok0, cost.group_ms)).sum(axis=2)  # owned + spare alike: close enough to pick levelled layers
    level = t0.max(axis=1) <= t0.mean(axis=1) * 1.005
    assert level.any() and (gap.assign_MLER[0][level] == one.assign_MLER[0][level]).all()
    k1, k3 = kernel_top(one), kernel_top(many)
    assert k3.mean() < k1.mean() and (k3 <= k1 + 1e-9).mean() > 0.7
    with pytest.raises(ValueError, match="slot_cost_starts"):
        PlannerConfig(slot_cost_starts=())
    with pytest.raises(ValueError, match="slot_cost_starts_gap"):
        PlannerConfig(slot_cost_starts_gap=-0.1)


def test_chain_depth_unsticks_two_ranks_tied_at_the_top():
    """Three ranks; rank 0 (the heaviest) shares one expert with each other rank's spare slot. The straggler-only
    polish moves to one co-host until the two tie at the top, then neither has a move that lowers it (each one's
    only co-host is the other); with ``chain_depth`` the rank below sheds to the third rank, making room. Oracle:
    every split of both shared experts scanned (steps of 2 tokens)."""
    table = group_ms_table(_curve(), 400.0)
    cost = CostModel(group_ms=table)
    stuck = 0
    for slots, tok0, n in star_layers(10):
        x, y = np.meshgrid(np.arange(0, n[0] + 1, 2), np.arange(0, n[1] + 1, 2), indexing="ij")
        t = np.stack([table_ms(n[0] - x, table) + table_ms(n[1] - y, table),
                      table_ms(n[2], table) + table_ms(n[3], table) + table_ms(x, table),
                      table_ms(n[4], table) + table_ms(n[5], table) + table_ms(y, table)])
        best = t.max(axis=0).min()
        slack = 4 * table[1][-1] / table[0][-1]  # a few tokens' time
        one = table_ms(level_time(slots, tok0.copy(), 12, cost, 2)[0], table).sum(axis=1).max()
        got = level_time(slots, tok0.copy(), 12, cost, 2, chain_depth=3)
        assert got[0, 0, 0] + got[0, 1, 2] == n[0] and got[0, 0, 1] + got[0, 2, 2] == n[1]
        deep = table_ms(got[0], table).sum(axis=1).max()
        assert deep <= best + slack and deep <= one + 1e-12, (n, deep, best)
        stuck += one > best + slack
    assert stuck >= 2  # the straggler-only polish is stuck on some: the case tests what depth buys
    with pytest.raises(ValueError, match="polish_chain_depth"):
        PlannerConfig(polish_chain_depth=0)


def test_the_spare_part_is_charged_where_a_spare_slot_runs_rows():
    """The planner's time (``rank_ms_LR``, ``pass_ms_QLR``) charges a rank's spare part (``CostModel.spare_part_ms``)
    only where its spare slot runs rows, as the simulator's slot path (``GroupedMMCost.slot_ms``, the runtime's
    in-place path: models/slot_swiglu.py skips the spare part without rows) charges it: the first row on the spare
    slot costs its group, its copy and the part; an owned slot's first row only its group."""
    from titan_foremoe.planner.time_polish import pass_ms_QLR, rank_ms_LR
    from titan_foremoe.simulator.grouped_mm import pass_tables, spare_part_ms

    curve = _curve()
    cost = CostModel(group_ms=group_ms_table(curve, 500.0), spare_row_ms=spare_row_ms(curve),
                     spare_part_ms=spare_part_ms(curve, 1, tokens_per_slot=500.0), passes=pass_tables(curve, 500.0))
    # the fused w1 / w3 GEMMs' shape difference (GroupedMMCost.w13_ms: not linear in the rows on the measured GEMM
    # rows) is priced once, at the typical group (500 rows), the rest as the simulator charges one row
    sim = [float(curve.slot_ms(b, 5, 1, 1.0) - curve.w13_ms(1.0, b) + curve.w13_ms(500.0, b)
                 - curve.slot_ms(b, 5, 1, 0.0)) for b in (False, True)]
    assert cost.spare_part_ms + cost.spare_row_ms == pytest.approx(sum(sim)) and sim[0] > 0 and sim[1] > 0
    assert spare_part_ms(curve, 1) + cost.spare_row_ms == pytest.approx(  # without the typical group: launches, copy
        sum(float(curve.slot_ms(b, 5, 1, 1.0, shapes=False)) for b in (False, True)))
    K = 4
    tok = np.array([[[500, 500, 500, 500, 0], [500, 500, 500, 500, 1], [501, 500, 500, 500, 0]]])  # [L, R, C]
    t = rank_ms_LR(tok, cost, K)[0]
    one_row = float(table_ms(1, cost.group_ms))
    assert t[1] - t[0] == pytest.approx(one_row + cost.spare_row_ms + cost.spare_part_ms)
    assert t[2] - t[0] == pytest.approx(float(table_ms(501, cost.group_ms) - table_ms(500, cost.group_ms)))
    q = pass_ms_QLR(tok, cost, K)[:, 0]
    parts = [p for _, _, p in cost.passes]
    assert q[:, 1] - q[:, 0] == pytest.approx([float(table_ms(1, tb)) + r + p for tb, r, p in cost.passes])
    assert sum(parts) == pytest.approx(cost.spare_part_ms)


def test_owners_landing_of_returned_gradients_is_weighed():
    """The update stage's owner pays, per layer, the landing of each replica gradient returned to it
    (``CostModel.landing_ms`` per row + ``landing_fixed_ms`` once; ``GroupedMMCost.landing_ms``, the simulator's
    charge): ``landing_LR`` counts them against a brute-force loop, a spare slot without rows or holding its own
    rank's owned expert returns nothing, and ``level_time`` levels the owner's time with its landing in: the owner
    of a shared hot expert keeps fewer rows than without it, and the straggler's time, landing included, is within
    a token or two of an exhaustive scan's."""
    from titan_foremoe.planner.time_polish import landing_LR, rank_ms_LR
    from titan_foremoe.simulator.grouped_mm import landing_prices

    curve = _curve()
    table = group_ms_table(curve, 600.0)
    land = landing_prices(curve)
    # a 50 MB gradient row, 3 launches; the compute stream's share of it beside the dense backward
    assert land["landing_ms"] > 0.04 * curve.landing_overlap and land["landing_fixed_ms"] > 0
    assert land["landing_ms"] == pytest.approx(
        float(curve.landing_ms(2.0) - curve.landing_ms(1.0)) * curve.landing_overlap)
    assert landing_prices(curve, backward=False) == {"landing_ms": 0.0, "landing_fixed_ms": 0.0}
    cost = CostModel(group_ms=table, **land)
    # rank 0 owns experts 0 (hot, copies on ranks 1 and 2) and 1; rank 1 owns 2, 3; rank 2 owns 4, 5 and its spare
    # slot holds its own expert 4 (reads its owned row: no return)
    slots = np.array([[[0, 1, -1], [2, 3, 0], [4, 5, 0]], [[0, 1, -1], [2, 3, 0], [4, 5, 4]]])
    tok = np.array([[[2000, 300, 0], [300, 300, 0], [300, 300, 1]], [[2000, 300, 0], [300, 300, 5], [300, 300, 7]]])
    want = np.zeros((2, 3))
    for l, r, c in zip(*np.nonzero((slots[:, :, 2:] >= 0) & (tok[:, :, 2:] > 0))):
        e = slots[l, r, 2 + c]
        o = [rr for rr in range(3) if e in slots[l, rr, :2]][0]
        want[l, o] += o != r
    got = landing_LR(slots, tok, 2, cost)
    assert got == pytest.approx(want * land["landing_ms"] + (want > 0) * land["landing_fixed_ms"])
    assert want.tolist() == [[1, 0, 0], [1, 0, 0]]
    assert landing_LR(slots, tok, 2, CostModel(group_ms=table)) == 0.0

    one = slots[:1].copy()
    tok1 = np.array([[[2000, 300, 0], [300, 300, 0], [300, 300, 0]]])
    one[0, 2, 2] = 0  # both spare slots hold copies of the hot expert 0
    with_land = level_time(one, tok1.copy(), 64, cost, 2)
    without = level_time(one, tok1.copy(), 64, CostModel(group_ms=table), 2)
    assert with_land[0, 0, 0] < without[0, 0, 0]  # the owner sheds more: it pays for each copy's return
    t = rank_ms_LR(with_land, cost, 2, one)[0]
    best = min(max(table_ms(2000 - x - y, table) + table_ms(300, table) + land["landing_ms"] * ((x > 0) + (y > 0))
                   + land["landing_fixed_ms"] * (x + y > 0),
                   2 * table_ms(300, table) + table_ms(x, table), 2 * table_ms(300, table) + table_ms(y, table))
               for x in range(0, 2001, 4) for y in range(0, 2001 - x, 4))
    assert t.max() <= best + 4 * float(table_ms(2000, table)) / 2000 * 2


def test_a_slots_time_is_its_table_bit_for_bit():
    """``slot_ms_fn``'s lookup (grown by doubling) gives exactly the interpolated table (``table_ms``, np.interp)
    plus each spare row's copy and the spare part where a spare slot runs rows: for row counts past its first
    size and past the grid, broadcast over slots; floats and negative counts take the sum, not the lookup."""
    from titan_foremoe.planner.time_polish import slot_ms_fn

    table = ((1, 64, 512, 2048), (0.010, 0.020, 0.090, 0.330))
    f = slot_ms_fn(table, 3e-5, 0.007, 5, 4)
    rng = np.random.default_rng(0)

    def want(n, c):
        spare = np.broadcast_to(np.asarray(c) >= 4, np.broadcast(n, c).shape)
        n = np.broadcast_to(n, spare.shape)
        t = table_ms(np.trunc(n), table)
        return np.where(spare, t + 3e-5 * n + 0.007 * (n > 0), t)

    for hi in (100, 900, 3000, 9000):  # grows past 1024 and past the grid's 2048
        n = rng.integers(0, hi, size=(7, 5))
        assert np.array_equal(f(n, np.arange(5)), want(n, np.arange(5)))
        assert np.array_equal(f(n, np.arange(5)[None, :]), want(n, np.arange(5)[None, :]))
    n = rng.integers(0, 50, size=(3, 5))
    c = rng.integers(0, 5, size=(3, 5))
    assert np.array_equal(f(n, c), want(n, c))
    assert f(np.zeros((2, 5), dtype=np.int64), np.arange(5)).tolist() == [[0.0] * 5] * 2  # an empty slot costs 0
    big = np.array([[3_000_000_000, 7, 0, 1, 5_000_000]])  # past the lookup's cap: the sum, no huge table
    assert np.array_equal(f(big, np.arange(5)), want(big, np.arange(5)))
    x = np.array([[0.0, 10.5, 700.25, 5000.0, 3.0]])
    assert np.allclose(f(x, np.arange(5)), want(x, np.arange(5)))
