"""The trainer's planner weighs a slot with the cost the cluster simulator charges (issue 28: one cost model).

Oracle: the simulator's own ``simulate`` (its ``slot_overhead_tokens = "auto"`` branch, reported as
``planner_slot_tokens``) on the same loads and model shape; we only compare what the trainer's ``SlotCost`` gives.
"""

from __future__ import annotations

import numpy as np
import pytest

from titan_foremoe.simulator.calibration import load_calibration
from titan_foremoe.simulator.models import get_model
from titan_foremoe.simulator.simulate import ClusterSpec, device_costs, simulate
from titan_foremoe.simulator.workload import RLSchedule, synthetic_work
from titan_foremoe.train.slot_cost import SlotCost


@pytest.mark.parametrize("device", ["h100", "h200"])
def test_auto_is_the_simulators_slot_cost_for_both_stages(device):
    """One EP group of 8 (the simulator's per-slot tokens are its mean over groups: one group, its own loads)."""
    cal = load_calibration(device)
    for name in ("gpt_oss_20b", "qwen3_30b_a3b"):
        model, ep = get_model(name), 8
        cluster, sched = ClusterSpec(ep, 8, ep), RLSchedule(2 * 4 * ep, 4 * ep, 1)
        work, _ = synthetic_work(name, ep, cluster.groups, sched, seed=0)
        out = simulate(work, model, cluster, sched, cal, device_costs(cal, ep), 1, ("static",), rollout=None,
                       plan_ms_given={"static": {"rec": (2.0, None), "upd": (2.0, None)}})
        sim, sim_w = out["planner_slot_tokens"], out["planner_spare_token_weight"]
        ours = SlotCost("auto", device, model.dim, model.moe_hidden)
        assert ours.tokens(work[0].loads_MLSE) == {"recompute": sim["rec"], "update": sim["upd"]}, (name, sim)
        costs, tok = ours.cost_models(work[0].loads_MLSE)
        assert {s: c.slot_overhead_tokens for s, c in costs.items()} == tok
        assert costs["recompute"].spare_token_weight == sim_w["rec"] and costs["update"].spare_token_weight == sim_w["upd"]
        for s, k in (("recompute", "rec"), ("update", "upd")):  # the time table of the last token polish
            t = out["planner_group_ms"][k]
            assert costs[s].group_ms == (tuple(t["rows"]), tuple(t["ms"])) and costs[s].spare_row_ms == t["spare_row_ms"]
        assert all(w == 1.0 for w in sim_w.values())  # one spare slot's GEMM writes its output rows in place
        assert sim["rec"] != sim["upd"]  # the stages differ: forward only vs forward + backward


def test_auto_depends_on_the_loads_alone_and_an_int_is_used_as_is():
    """Every rank of an EP group holds the same gathered loads, so it gets the same cost; an int skips the model."""
    loads = np.random.default_rng(0).poisson(300, (4, 3, 8, 32)).astype(np.int64)
    a, b = SlotCost("auto", "h100", 2880, 2880), SlotCost("auto", "h100", 2880, 2880)
    assert a.tokens(loads) == b.tokens(loads.copy()) == a.tokens(loads.astype(np.float32))
    assert a.tokens(loads) != a.tokens(loads * 4)  # the fit is around the step's tokens per slot
    for n in (0, 120):
        fixed = SlotCost(n, "h100", 2880, 2880)
        assert fixed.curve is None and fixed.tokens(loads) == {"recompute": n, "update": n}


def test_the_planner_prices_a_spare_row_as_the_slot_path_runs_it():
    """One spare slot: its GEMM writes the spare rows in place, so a spare row and token cost what an owned one does;
    two or more: the spare rows' output is copied into place, so they cost that copy (the shipped configs once ran
    two spare slots; a price taken at one spare slot for all would make the copy free)."""
    from titan_foremoe.simulator.grouped_mm import spare_row_ms, spare_token_weight

    curve = load_calibration("h100").curve(2048, 768)
    assert spare_row_ms(curve, spare=1) == 0.0 and spare_token_weight(curve, 300.0, spare=1) == 1.0
    copy = curve.k.copy_ms(2048 * 2 * 2)  # one row's output, D wide, read and written in bf16
    assert spare_row_ms(curve, spare=2) == pytest.approx(copy) and spare_token_weight(curve, 300.0, spare=2) > 1.0
    two = SlotCost("auto", "h100", 2048, 768, spare_slots=2).cost_models(np.full((1, 2, 8, 128), 40))[0]
    assert two["update"].spare_row_ms == pytest.approx(copy) and two["update"].spare_token_weight > 1.0
