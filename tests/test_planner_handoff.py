"""Whole-expert handoffs (planner/handoff.py): against a brute-force optimum on tiny layers, the plan's
invariants, and foremoe with a slot's fixed cost."""

import itertools

import numpy as np

from titan_foremoe.planner import CostModel, PlannerConfig, Topology, plan_stage
from titan_foremoe.planner.handoff import whole_handoffs
from titan_foremoe.planner.time_polish import best_in_time


def _load(tok, c0):
    return tok.sum(axis=-1) + c0 * (tok > 0).sum(axis=-1)


def test_handoffs_near_the_brute_force_optimum():
    """3 ranks x 2 owned experts + 1 spare slot: every whole-expert assignment (each rank takes at most one
    expert it does not own) enumerated; the descent's straggler is the optimum on most layers and never far."""
    R, K, S, c0, n = 3, 2, 1, 300, 60
    E = R * K
    rng = np.random.default_rng(0)
    load_LE = rng.integers(0, 2000, size=(n, E)) * (rng.random((n, E)) > 0.1)
    owned = np.broadcast_to(np.arange(E).reshape(1, R, K), (n, R, K)).copy()
    resident = np.full((n, R, S), -1)
    slot_e, tok = whole_handoffs(load_LE, owned, resident, c0)
    got = _load(tok, c0).max(axis=1)
    hosts = np.array(list(itertools.product(range(R), repeat=E)))  # [H, E] rank of each expert
    own = np.arange(E) // K
    foreign = np.stack([((hosts == r) & (own != r)).sum(axis=1) for r in range(R)], axis=1)
    feasible = (foreign <= S).all(axis=1)
    onehot = (hosts[feasible][:, :, None] == np.arange(R)).astype(np.int64)  # [H', E, R]
    x = np.where(load_LE > 0, load_LE + c0, 0)
    opt = np.einsum("ler,ne->nlr", onehot, x).max(axis=2).min(axis=1)
    start = np.stack([(x * (own == r)).sum(axis=1) for r in range(R)], axis=1).max(axis=1)
    assert (got >= opt).all() and (got <= start).all()
    assert (got == opt).mean() >= 0.9 and (got / opt).mean() < 1.01
    # invariants: each expert's tokens whole in one slot, at most S foreign experts per rank
    for l in range(n):
        live = tok[l] > 0
        assert sorted(slot_e[l][live].tolist()) == sorted(np.flatnonzero(load_LE[l]).tolist())
        assert (tok[l][live] == load_LE[l][slot_e[l][live]]).all()
        assert ((slot_e[l][:, :K] == owned[l]).all())  # owned slots keep their experts (idle when handed off)
        assert (live[:, K:].sum(axis=1) <= S).all()


def test_best_in_time_takes_the_lower_straggler_in_tokens():
    a = (np.zeros((2, 2, 1), int), np.array([[[5], [1]], [[2], [2]]]))
    b = (np.ones((2, 2, 1), int), np.array([[[3], [3]], [[4], [0]]]))
    s, t = best_in_time([a, b], CostModel(), 1)  # no time table: tokens (+ slot_overhead_tokens per slot)
    assert t.tolist() == [[[3], [3]], [[2], [2]]] and s.tolist() == [[[1], [1]], [[0], [0]]]


def test_foremoe_hands_whole_experts_with_a_slot_cost():
    """One hot expert per rank pair: with a slot's fixed cost the plan moves whole experts (no split where a
    handoff levels the ranks), the tokens stay exact, and without the cost (the trainer's default) the plan is
    the token-balancing one as before."""
    rng = np.random.default_rng(3)
    R, E, L, M = 4, 16, 3, 2
    loads = rng.integers(0, 40, size=(M, L, R, E))
    loads[:, :, :, :4] *= 6  # rank 0's experts are hot
    topo = Topology.from_ranks(R, R)
    cfg = PlannerConfig(spare_slots=1, whole_handoffs=True)
    c0 = 150
    p = plan_stage("foremoe", loads, topo, cfg, CostModel(slot_overhead_tokens=c0), micro_steps_per_step=2)
    q = plan_stage("foremoe", loads, topo, PlannerConfig(spare_slots=1, whole_handoffs=False),
                   CostModel(slot_overhead_tokens=c0), micro_steps_per_step=2)
    assert np.array_equal(p.assign_MLER.sum(axis=3), loads.sum(axis=2))
    tok_p, tok_q = (x.assign_MLER.transpose(0, 1, 3, 2) for x in (p, q))
    assert (_load(tok_p, c0).max(axis=2) <= _load(tok_q, c0).max(axis=2)).mean() >= 0.8
    assert _load(tok_p, c0).max(axis=2).sum() < _load(tok_q, c0).max(axis=2).sum()
    t0 = plan_stage("foremoe", loads, topo, cfg, CostModel(), micro_steps_per_step=2)
    t1 = plan_stage("foremoe", loads, topo, PlannerConfig(spare_slots=1, whole_handoffs=False), CostModel(),
                    micro_steps_per_step=2)
    assert np.array_equal(t0.assign_MLER, t1.assign_MLER)
