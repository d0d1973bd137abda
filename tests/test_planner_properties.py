"""Hypothesis property tests: every plan is a valid, complete, deterministic schedule."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from titan_foremoe.planner import PlannerConfig, Topology, plan_stage, source_split

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXECUTABLE = ("static", "eplb_history", "eplb_oracle", "foremoe_contiguous", "foremoe_balanced", "reactive")


@st.composite
def problems(draw):
    nodes = draw(st.sampled_from([1, 2]))
    rpn = draw(st.sampled_from([1, 2, 4]))
    R = nodes * rpn
    K = draw(st.sampled_from([1, 2, 3]))
    E = R * K
    S = draw(st.integers(0, 2))
    mps = draw(st.integers(1, 3))
    M = mps * draw(st.integers(1, 2))
    L = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["random", "one_hot", "zeros", "one_source", "huge"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    shape = (M, L, R, E)
    if kind == "random":
        loads = rng.integers(0, 60, size=shape)
    elif kind == "one_hot":  # every token on one expert: the adversarial straggler
        loads = np.zeros(shape, dtype=np.int64)
        loads[..., rng.integers(E)] = rng.integers(1, 500, size=shape[:3])
    elif kind == "zeros":
        loads = np.zeros(shape, dtype=np.int64)
    elif kind == "one_source":
        loads = np.zeros(shape, dtype=np.int64)
        loads[:, :, rng.integers(R)] = rng.integers(0, 200, size=(M, L, E))
    else:
        loads = rng.integers(0, 10**6, size=shape)
    return Topology(nodes, rpn), loads.astype(np.int64), S, mps


def _check_plan(plan, loads, topo, S, name):
    M, L, R_, E = loads.shape
    R = topo.num_ranks
    C = E // R + S
    assert plan.assign_MLER.shape == (M, L, E, R)
    assert plan.slots_MLRC.shape == (M, L, R, C)
    # every token is assigned exactly once
    assert (plan.assign_MLER >= 0).all()
    assert np.array_equal(plan.assign_MLER.sum(axis=3), loads.sum(axis=2))
    # nothing outside the model or the machine
    assert ((plan.slots_MLRC >= -1) & (plan.slots_MLRC < E)).all()
    t = plan.transfers_T
    assert ((t["src_rank"] >= 0) & (t["src_rank"] < R) & (t["dst_rank"] >= 0) & (t["dst_rank"] < R)).all()
    assert (t["src_rank"] != t["dst_rank"]).all()
    node = topo.node_of_rank_R()
    assert np.array_equal(t["inter_node"], node[t["src_rank"]] != node[t["dst_rank"]])
    # a transfer's source really held the expert before the micro-step, its target holds it after
    for row in t:
        mm, ll, e, src, dst = (int(row[k]) for k in ("micro_step", "layer", "expert", "src_rank", "dst_rank"))
        before = plan.slots_MLRC[mm - 1, ll, src] if mm > 0 else np.arange(E).reshape(R, -1)[src]
        assert e in before and e in plan.slots_MLRC[mm, ll, dst]
    # slot limits: work only where the expert is resident, at most once per rank
    hosted = np.zeros((M, L, E + 1, R), dtype=np.int64)
    m, l, r, c = np.nonzero(plan.slots_MLRC >= 0)
    np.add.at(hosted, (m, l, plan.slots_MLRC[m, l, r, c], r), 1)
    if not name.startswith("eplb"):  # EPLB's packing may put two copies of one expert on a rank
        assert hosted.max() <= 1
    assert ((plan.slots_MLRC >= 0).sum(axis=3) <= C).all()
    assert not ((plan.assign_MLER > 0) & (hosted[:, :, :E] == 0)).any()
    if name.startswith("foremoe"):
        # every expert keeps its owner, in the first E/R slots of the owner rank
        own = plan.owner_MLE
        assert np.array_equal(np.bincount(own.ravel(), minlength=R), np.full(R, M * L * E // R))
        mm, ll, ee = np.indices(own.shape)
        assert (hosted[mm, ll, ee, own] == 1).all()
        owned = np.sort(plan.slots_MLRC[..., : E // R], axis=-1)
        exp = np.argsort(own * E + np.arange(E), axis=-1, kind="stable").reshape(M, L, R, E // R)
        assert np.array_equal(owned, exp)


@SETTINGS
@given(problems())
def test_every_balancer_yields_a_valid_plan(problem):
    topo, loads, S, mps = problem
    cfg = PlannerConfig(spare_slots=S)
    for name in EXECUTABLE:
        plan = plan_stage(name, loads, topo, cfg, micro_steps_per_step=mps)
        _check_plan(plan, loads, topo, S, name)


@SETTINGS
@given(problems())
def test_foremoe_never_worse_than_static(problem):
    topo, loads, S, mps = problem
    cfg = PlannerConfig(spare_slots=S)
    static = plan_stage("static", loads, topo, cfg).rank_load_MLR.max(axis=2)
    fore = plan_stage("foremoe", loads, topo, cfg, micro_steps_per_step=mps).rank_load_MLR
    assert (fore.max(axis=2) <= static).all()
    # and never better than the ideal lower bound
    assert (fore.max(axis=2) >= -(-loads.sum(axis=(2, 3)) // topo.num_ranks)).all()


@SETTINGS
@given(problems())
def test_plans_are_deterministic(problem):
    topo, loads, S, mps = problem
    cfg = PlannerConfig(spare_slots=S, owner_policy="balanced")
    for name in ("foremoe", "eplb_history"):
        a = plan_stage(name, loads, topo, cfg, micro_steps_per_step=mps)
        b = plan_stage(name, loads.copy(), topo, cfg, micro_steps_per_step=mps)
        assert np.array_equal(a.assign_MLER, b.assign_MLER)
        assert np.array_equal(a.slots_MLRC, b.slots_MLRC)
        assert np.array_equal(a.transfers_T, b.transfers_T)


@SETTINGS
@given(problems())
def test_source_split_preserves_both_marginals(problem):
    topo, loads, S, mps = problem
    plan = plan_stage("foremoe", loads, topo, PlannerConfig(spare_slots=S), micro_steps_per_step=mps)
    node = topo.node_of_rank_R()
    for m in range(loads.shape[0]):
        for l in range(loads.shape[1]):
            t = source_split(loads[m, l], plan.assign_MLER[m, l], node)
            assert (t >= 0).all()
            assert np.array_equal(t.sum(axis=2), loads[m, l])
            assert np.array_equal(t.sum(axis=0), plan.assign_MLER[m, l])
            # locality first: a source that hosts an expert keeps as much as it can
            own = np.minimum(loads[m, l], plan.assign_MLER[m, l].T)  # [S, E]
            assert np.array_equal(t[np.arange(len(node)), :, np.arange(len(node))], own)


def test_ideal_is_the_lower_bound():
    rng = np.random.default_rng(0)
    loads = rng.integers(0, 100, size=(3, 2, 4, 8))
    topo = Topology(2, 2)
    ideal = plan_stage("ideal", loads, topo).rank_load_MLR
    assert (ideal.max(axis=2) - ideal.min(axis=2) <= 1).all()
    fore = plan_stage("foremoe", loads, topo).rank_load_MLR
    assert (fore.max(axis=2) >= ideal.max(axis=2)).all()
