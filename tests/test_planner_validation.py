"""Bad input fails with a ValueError that names the problem."""

import numpy as np
import pytest

from titan_foremoe.planner import PlannerConfig, Topology, plan_stage
from titan_foremoe.planner.trace import load_trace, loads_from_trace, schedule_responses, validate_trace

TOPO = Topology(2, 2)


def good_loads():
    return np.ones((2, 1, 4, 8), dtype=np.int64)


@pytest.mark.parametrize(
    "loads, match",
    [
        (-good_loads(), "negative"),
        (np.full((2, 1, 4, 8), np.nan), "NaN"),
        (np.full((2, 1, 4, 8), np.inf), "inf"),
        (np.full((2, 1, 4, 8), 0.5), "whole token counts"),
        (np.ones((2, 4, 8), dtype=np.int64), "4-D"),
        (np.ones((2, 1, 3, 8), dtype=np.int64), "source ranks"),
        (np.ones((2, 1, 4, 6), dtype=np.int64), "divide evenly"),
        (np.ones((0, 1, 4, 8), dtype=np.int64), "empty"),
        (np.array([["a"]]), "4-D"),
        ([[1]], "numpy array"),
    ],
)
@pytest.mark.parametrize("balancer", ["foremoe", "eplb_oracle", "static"])
def test_bad_loads(loads, match, balancer):
    with pytest.raises(ValueError, match=match):
        plan_stage(balancer, loads, TOPO)


def test_float_whole_counts_are_accepted():
    plan = plan_stage("foremoe", good_loads().astype(np.float32), TOPO)
    assert plan.assign_MLER.sum() == good_loads().sum()


def test_topology_that_does_not_divide():
    with pytest.raises(ValueError, match="do not divide into nodes"):
        Topology.from_ranks(6, 4)
    with pytest.raises(ValueError, match="positive int"):
        Topology(0, 2)


def test_slot_budget_smaller_than_owned_experts():
    with pytest.raises(ValueError, match="slot budget.*smaller than E/R=2"):
        plan_stage("foremoe", good_loads(), TOPO, PlannerConfig(slots_per_rank=1))
    with pytest.raises(ValueError, match="spare_slots"):
        PlannerConfig(spare_slots=-1)
    ok = plan_stage("foremoe", good_loads(), TOPO, PlannerConfig(slots_per_rank=3))
    assert ok.slots_MLRC.shape[-1] == 3


def test_bad_config_and_stage():
    with pytest.raises(ValueError, match="owner_policy"):
        PlannerConfig(owner_policy="random")
    with pytest.raises(ValueError, match="unknown balancer"):
        plan_stage("nope", good_loads(), TOPO)
    with pytest.raises(ValueError, match="micro_steps_per_step"):
        plan_stage("foremoe", good_loads(), TOPO, micro_steps_per_step=3)
    with pytest.raises(ValueError, match="history_LE"):
        plan_stage("eplb_history", good_loads(), TOPO, history_LE=np.ones((2, 8)))


def _trace(tmp_path, **over):
    fields = {
        "experts": np.zeros((10, 2, 2), dtype=np.uint8),
        "offsets": np.array([0, 4, 10], dtype=np.int64),
    }
    fields.update(over)
    fields = {k: v for k, v in fields.items() if v is not None}
    p = tmp_path / "t.npz"
    np.savez(p, **fields)
    return str(p)


@pytest.mark.parametrize(
    "over, match",
    [
        ({"experts": None}, "missing the field 'experts'"),
        ({"offsets": None}, "missing the field 'offsets'"),
        ({"experts": np.zeros((10, 2, 2), dtype=np.float32)}, "'experts' must be an integer"),
        ({"experts": np.zeros((10, 2), dtype=np.uint8)}, "'experts' must be \\[tokens"),
        ({"offsets": np.array([0, 6, 4, 10])}, "'offsets' is not monotone"),
        ({"offsets": np.array([0, 4, 9])}, "'offsets' must start at 0 and end"),
        ({"offsets": np.array([0.0, 10.0])}, "'offsets' must be a 1-D integer"),
    ],
)
def test_bad_trace(tmp_path, over, match):
    with pytest.raises(ValueError, match=match):
        load_trace(_trace(tmp_path, **over))


def test_trace_expert_out_of_range_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        validate_trace(np.full((4, 1, 1), 9, dtype=np.uint8), np.array([0, 4]), num_experts=8)
    with pytest.raises(ValueError, match="not found"):
        load_trace(str(tmp_path / "nope.npz"))


def test_trace_grouping_and_loads():
    experts = np.array([[[0, 1]], [[1, 2]], [[3, 3]], [[2, 0]]], dtype=np.uint8)  # 4 tokens, 1 layer
    offsets = np.array([0, 1, 2, 3, 4])
    resp = schedule_responses(4, global_batch=2, responses_per_microstep=2, seed=0)
    assert resp.shape == (2, 2) and sorted(resp.ravel().tolist()) == [0, 1, 2, 3]
    loads = loads_from_trace(experts, offsets, resp, num_ranks=2, num_experts=4)
    assert loads.shape == (2, 1, 2, 4)
    for m in range(2):
        for s in range(2):
            want = np.bincount(experts[resp[m, s]].ravel(), minlength=4)
            assert loads[m, 0, s].tolist() == want.tolist()
    # an incomplete last step is dropped
    assert schedule_responses(5, 2, 2, 0).shape == (2, 2)
