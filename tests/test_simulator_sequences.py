"""The simulator's sequence layout (simulator/sequences.py): the runtime's schedule, packed or padded."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from titan_foremoe.simulator.sequences import (SequenceLayout, layout_metrics, scheduled_synthetic_work,
                                               scheduled_trace_work)
from titan_foremoe.simulator.workload import RLSchedule, synthetic_work, trace_work

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("loads_MLSE", "tokens_MS", "pairs_MS", "response_lens")


def _trace(tmp_path, n=40, L=3, E=16, k=2, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 60, size=n)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    experts = rng.integers(0, E, size=(offsets[-1], L, k)).astype(np.uint8)
    path = tmp_path / "trace.npz"
    np.savez(path, experts=experts, offsets=offsets)
    return str(path)


@pytest.mark.parametrize("ep,groups", [(4, 1), (2, 3)])
def test_rollout_order_packed_is_todays_workload(tmp_path, ep, groups):
    """The scheduled path with today's layout reproduces workload.py's trace and synthetic work exactly."""
    sched = RLSchedule(4 * ep * groups, 2 * ep, 2)
    path = _trace(tmp_path)
    old, E = trace_work(path, ep, groups, sched, seed=3, num_experts=16)
    new, E2, _ = scheduled_trace_work(path, ep, groups, sched, 3, SequenceLayout("rollout_order"), num_experts=16)
    assert E == E2 and len(old) == len(new) == groups
    for a, b in zip(old, new):
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    old, _ = synthetic_work("tiny", ep, groups, sched, seed=1)
    new, _, _ = scheduled_synthetic_work("tiny", ep, groups, sched, 1, SequenceLayout("rollout_order"))
    for a, b in zip(old, new):
        for f in FIELDS:
            np.testing.assert_allclose(getattr(a, f), getattr(b, f), err_msg=f)


def test_padded_and_packed_charges_match_each_ranks_rows(tmp_path):
    """Brute force from s.rows(rank): padded = rows x longest (pairs rows x L(L+1)/2), packed = real sums;
    loads count every real token once, whatever the layout."""
    ep, groups = 2, 2
    sched = RLSchedule(16, 4, 2)
    path = _trace(tmp_path)
    for policy in ("rollout_order", "balanced"):
        for pack in (True, False):
            work, _, s = scheduled_trace_work(path, ep, groups, sched, 0, SequenceLayout(policy, pack), 16)
            lens_N = _lengths(path, sched)
            cw = s.cell_work(lens_N, padded=not pack)
            for r in range(ep * groups):
                for u, micro in enumerate(s.rows(r)):
                    for m, ids in enumerate(micro):
                        n = lens_N[ids]
                        x = (u * s.micro_steps + m) * s.ranks + r
                        want_t = n.sum() if pack else len(n) * n.max(initial=0)
                        want_p = (n * (n + 1) / 2).sum() if pack else len(n) * n.max(initial=0) * (n.max(initial=0) + 1) / 2
                        assert cw["tokens"][x] == want_t and cw["pairs"][x] == want_p
                        w = work[r // ep]
                        assert w.tokens_MS[u * s.micro_steps + m, r % ep] == want_t
                        assert w.loads_MLSE[u * s.micro_steps + m, 0, r % ep].sum() == 2 * n.sum()  # top-2
            if pack:
                assert layout_metrics(work)["padding_fraction"] == 0.0


def _lengths(path, sched):
    from titan_foremoe.simulator.workload import _responses

    offsets = np.load(path)["offsets"]
    return np.diff(offsets)[_responses(len(offsets) - 1, sched.updates_per_rollout * sched.global_batch, 0)]


def _sim():
    spec = importlib.util.spec_from_file_location("simulate_cluster", ROOT / "scripts" / "simulate_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_simulator_layouts_side_by_side(tmp_path):
    sim = _sim()
    base = ["--synthetic", "--model", "gpt_oss_20b", "--gpus", "8", "--gpus-per-node", "4", "--ep", "4",
            "--responses-per-microstep", "16", "--global-batch", "64", "--no-rollout", "--plan-ms", "1",
            "--balancers", "static,foremoe,ideal", "--response-lengths", "lognormal:1500:1.0:8192",
            "--calibration", str(ROOT / "calibrations" / "h100_public.json")]
    res = {}
    for name, extra in (("padded", ["--sequence-schedule", "rollout_order", "--no-pack"]), ("packed", []),
                        ("tokens", ["--schedule-cost", "tokens"])):
        assert sim.main(base + extra + ["--out", str(tmp_path / name)]) == 0
        res[name] = json.loads((tmp_path / name / "summary.json").read_text())
    pad, pk, tok = res["padded"], res["packed"], res["tokens"]
    assert pad["static"]["padding_fraction"] > 0.3 and pk["static"]["padding_fraction"] == 0.0
    assert pad["static"]["tokens_max_over_mean"] > 2.0 and tok["static"]["tokens_max_over_mean"] < 1.05
    assert pk["ideal"]["tokens_max_over_mean"] == 1.0 and pk["ideal"]["padding_fraction"] == 0.0
    for b in ("static", "foremoe"):
        assert pk[b]["train_ms"] < pad[b]["train_ms"]
        assert pk["ideal"]["train_ms"] <= pk[b]["train_ms"]
    assert pk["setting"]["sequence_schedule"] == "balanced" and pad["setting"]["pack"] is False
    # the default levels the trainer's cost (train/sequence_plan.dense_cost = flops_cost): tokens (dense and
    # routed-expert FLOPs) and attention pairs, so it trades a little token level for pairs and beats tokens alone
    assert pk["setting"]["schedule_cost"] == "flops" and tok["setting"]["schedule_cost"] == "tokens"
    assert pk["static"]["pairs_max_over_mean"] < tok["static"]["pairs_max_over_mean"]
    assert pk["static"]["tokens_max_over_mean"] > tok["static"]["tokens_max_over_mean"]
    assert pk["foremoe"]["train_ms"] < tok["foremoe"]["train_ms"]  # measured 2,211 vs 2,235 ms


def test_response_lengths_bad_input_exits_2(tmp_path, capsys):
    sim = _sim()
    common = ["--model", "gpt_oss_20b", "--gpus", "4", "--ep", "4", "--out", str(tmp_path)]
    for extra, word in ((["--synthetic", "--response-lengths", "lognormal:1500:1.0"], "lognormal:MEDIAN:SIGMA:CAP"),
                        (["--trace", _trace(tmp_path), "--response-lengths", "lognormal:1500:1:8192"],
                         "a trace brings its own lengths")):
        with pytest.raises(SystemExit) as e:
            sim.main(extra + common)
        assert e.value.code == 2 and word in capsys.readouterr().err


def test_token_budget_sets_the_micro_steps(tmp_path):
    """A per-rank budget forms the micro-steps: every cell within it, the same count for every group, and the
    simulator's optimizer steps cut at the schedule's count."""
    sched = RLSchedule(32, 8, 2)
    for policy in ("balanced", "rollout_order"):
        layout = SequenceLayout(policy, lengths=(1500, 1.0, 8192), max_tokens=12000)
        work, _, s = scheduled_synthetic_work("tiny", 4, 2, sched, 0, layout)
        assert all(w.tokens_MS.max() <= 12000 and len(w.loads_MLSE) == 2 * s.micro_steps for w in work)
        assert all(w.loads_MLSE[:, 0].sum() == 2 * w.real_tokens_MS.sum() for w in work)  # tiny: top-2
    sim = _sim()
    args = ["--synthetic", "--model", "gpt_oss_20b", "--gpus", "8", "--gpus-per-node", "4", "--ep", "4",
            "--responses-per-microstep", "8", "--global-batch", "32", "--no-rollout", "--plan-ms", "1",
            "--balancers", "static,foremoe", "--response-lengths", "lognormal:1500:1.0:8192",
            "--max-tokens-per-micro-step", "16384", "--calibration", str(ROOT / "calibrations" / "h100_public.json"),
            "--out", str(tmp_path / "b")]
    assert sim.main(args) == 0
    out = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert out["setting"]["micro_steps_per_step_per_group"] >= 1 and out["foremoe"]["padding_fraction"] == 0.0
    assert sim.main(args[:-4] + ["--max-tokens-per-micro-step", "100", "--out", str(tmp_path / "c")]) == 2
