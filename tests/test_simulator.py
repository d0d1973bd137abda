"""Cluster simulator, reactive balancer and GPU calibration script (small and fast)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from titan_foremoe.planner import PlannerConfig, Topology, plan_stage
from titan_foremoe.planner.metrics import owner_move_bytes_ZR, owner_move_rows, owner_moves_ZLE, owner_summary
from titan_foremoe.planner.owners import contiguous_owners, step_owners_ZLE
from titan_foremoe.planner.reactive import plan_layer
from titan_foremoe.planner.split import source_split
from titan_foremoe.simulator.calibration import GemmCurve, load_calibration, monotone_table
from titan_foremoe.simulator.relayout import exposed_relayout_s_Z, global_owners_ZLE, plan_by_step, relayout_s_Z
from titan_foremoe.planner.types import TRANSFER_DTYPE
from titan_foremoe.simulator.simulate import device_costs
from titan_foremoe.simulator.timing import _a2a, _moves_MLPR

ROOT = Path(__file__).resolve().parents[1]


def _script(name, folder="scripts"):
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace(tmp_path, n=21, L=3, E=32, k=4, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 30, size=n)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    # skewed routes so balancers differ
    p = rng.dirichlet(np.full(E, 0.5))
    experts = np.stack([rng.choice(E, size=(offsets[-1], k), p=p) for _ in range(L)], axis=1).astype(np.uint8)
    path = tmp_path / "trace.npz"
    np.savez(path, experts=experts, offsets=offsets)
    return path


def test_reactive_plans_each_layer_from_its_own_counts():
    rng = np.random.default_rng(1)
    R, E, S = 4, 16, 1
    loads = rng.multinomial(400, rng.dirichlet(np.full(E, 0.3)), size=(3, 2, R)).astype(np.int64)
    topo = Topology.from_ranks(R, 2)
    plan = plan_stage("reactive", loads, topo, PlannerConfig(spare_slots=S))
    other = loads.copy()
    other[0] = rng.permutation(other[0].ravel()).reshape(other[0].shape)  # change micro-step 0 only
    plan2 = plan_stage("reactive", other, topo, PlannerConfig(spare_slots=S))
    assert np.array_equal(plan.assign_MLER[1:], plan2.assign_MLER[1:])
    load_MLE = loads.sum(axis=2)
    assert np.array_equal(plan.assign_MLER.sum(axis=3), load_MLE)  # every token placed once
    static_max = load_MLE.reshape(3, 2, R, E // R).sum(axis=3).max(axis=2)
    assert (plan.rank_load_MLR.max(axis=2) <= static_max).all()
    assert ((plan.slots_MLRC[..., E // R :] >= 0).sum(axis=3) <= S).all()  # slot budget
    # one transfer per filled spare slot, from the owner, in the micro-step that uses it
    assert len(plan.transfers_T) == int((plan.slots_MLRC[..., E // R :] >= 0).sum())
    assert np.array_equal(plan.transfers_T["src_rank"], plan.transfers_T["expert"] // (E // R))
    assert plan.info["plan_ms_ML"].shape == (3, 2)
    # a layer's plan is the stand-alone per-layer function's plan
    s, t = plan_layer(load_MLE[2, 1], R, S, max(1, int(np.ceil(0.01 * load_MLE[2, 1].sum() / R))))
    assert np.array_equal(plan.slots_MLRC[2, 1], s)


def test_reactive_brute_force_small_case():
    # 2 ranks, 2 experts each, one hot expert: the optimum with one spare slot splits it evenly.
    s, t = plan_layer(np.array([100, 0, 10, 10]), 2, 1, 1)
    loads = t.sum(axis=1)
    assert loads.max() == 60 and s[1, 2] == 0


def test_gemm_curve_hits_grid_points():
    cal = load_calibration("h100_public")  # the grouped-GEMM table model
    g = cal.raw["grouped_mm"]["2880x2880"]
    c = cal.curve(2880, 2880)
    k, n = 4, 512
    i, j = g["experts_per_rank"].index(k), g["tokens_per_expert"].index(n)
    got = c.rank_ms(np.full((1, k), n), backward=False)[0]
    assert got == pytest.approx(g["fwd_ms"][i][j], rel=1e-12)
    assert c.rank_ms(np.zeros((1, 4)), backward=True)[0] == 0.0


def test_dispatch_bytes_match_brute_force():
    rng = np.random.default_rng(2)
    R, E = 4, 8
    loads = rng.integers(0, 30, size=(1, 1, R, E))
    plan = plan_stage("foremoe", loads, Topology.from_ranks(R, 2), PlannerConfig(spare_slots=1))
    node = np.array([0, 0, 1, 1])
    send, recv = _a2a(loads, plan.assign_MLER, node, 10.0)
    f = source_split(loads[0, 0], plan.assign_MLER[0, 0], node)  # [S, E, R]
    for s in range(R):
        intra = sum(f[s, :, r].sum() for r in range(R) if r != s and node[r] == node[s]) * 10.0
        inter = sum(f[s, :, r].sum() for r in range(R) if node[r] != node[s]) * 10.0
        assert send[0, 0, 0, s] == intra and send[0, 0, 1, s] == inter
    assert recv.sum() == send.sum()


def test_simulator_reproduces_bench_planner_max_over_mean(tmp_path):
    trace = _trace(tmp_path)
    names = "static,eplb_history,eplb_oracle,reactive,foremoe,ideal"
    bench = _script("bench_planner", "benchmarks")
    assert bench.main(["--trace", str(trace), "--ranks", "4", "--ranks-per-node", "2", "--spare-slots", "1",
                       "--responses-per-microstep", "4", "--global-batch", "8", "--seed", "3",
                       "--balancers", names, "--timing-repeats", "1", "--out", str(tmp_path / "b")]) == 0
    sim = _script("simulate_cluster")
    # one EP group of 4 ranks, 2 nodes; the 2 optimizer steps of the trace are one rollout
    cal = _tiny_cal(tmp_path)
    assert sim.main(["--trace", str(trace), "--model", "gpt_oss_20b", "--gpus", "4", "--gpus-per-node", "2",
                     "--ep", "4", "--spare-slots", "1", "--responses-per-microstep", "4", "--global-batch", "8",
                     "--updates-per-rollout", "2", "--seed", "3", "--balancers", names, "--calibration", cal,
                     # bench_planner deals responses in rollout order: the same micro-steps, so the same plans
                     "--sequence-schedule", "rollout_order", "--out", str(tmp_path / "s")]) == 0
    b = json.loads((tmp_path / "b" / "summary.json").read_text())
    s = json.loads((tmp_path / "s" / "summary.json").read_text())
    for name in names.split(","):
        assert s[name]["max_over_mean"] == b[name]["mean_max_over_mean"], name
    assert len({b[n]["mean_max_over_mean"] for n in names.split(",")}) > 3  # the balancers do differ


def _tiny_cal(tmp_path):
    """The public calibration with the trace's shape (the model dims stay gpt-oss's)."""
    return str(ROOT / "calibrations" / "h100_public.json")


def test_simulator_end_to_end_small(tmp_path):
    sim = _script("simulate_cluster")
    args = ["--synthetic", "--model", "gpt_oss_20b", "--gpus", "8", "--gpus-per-node", "2", "--ep", "4",
            "--responses-per-microstep", "4", "--global-batch", "16", "--updates-per-rollout", "2"]
    assert sim.main(args + ["--spare-slots", "1", "--sweep-gpus", "4,8", "--out", str(tmp_path / "a")]) == 0
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert (tmp_path / "a" / "step_vs_gpus.png").stat().st_size > 1000
    assert set(s["sweep"]) == {"4", "8"}
    for b in ("static", "eplb_history", "eplb_oracle", "reactive", "foremoe", "ideal"):
        for key in ("moe_ms_per_microstep", "step_ms", "exposed_transfer_ms", "max_over_mean", "transfer_bytes_per_rank"):
            assert np.isfinite(s[b][key]) and s[b][key] >= 0, (b, key)
        if b != "foremoe":
            assert s["speedup_of_foremoe"][b] == pytest.approx(s[b]["step_ms"] / s["foremoe"]["step_ms"])
    assert s["static"]["transfer_bytes_per_rank"] == 0 and s["static"]["exposed_transfer_ms"] == 0
    assert s["ideal"]["step_ms"] < s["static"]["step_ms"]
    assert s["foremoe"]["max_over_mean"] < s["static"]["max_over_mean"]
    assert s["reactive"]["exposed_plan_ms"] > 0 and s["reactive"]["exposed_transfer_ms"] > 0
    # no spare slots: nothing to move, so every executable plan times like static (planning aside)
    one_group = ["--synthetic", "--model", "gpt_oss_20b", "--gpus", "4", "--gpus-per-node", "2", "--ep", "4",
                 "--responses-per-microstep", "4", "--global-batch", "8", "--updates-per-rollout", "2"]
    assert sim.main(one_group + ["--spare-slots", "0", "--balancers", "static,reactive,foremoe",
                                 "--out", str(tmp_path / "z")]) == 0
    z = json.loads((tmp_path / "z" / "summary.json").read_text())
    for b in ("reactive", "foremoe"):
        assert z[b]["transfer_bytes_per_rank"] == 0
        assert z[b]["step_ms"] - z[b]["exposed_plan_ms"] == pytest.approx(z["static"]["step_ms"], rel=1e-9)


def test_simulator_bad_input_exits_2(tmp_path, capsys):
    sim = _script("simulate_cluster")
    assert sim.main(["--synthetic", "--model", "gpt_oss_20b", "--gpus", "12", "--ep", "8", "--out", str(tmp_path)]) == 2
    assert "--ep" in capsys.readouterr().err
    assert sim.main(["--synthetic", "--model", "gpt_oss_20b", "--gpus", "8", "--ep", "8",
                     "--calibration", str(tmp_path / "none.json"), "--out", str(tmp_path)]) == 2
    assert "calibration" in capsys.readouterr().err
    bad = _trace(tmp_path, E=40)  # expert ids beyond gpt-oss's 32
    assert sim.main(["--trace", str(bad), "--model", "gpt_oss_20b", "--gpus", "4", "--ep", "4",
                     "--out", str(tmp_path)]) == 2
    assert "out of range" in capsys.readouterr().err
    base = ["--synthetic", "--model", "gpt_oss_20b", "--gpus", "8", "--ep", "8", "--out", str(tmp_path)]
    for extra, word in ((["--rollout-batch", "0"], "--rollout-batch"), (["--planner-slot-tokens", "x"], "auto"),
                        (["--expert-kernel", "cutlass"], "--expert-kernel")):
        with pytest.raises(SystemExit) as e:
            sim.main(base + extra)
        assert e.value.code == 2 and word in capsys.readouterr().err


def test_calibrate_gpu_cpu_smoke(tmp_path):
    cal_script = _script("calibrate_gpu")
    out = tmp_path / "cal.json"
    assert cal_script.main(["--device", "cpu", "--models", "", "--shape", "16x32", "--tokens", "1,4,8",
                            "--experts", "1,2", "--repeats", "2", "--copy-mb", "0.25", "--matmul-n", "64",
                            "--max-rows", "8", "--a2a-overhead", "--out", str(out)]) == 0
    raw = json.loads(out.read_text())
    assert raw["kind"] == "measured" and raw["torch"] and raw["device"].startswith("cpu")
    g = raw["grouped_mm"]["16x32"]
    assert np.array(g["fwd_ms"]).shape == (2, 3) and np.isfinite(g["bwd_ms"]).all()
    assert raw["copies"]["h2d_pinned_GBps"] > 0 and raw["links"]["a2a_launch_us_world1"] > 0
    c = load_calibration(out).curve(16, 32)
    # the table as measured, made monotone on load (this loaded 2-core CPU's timings dip)
    assert c.rank_ms(np.array([[4, 0]]), backward=False)[0] == pytest.approx(monotone_table(g["fwd_ms"])[0][1])


def _random_owners(rng, Z, L, E, R):
    """Z valid owner maps: every rank owns E/R experts of each layer."""
    base = np.arange(E) // (E // R)
    return np.stack([[rng.permutation(base) for _ in range(L)] for _ in range(Z)])


def test_owner_move_bytes_and_relayout_time_match_brute_force():
    rng = np.random.default_rng(5)
    Z, L, E, R = 3, 2, 8, 4
    node_R = np.array([0, 0, 1, 1])
    init = contiguous_owners(L, E, R)
    owners = _random_owners(rng, Z, L, E, R)
    owners[1] = owners[0]  # a step without moves
    params, efsdp = 1000, 4
    per_move = params * 12 / efsdp
    bw = np.array([100.0, 10.0, 1.0])
    want_moves = np.zeros(Z, dtype=int)
    want_recv = np.zeros((Z, R))
    want_s = np.zeros(Z)
    for z in range(Z):
        before = init if z == 0 else owners[z - 1]
        send, recv = np.zeros((2, R)), np.zeros((2, R))
        for l in range(L):
            for e in range(E):
                a, b = before[l, e], owners[z, l, e]
                if a != b:
                    want_moves[z] += 1
                    want_recv[z, b] += per_move
                    p = int(node_R[a] != node_R[b])
                    send[p, a] += per_move
                    recv[p, b] += per_move
        want_s[z] = max(max(send[p, r], recv[p, r]) / bw[p] for p in range(2) for r in range(R))
    got = owner_summary(owners, R, params, efsdp, init)
    assert got["owner_moves_per_step"] == want_moves.tolist() and want_moves[1] == 0 and want_moves[0] > 0
    assert np.allclose(owner_move_bytes_ZR(owners, init, R, per_move), want_recv)
    assert got["owner_move_bytes_per_rank_per_step"] == pytest.approx(want_recv.max(axis=1).tolist())
    assert np.allclose(relayout_s_Z(owners, init, node_R, per_move, bw), want_s)
    # default layout in effect: contiguous
    assert owner_summary(owners, R, params, efsdp) == got


def test_exposed_relayout_rule():
    # step 0 hides behind the recompute stage, later steps are exposed in full
    assert exposed_relayout_s_Z(np.array([0.05, 0.02, 0.0]), 0.1).tolist() == [0.0, 0.02, 0.0]
    assert exposed_relayout_s_Z(np.array([0.3, 0.01]), 0.1) == pytest.approx([0.2, 0.01])


def test_global_owners_sum_every_group():
    rng = np.random.default_rng(6)
    G, M, L, S, E, mps = 3, 4, 2, 4, 8, 2
    topo = Topology.from_ranks(4, 2)
    loads = [rng.multinomial(200, rng.dirichlet(np.full(E, 0.3)), size=(M, L, S)) for _ in range(G)]
    init = contiguous_owners(L, E, 4)
    step_ZLE = np.zeros((M // mps, L, E))
    for g in range(G):
        for m in range(M):
            step_ZLE[m // mps] += loads[g][m].sum(axis=1)
    got = global_owners_ZLE(loads, mps, topo, "balanced", init, 0.0)
    assert np.array_equal(got, step_owners_ZLE(step_ZLE, topo, "balanced", init, 0.0))
    assert not np.array_equal(got[0], init)  # the skewed loads do re-place owners
    assert np.array_equal(global_owners_ZLE(loads, mps, topo, "contiguous", init, 0.0)[1], init)


def test_plan_by_step_contiguous_equals_one_plan():
    # contiguous owners: the update stage planned step by step is the one-shot foremoe plan
    rng = np.random.default_rng(7)
    M, L, R, E, mps = 4, 2, 4, 8, 2
    loads = rng.multinomial(300, rng.dirichlet(np.full(E, 0.3)), size=(M, L, R))
    topo, cfg = Topology.from_ranks(R, 2), PlannerConfig(spare_slots=1)
    one = plan_stage("foremoe", loads, topo, cfg, micro_steps_per_step=mps)
    by = plan_by_step(loads, topo, cfg, mps, np.broadcast_to(contiguous_owners(L, E, R), (M // mps, L, E)))
    for f in ("slots_MLRC", "assign_MLER", "owner_MLE", "transfers_T"):
        assert np.array_equal(getattr(one, f), getattr(by, f)), f
    # balanced owners: step z's owners are in place before it, so no transfer moves an expert to its owner
    own = global_owners_ZLE([loads], mps, topo, "balanced", contiguous_owners(L, E, R), 0.0)
    bal = plan_by_step(loads, topo, cfg, mps, own)
    assert not owner_move_rows(bal).any() and np.array_equal(bal.owner_MLE[::mps], own)
    full = plan_stage("foremoe", loads, topo, cfg, micro_steps_per_step=mps, owners_ZLE=own)
    assert owner_move_rows(full).sum() == owner_moves_ZLE(own, contiguous_owners(L, E, R)).sum()
    assert np.array_equal(full.assign_MLER, bal.assign_MLER)


def _sim_balanced(tmp_path, name, *extra):
    sim = _script("simulate_cluster")
    args = ["--trace", str(_trace(tmp_path)), "--model", "gpt_oss_20b", "--gpus", "8", "--gpus-per-node", "2",
            "--ep", "4", "--spare-slots", "1", "--responses-per-microstep", "4", "--global-batch", "16",
            "--updates-per-rollout", "2", "--balancers", "static,foremoe,foremoe_balanced", *extra,
            "--out", str(tmp_path / name)]
    assert sim.main(args) == 0
    return json.loads((tmp_path / name / "summary.json").read_text())


def test_simulator_balanced_owners(tmp_path):
    # a fixed plan time: a measured one (the machine's load, the planner's starts) can outlast the re-layout
    s = _sim_balanced(tmp_path, "b", "--owner-hysteresis", "0", "--plan-ms", "0.5")
    f, b = s["foremoe"], s["foremoe_balanced"]
    assert f["owner_moves_per_step"] == [0, 0] and f["exposed_relayout_ms"] == 0
    assert b["owner_moves_per_step"][0] > 0 and b["owner_move_bytes_per_rank_per_step"][0] > 0
    assert len(b["relayout_ms_per_step"]) == 2
    assert b["train_ms"] == pytest.approx(b["recompute_ms"] + b["update_ms"] + b["optimizer_ms"] + b["exposed_relayout_ms"])
    # step 0's re-layout overlaps the recompute stage (tiny here, so it shows), step 1's waits in full
    r0, r1 = b["relayout_ms_per_step"]
    assert r0 > b["recompute_ms"] and r1 > 0
    assert b["exposed_relayout_ms"] == pytest.approx(r0 - b["recompute_ms"] + r1)
    # balanced owners level the update stage's experts better; in time, which the plans minimize (each layer keeps
    # its fastest slot-cost start on the time table: their token max/mean is no longer what they lower)
    assert b["expert_ms_straggler_update"] < f["expert_ms_straggler_update"]
    # hysteresis huge: owners never move and balanced is contiguous foremoe (planning time aside: both are
    # charged the same fixed plan time, since timing them here depends on the machine's load)
    h = _sim_balanced(tmp_path, "h", "--owner-hysteresis", "1e9", "--plan-ms", "0.5")
    f, b = h["foremoe"], h["foremoe_balanced"]
    assert b["owner_moves_per_step"] == [0, 0] and b["exposed_relayout_ms"] == 0
    assert b["max_over_mean"] == f["max_over_mean"] and b["transfer_bytes_per_rank"] == f["transfer_bytes_per_rank"]
    assert b["step_ms"] - b["exposed_plan_ms"] == pytest.approx(f["step_ms"] - f["exposed_plan_ms"], rel=1e-9)


def test_host_lane_follows_the_runtime_rule():
    # one inter-node and one intra-node move; the lane is the transfer engine's CostModel.use_host_path
    rows = np.zeros(2, dtype=TRANSFER_DTYPE)
    rows["src_rank"], rows["dst_rank"] = [0, 0], [2, 1]
    node_R, nbytes = np.array([0, 0, 1, 1]), 50e6
    cal = load_calibration()
    link = device_costs(cal)  # PCIe 55 GB/s > IB 45 GB/s, but staging + host hop make the host lane slower
    cost = link.cost_model(nbytes)
    assert not cost.use_host_path(True) and link.h2d_GBps > link.ib_GBps
    tx, got = _moves_MLPR(rows, 1, 1, 4, nbytes, node_R, link)
    assert tx[0, 0, 1, 2] == pytest.approx(nbytes / (link.ib_GBps * 1e9)) and tx[0, 0, 2].sum() == 0
    assert tx[0, 0, 0, 1] == pytest.approx(nbytes / link.copy_bw_P(nbytes)[0]) and got.sum() == 2 * nbytes
    assert link.copy_bw_P(nbytes)[0] < link.nvlink_GBps * 1e9  # measured: a 50 MB copy gets less than the 512 MiB busbw
    fast = device_costs(cal, h2d_GBps=400.0, host_net_GBps=400.0, ib_GBps=10.0)
    assert fast.cost_model(nbytes).use_host_path(True) and not fast.cost_model(nbytes).use_host_path(False)
    tx, _ = _moves_MLPR(rows, 1, 1, 4, nbytes, node_R, fast)
    assert tx[0, 0, 2, 2] == pytest.approx(fast.cost_model(nbytes).host_path_s(True)) and tx[0, 0, 1].sum() == 0
    assert tx[0, 0, 0, 1] > 0  # the intra-node move stays on NVLink
    forced, _ = _moves_MLPR(rows, 1, 1, 4, nbytes, node_R, device_costs(cal, transfer_path="host"))
    assert forced[0, 0, 2, 1] == pytest.approx(cost.host_path_s(False)) and forced[0, 0, :2].sum() == 0


def test_gemm_curve_linear_in_experts_between_grid_points():
    # a rank's time affine in k (each expert adds its work): a rank of 5 pays exactly one more expert than 4
    K, N = np.array([1.0, 2, 4, 8]), np.array([1, 64, 1024])
    fwd = 0.05 + 0.2 * K[:, None] * (1 + N[None, :] / 512)
    c = GemmCurve(K, N, fwd, 2 * fwd)
    for k in (3, 5, 6, 7):
        got = c.rank_ms(np.full((1, k), 64), backward=False)[0]
        assert got == pytest.approx(0.05 + 0.2 * k * (1 + 64 / 512), rel=1e-12), k


def test_whole_rl_step_per_balancer(tmp_path):
    """summary.json carries the whole step (rollout + weight sync + trainer stages) per balancer: stage shares
    add up to 1, the rollout and sync are the same for every balancer, and foremoe's step speedup over static
    is smaller than its MoE-time speedup (Amdahl); --no-rollout gives back the trainer's stages only."""
    sim = _script("simulate_cluster")
    args = ["--synthetic", "--model", "qwen3_30b_a3b", "--gpus", "16", "--gpus-per-node", "8", "--ep", "8",
            "--balancers", "static,foremoe,ideal", "--plan-ms", "2"]
    assert sim.main(args + ["--out", str(tmp_path / "a")]) == 0
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    for b in ("static", "foremoe", "ideal"):
        st = s[b]["stage_ms"]
        assert sum(s[b]["stage_share"].values()) == pytest.approx(1.0)
        assert s[b]["step_ms"] == pytest.approx(sum(st.values()))
        assert s[b]["train_ms"] == pytest.approx(s[b]["step_ms"] - st["rollout"] - st["weight_sync"])
        assert st["rollout"] == s["static"]["stage_ms"]["rollout"] > 0
    assert 1.0 < s["speedup_of_foremoe"]["static"] < s["train_speedup_of_foremoe"]["static"] \
        <= s["moe_speedup_of_foremoe"]["static"]
    # the sync is charged by the runtime's cost model (rollouts/engines/sync_cost.py), colocated on 16 GPUs
    from titan_foremoe.rollouts.engines.sync_cost import SyncLinks, SyncSetting, hf_tensor_bytes, sync_cost
    from titan_foremoe.simulator.models import get_model
    from titan_foremoe.simulator.timing import DeviceCosts

    m = get_model("qwen3_30b_a3b")
    link = DeviceCosts(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in s["setting"]["link"].items()})
    want = sync_cost(hf_tensor_bytes(m), SyncSetting("bucketed", 16, 0, 8, 8, state_entries=12 * 48 + 3,
                                                     expert_tensors=3 * m.num_experts * m.moe_layers,
                                                     load="stacked"),  # the simulator's default: the runtime's
                     SyncLinks.of(link))
    assert s["rollout"]["weight_sync_ms"] == pytest.approx(want["sync_s"] * 1e3, rel=1e-9)
    assert sim.main(args + ["--no-rollout", "--out", str(tmp_path / "b")]) == 0
    t = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert t["foremoe"]["step_ms"] == pytest.approx(s["foremoe"]["train_ms"]) and "rollout" not in t


def test_decode_step_is_bandwidth_bound_at_small_batch():
    """A decode step at batch 1 costs about the GPU's weight bytes at the HBM rate (every dense weight read
    once, the fused kernel's weight term for the experts a token touches), far more than its FLOPs."""
    from titan_foremoe.simulator.models import get_model
    from titan_foremoe.simulator.rollout import decode_step_ms

    cal = load_calibration("h100")
    link = device_costs(cal, 8)
    m = get_model("qwen3_30b_a3b")
    one = decode_step_ms(m, cal, link, 1.0, 128.0, 8, cal.hbm_GBps * 1e9)
    big = decode_step_ms(m, cal, link, 256.0, 128.0, 8, cal.hbm_GBps * 1e9)
    dense_bytes = m.dense_params() * 2 / 8
    assert one["dense"] > 0.5 * dense_bytes / (cal.hbm_GBps * 1e9) * 1e3  # weights, not FLOPs, set it
    flops = 2 * m.dense_params() / 8 / (cal.dense_tflops * 1e12) * 1e3
    assert one["dense"] > 20 * flops
    assert big["experts"] > one["experts"] and big["kv"] == pytest.approx(256 * one["kv"])


def test_replicas_weigh_the_slot_fixed_cost():
    """With a slot's fixed cost c0 (tokens) a rank's load is tokens + c0 per slot with tokens: a replica whose
    receiver would end above the straggler is not placed; one that pays is sized to equalize the two loads."""
    from titan_foremoe.planner.replicas import place_replicas

    topo = Topology.from_ranks(2, 2)
    owned = np.array([[[0, 1], [2, 3]]])
    free = np.full((1, 2, 1), -1)
    s, t = place_replicas(np.array([[900, 100, 500, 400]]), owned, free, topo, np.array([1]))
    assert t.sum(axis=2).tolist() == [[950, 950]]  # c0 = 0: token balance, one replica of expert 0
    s, t = place_replicas(np.array([[900, 100, 500, 400]]), owned, free, topo, np.array([1]), slot_tokens=500)
    assert (s[0, :, 2] == -1).all() and t.sum(axis=2).tolist() == [[1000, 900]]  # a 100-token gap < c0
    s, t = place_replicas(np.array([[3000, 100, 500, 400]]), owned, free, topo, np.array([1]), slot_tokens=500)
    load = t.sum(axis=2) + 500 * (t > 0).sum(axis=2)
    assert s[0, 1, 2] == 0 and abs(int(load[0, 0]) - int(load[0, 1])) <= 1


def test_planner_slot_tokens_come_from_the_expert_model():
    """auto: the fixed cost of one more slot with tokens, in tokens, from the same calibrated model the simulator
    charges (capped at the typical tokens per slot); the slot path's copies are paid for every slot, used or
    not, so they are not part of it: the same on both slot paths."""
    from titan_foremoe.simulator.grouped_mm import slot_tokens

    cal = load_calibration("h100")
    g = slot_tokens(cal.curve(2880, 2880), 1117.0)
    assert 0 < g < 1117 and g == slot_tokens(cal.curve(2880, 2880, slot_path="inplace"), 1117.0)
    assert slot_tokens(cal.curve(2048, 768), 100.0) == 100  # mostly fixed cost: capped
    c = cal.curve(2880, 2880)
    one = np.array([[1117.0]])

    def extra(n):  # brute force: a rank at 1117 tokens, one more group of n rows (forward + backward)
        two = np.array([[1117.0, n]])
        return float((c.rank_ms(two, False) + c.rank_ms(two, True) - c.rank_ms(one, False) - c.rank_ms(one, True))[0])

    b = (extra(1600.0) - extra(800.0)) / 800
    assert (extra(800.0) - b * 800) / b == pytest.approx(g, rel=0.35)  # a / b of the fitted line, near the grid


def test_slot_path_per_rank():
    """The gather path reads all C slots whatever their tokens: the same time on every rank; the in-place path runs
    its spare part (the spare slots' bank rows, a second grouped call per GEMM, the copy of the spare rows' final
    output into place) only on a rank whose spare slots run rows: nothing on the others, nor on any rank of
    ``static`` or ``ideal`` (models/slot_swiglu.py skips the part and gives the bank no gradient); "none"
    (torchtitan's path, balancer "off") adds nothing."""
    cal = load_calibration("h100")
    tok = np.array([[0.0, 5.0, 900.0, 0.0], [3000.0, 0.0, 0.0, 1.0]])
    used = np.array([5.0, 0.0])  # rank 0 runs 5 rows on its spare slot, rank 1 none
    add = {p: cal.curve(2880, 2880, slot_path=p).rank_ms(tok, True, slots=5, spare=1, spare_rows=used)
           - cal.curve(2880, 2880, slot_path=p).rank_ms(tok, True) for p in ("gather", "inplace", "none")}
    assert add["none"].tolist() == [0.0, 0.0]
    assert add["gather"][0] == pytest.approx(add["gather"][1])
    assert add["inplace"][1] == 0.0 and 0 < add["inplace"][0] < add["gather"][0]
    c = cal.curve(2880, 2880, slot_path="inplace")
    k = c.k

    def c_two(backward):  # two spare slots, 5 rows on them
        return float(c.slot_ms(backward, 6, 2, 5.0))

    # bytes: the gather path copies 5 slots' weights (8 passes in backward); in place one spare slot reads its bank
    # row as it is (InPlaceSplit.bank_in_order): only the second grouped calls, w1 and w3 as one [2F, D] matrix
    # (2 forward, 4 backward: w13's and w2's data and weight gradients) at the fused shapes; two spare slots are
    # gathered (6)
    matrix = 3 * 2880 * 2880 * 2
    assert add["gather"][0] - 12 * k.launch == pytest.approx(k.copy_ms(5 * 8 * matrix))
    g = k._group_ms
    w13 = (g(5.0, 2880, 5760, False) - 2 * g(5.0, 2880, 2880, False)  # data gradient, weight gradient
           + g(5.0, 5760, 2880, True) - 2 * g(5.0, 2880, 2880, True))
    assert float(c.w13_ms(5.0, True)) == pytest.approx(w13) and w13 != 0
    assert add["inplace"][0] == pytest.approx(4 * k.launch + w13)
    assert float(c.slot_ms(True, 5, 1, 5.0, shapes=False)) == pytest.approx(4 * k.launch)
    assert float(c.slot_ms(False, 5, 1, 5.0) - c.slot_ms(False, 5, 1, 5.0, shapes=False)) == pytest.approx(
        g(5.0, 5760, 2880, False) - 2 * g(5.0, 2880, 2880, False))
    assert c_two(True) - 18 * k.launch == pytest.approx(k.copy_ms(2 * 8 * matrix))  # + the return's pack
    assert c_two(False) - 9 * k.launch == pytest.approx(k.copy_ms(2 * 2 * matrix + 5 * 2880 * 2 * 2))
    # spare rows: with two spare slots forward copies their final output (D wide, read and written in bf16, at the
    # HBM rate) into place; one spare slot's w2 GEMM writes them in place (torch.mm out=), as backward joins
    # through out= writes (models/slot_swiglu.py): the fixed part alone, whatever the rows
    rows = c.slot_ms(False, 5, 1, np.array([0.0, 1.0, 1001.0]), shapes=False)
    assert rows[0] == 0.0 and rows[1] == rows[2] == pytest.approx(2 * k.launch)
    rows2 = c.slot_ms(False, 6, 2, np.array([1.0, 1001.0]))
    assert rows2[1] - rows2[0] == pytest.approx(k.copy_ms(1000 * 2880 * 2 * 2))
    assert np.ptp(c.slot_ms(True, 5, 1, np.array([1.0, 1000.0]), shapes=False)) == 0
    with pytest.raises(ValueError, match="slot path"):
        cal.curve(2880, 2880, slot_path="direct")


def test_dense_parts_from_the_gemm_rows():
    """With measured GEMM rows the projections of every layer and the head are one GEMM each at the rank's
    tokens: a row of c ms per GEMM adds exactly (layers + 1) x c per forward micro-step (3x in the update)."""
    from titan_foremoe.simulator.models import get_model
    from titan_foremoe.simulator.timing import stage_times

    m = get_model("gpt_oss_20b")
    rng = np.random.default_rng(0)
    M, L, R, E = 2, m.moe_layers, 4, 32
    loads = rng.integers(0, 50, size=(M, L, R, E))
    plan = plan_stage("static", loads, Topology.from_ranks(R, R), PlannerConfig(spare_slots=0))
    tokens = np.full((M, R), 500.0)
    pairs = np.full((M, R), 500.0 * 501 / 2)
    cal = load_calibration("h100")
    link = device_costs(cal, R)
    curve = cal.curve(m.dim, m.moe_hidden)
    calls = []

    def rows(c):
        def g(mm, n, k):
            calls.append((n, k))
            return np.full(np.shape(mm), c)
        return g

    for backward in (False, True):
        kw = dict(backward=backward, micro_steps_per_step=M, prev_idle_PR=None)
        t0 = stage_times(plan, loads, tokens, pairs, m, curve, link, dense_gemm=rows(0.0), **kw).dur_M
        t1 = stage_times(plan, loads, tokens, pairs, m, curve, link, dense_gemm=rows(0.5), **kw).dur_M
        assert t1 - t0 == pytest.approx(np.full(M, (L + 1) * 0.5e-3 * (3 if backward else 1)), rel=1e-9)
    assert (m.vocab, m.dim) in {(n, k) for n, k in calls}  # the head: one GEMM of vocab x dim


def _pipeline_period(r, t, s, staleness, shared, steps=40):
    """Brute-force schedule of the RL loop: rollout k needs the weights of train step k-1-staleness (synced),
    train k needs rollout k, sync k follows train k and holds both the engine and the trainer; shared: one pool
    runs everything (colocated). Returns the steady-state time per step."""
    eng = trn = 0.0  # when each pool is free
    roll_end, sync_end = {}, {0: 0.0}
    r_next = 1  # next rollout to generate
    for k in range(1, steps + 1):
        while r_next <= k + staleness and r_next - 1 - staleness <= k - 1:  # rollouts allowed before sync k
            start = max(eng, sync_end[max(r_next - 1 - staleness, 0)], trn if shared else 0.0)
            eng = roll_end[r_next] = start + r
            if shared:
                trn = eng
            r_next += 1
        start = max(trn, roll_end[k], eng if shared else 0.0)
        trn = start + t
        start = max(trn, eng)  # the broadcast waits for both sides
        eng = trn = sync_end[k] = start + s
    return (sync_end[steps] - sync_end[steps // 2]) / (steps - steps // 2)


def test_async_step_is_the_pipelines_steady_state():
    """rl_step_ms against a brute-force schedule of the loop: one-step off-policy on disaggregated pools is
    max(rollout, train) + sync, colocated (one pool) and synchronous are the sum; bad input is refused."""
    from titan_foremoe.simulator.rl_step import StepBranches, rl_step_ms

    rng = np.random.default_rng(0)
    for r, t, s in rng.uniform(1, 100, size=(20, 3)):
        b = StepBranches(r, s, t)
        for stale in (0, 1):
            for dis in (False, True):
                got = rl_step_ms(b, stale, dis)
                assert got["step_ms"] == pytest.approx(_pipeline_period(r, t, s, stale, not dis)), (r, t, s, stale, dis)
                assert got["step_ms_sync"] == pytest.approx(r + s + t)
                assert got["overlap_ms"] == pytest.approx(got["step_ms_sync"] - got["step_ms_async"])
    with pytest.raises(ValueError, match="max_staleness 2"):
        rl_step_ms(StepBranches(1, 1, 1), 2, True)


def test_async_step_in_the_simulator(tmp_path):
    """--max-staleness 0 keeps today's step; colocated async equals it but for the recompute planned ahead; with
    --rollout-gpus the trainer runs on the rest and the async step is max(rollout, train) + sync per balancer, a balancer's gain shown in full when
    training is the longer branch."""
    sim = _script("simulate_cluster")
    args = ["--trace", str(_trace(tmp_path)), "--model", "gpt_oss_20b", "--gpus", "8", "--gpus-per-node", "4",
            "--ep", "4", "--engine-gpus", "4", "--global-batch", "128", "--balancers", "static,foremoe", "--plan-ms", "2",
            "--slot-path", "gather"]  # the slower slot path keeps training the longer branch on 4 trainer GPUs
    out = {}
    for name, extra in (("base", []), ("col", ["--max-staleness", "1"]), ("dis", ["--max-staleness", "1", "--rollout-gpus", "4"])):
        assert sim.main(args + extra + ["--out", str(tmp_path / name)]) == 0
        out[name] = json.loads((tmp_path / name / "summary.json").read_text())
    base, col, dis = out["base"], out["col"], out["dis"]
    # colocated, the branches do not overlap; the recompute stage is planned ahead (no first plan, moves one
    # micro-step ahead), which static, planning nothing, does not notice
    assert col["static"]["step_ms"] == base["static"]["step_ms"]
    assert col["foremoe"]["step_ms"] < base["foremoe"]["step_ms"]
    for b in ("static", "foremoe"):
        assert col[b]["step_ms"] == col[b]["step_ms_sync"] and base[b]["step_ms"] == base[b]["step_ms_sync"]
        assert col[b]["overlap_ms"] == 0
        d, r = dis[b], dis["rollout"]
        assert d["step_ms"] == pytest.approx(max(r["rollout_ms"], d["train_ms"]) + r["weight_sync_ms"])
        assert d["step_ms_sync"] == pytest.approx(r["rollout_ms"] + d["train_ms"] + r["weight_sync_ms"])
    assert dis["setting"]["train_gpus"] == 4 and dis["rollout"]["engines"] == 1
    assert dis["setting"]["global_batch"] == base["setting"]["global_batch"]  # same work as the colocated cluster
    # training is the longer branch: the balancer's whole train-time gain is the async step's gain
    assert dis["static"]["longer_branch"] == dis["foremoe"]["longer_branch"] == "train"
    gain = dis["static"]["train_ms"] - dis["foremoe"]["train_ms"]
    assert dis["static"]["step_ms_async"] - dis["foremoe"]["step_ms_async"] == pytest.approx(gain)
    with pytest.raises(SystemExit):  # no GPU left for the trainer
        sim.main(args + ["--rollout-gpus", "8", "--out", str(tmp_path / "x")])


def test_off_is_static_without_the_slot_path(tmp_path):
    """Balancer "off" (torchtitan's own MoE path) is static's placement with no slot path. The gather path costs
    every other plan, ideal included, all C slots per rank whatever their tokens; the in-place path costs only the
    ranks whose spare slots run rows: nothing for static and ideal (no replica), so static is "off" there."""
    sim = _script("simulate_cluster")
    args = ["--synthetic", "--model", "gpt_oss_20b", "--gpus", "4", "--gpus-per-node", "2", "--ep", "4",
            "--responses-per-microstep", "4", "--global-batch", "8", "--updates-per-rollout", "2", "--spare-slots",
            "1", "--no-rollout", "--plan-ms", "1", "--balancers", "off,static,eplb_oracle,foremoe,ideal"]
    parts = {}
    for path in ("gather", "inplace"):
        assert sim.main(args + ["--slot-path", path, "--out", str(tmp_path / path)]) == 0
        s = json.loads((tmp_path / path / "summary.json").read_text())
        parts[path] = {b: s[b]["moe_parts_ms_per_microstep"] for b in ("off", "static", "eplb_oracle", "foremoe", "ideal")}
        p = parts[path]
        assert p["off"]["slot_gather"] == 0 and p["off"]["expert_work"] == pytest.approx(p["static"]["expert_work"])
        assert p["off"]["all_to_all"] == pytest.approx(p["static"]["all_to_all"])
        assert p["ideal"]["slot_gather"] == pytest.approx(p["static"]["slot_gather"])
        if path == "gather":  # all C slots copied whatever their tokens
            assert p["static"]["slot_gather"] > 0
            assert p["foremoe"]["slot_gather"] == pytest.approx(p["static"]["slot_gather"])
            assert s["off"]["train_ms"] < s["static"]["train_ms"]
        else:  # in place: only the ranks running rows on spare slots (foremoe's replicas; static has none)
            assert p["static"]["slot_gather"] == 0 and p["foremoe"]["slot_gather"] > 0
            assert s["off"]["train_ms"] == pytest.approx(s["static"]["train_ms"])
    # EPLB puts other experts in owned slots: the runtime falls back to gathering all slots there
    assert parts["inplace"]["eplb_oracle"]["slot_gather"] > 0.5 * parts["gather"]["eplb_oracle"]["slot_gather"]


def test_exact_row_plans_inside_nodes_and_exposes_the_pull_beyond_the_own_rows():
    """``exact``: the runtime's planner per (micro-step, layer): every rank at its node's quota, duplicates pulled
    from owners of the same node only; the exposed pull is the brute-force max over ranks of (expert time + the
    pull's excess over the own rows' share of it), minus the slowest rank's expert time."""
    from titan_foremoe.simulator.timing import _exact_pull_s

    rng = np.random.default_rng(2)
    topo = Topology.from_ranks(8, 4)
    loads = rng.multinomial(3000, rng.dirichlet(np.full(32, 0.3)), size=(2, 3, 8)).astype(np.int64)
    plan = plan_stage("exact", loads, topo)
    assert not plan.transfers_T["inter_node"].any() and len(plan.transfers_T)
    node_src = plan.transfers_T["src_rank"] // 4
    assert (node_src == plan.transfers_T["dst_rank"] // 4).all()
    rows_MLR = plan.assign_MLER.sum(axis=2)
    node_ML2 = loads.sum(axis=2).reshape(2, 3, 2, 16).sum(axis=3)
    assert (rows_MLR.reshape(2, 3, 2, 4).max(axis=3) - node_ML2 // 4 <= 1).all()
    cal = load_calibration("h100")
    link = device_costs(cal, 4)
    fwd = rng.uniform(1e-4, 1e-3, size=(2, 3, 8))
    nbytes = 50e6
    extra, busy = _exact_pull_s(plan, fwd, nbytes, link)
    sec = nbytes / link.copy_bw_P(nbytes)[0]
    for m in range(2):
        for layer in range(3):
            a = plan.assign_MLER[m, layer]
            want = []
            for r in range(8):
                dups = sum(1 for e in range(32) if a[e, r] > 0 and e // 4 != r)
                own = a[4 * r:4 * r + 4, r].sum() / max(a[:, r].sum(), 1)
                want.append(fwd[m, layer, r] + max(0.0, dups * sec - own * fwd[m, layer, r]))
            assert extra[m, layer] == pytest.approx(max(want) - fwd[m, layer].max())


def test_exact_row_charges_its_device_planner_per_layer(tmp_path):
    sim = _script("simulate_cluster")
    args = ["--synthetic", "--model", "gpt_oss_20b", "--gpus", "4", "--gpus-per-node", "4", "--ep", "4",
            "--responses-per-microstep", "4", "--global-batch", "8", "--updates-per-rollout", "2", "--no-rollout",
            "--balancers", "static,exact"]
    res = {}
    for us in (20, 1000):
        assert sim.main(args + ["--exact-plan-us", str(us), "--out", str(tmp_path / str(us))]) == 0
        res[us] = json.loads((tmp_path / str(us) / "summary.json").read_text())
    x = res[20]["exact"]
    assert x["max_over_mean"] == pytest.approx(1.0, abs=1e-3)  # one node: exact quotas
    assert x["transfer_bytes_per_rank"] > 0 and x["moe_parts_ms_per_microstep"]["slot_gather"] == 0
    # recompute and update each run updates_per_rollout (2) x micro-steps per step
    micro_steps = 2 * 2 * res[20]["setting"]["micro_steps_per_step_per_group"]
    layers = 24  # gpt_oss_20b's MoE layers
    assert res[1000]["exact"]["exposed_plan_ms"] - x["exposed_plan_ms"] == pytest.approx(0.98 * layers * micro_steps)


def test_owners_pay_for_landing_the_returned_replica_gradients():
    """The update stage charges each owner, per layer, the ``index_add_`` of the replica gradients returned to it
    (``TransferEngine.finish_gradients``, on its compute stream before FSDP's reduce-scatter): counted here by a
    loop over the plan's spare slots that ran rows (brute force), priced by ``GroupedMMCost.landing_ms`` (each row
    read, the owner's read and written, bf16). Forward stages and ``ideal`` pay none."""
    import dataclasses

    from titan_foremoe.planner.synthetic import synthetic_loads
    from titan_foremoe.simulator.models import get_model
    from titan_foremoe.simulator.timing import stage_times

    model = get_model("gpt_oss_20b")
    M, R, K = 2, 8, 4
    loads = synthetic_loads("qwen3_30b_a3b", M, R, 4, seed=1)[:, :model.moe_layers, :, :32]
    plan = plan_stage("foremoe", loads, Topology.from_ranks(R, 8), PlannerConfig(spare_slots=1), micro_steps_per_step=M)
    cal = load_calibration("h100")
    link, curve = device_costs(cal, R), cal.curve(model.dim, model.moe_hidden)
    tokens, pairs = loads.sum(axis=(1, 3)) / 4.0, np.full((M, R), 1e4)
    count = np.zeros((M, model.moe_layers, R))
    for m, l, r in np.ndindex(*count.shape):
        for e in plan.slots_MLRC[m, l, r, K:]:
            if e >= 0 and plan.assign_MLER[m, l, e, r] > 0 and plan.owner_MLE[m, l, e] != r:  # none to itself
                count[m, l, plan.owner_MLE[m, l, e]] += 1
    assert count.sum() > 0 and count.max() >= 2  # some owner receives two rows in a layer

    def times(p, backward=True):
        return stage_times(p, loads, tokens, pairs, model, curve, link, backward=backward, micro_steps_per_step=M,
                           prev_idle_PR=None)

    overlapped, curve = curve, dataclasses.replace(curve, landing_overlap=1.0)  # all of it on the compute stream
    got = times(plan).parts_M["grad_landing"]
    unit = curve.k.copy_ms(3 * (3 * model.dim * model.moe_hidden * 2)) + 3 * curve.k.launch
    want = np.where(count > 0, curve.k.copy_ms(count * 3 * (3 * model.dim * model.moe_hidden * 2))
                    + 3 * curve.k.launch, 0.0).mean(axis=2).sum(axis=1)
    assert got == pytest.approx(want) and (got > 0).all() and unit > 0.04  # a 50 MB row: tens of us per owner
    assert (times(plan, backward=False).parts_M["grad_landing"] == 0).all()
    ideal = dataclasses.replace(plan, info={**plan.info, "executable": False})  # how ``ideal`` is marked
    assert (times(ideal).parts_M["grad_landing"] == 0).all()
    # on the landing stream (``transfer/landing.py``) the compute stream pays its overlap share where it fits
    curve = overlapped
    half = times(plan).parts_M["grad_landing"]
    assert (half >= 0.5 * want - 1e-9).all() and (half < want).all()


def test_the_gate_waits_for_what_outlasts_its_window():
    """``_landing_exposed`` against hand-worked cases: window = the dispatch's backward all-to-all + 2x the
    block's dense forward; the return beyond it is waited for in full; the landing after it is charged its overlap
    share where it fits in what is left, in full beyond; the reactive runtimes pay the landing whole."""
    from titan_foremoe.simulator.timing import _landing_exposed

    a2a_ML = np.array([[1.0]])
    dense_MR = np.array([[2.0, 2.0, 2.0]])  # window 1 + 2 x 2 = 5 on each rank
    grad_MLPR = np.zeros((1, 1, 3, 3))
    grad_MLPR[0, 0, 0] = [1.0, 4.0, 7.0]  # the return: 1, 4 and 7 on the ranks' busiest paths
    land_MLR = np.array([[[2.0, 2.0, 2.0]]])
    land, late = _landing_exposed(land_MLR, dense_MR, a2a_ML, grad_MLPR, 0.5, overlapped=True)
    np.testing.assert_allclose(late, [[[0.0, 0.0, 2.0]]])  # only rank 2's return outlasts its window
    # rank 0: 4 left, all 2 fit: 1; rank 1: 1 left: 0.5 + 1; rank 2: none left: 2
    np.testing.assert_allclose(land, [[[1.0, 1.5, 2.0]]])
    # issued before the owned part of the expert backward (3 on each rank): the return gets that head start
    land, late = _landing_exposed(land_MLR, dense_MR, a2a_ML, grad_MLPR, 0.5, overlapped=True, head_MLR=3.0)
    np.testing.assert_allclose(late, [[[0.0, 0.0, 0.0]]])
    np.testing.assert_allclose(land, [[[1.0, 1.0, 1.5]]])  # rank 2: arrives at 4 of the window's 5
    land, late = _landing_exposed(land_MLR, dense_MR, a2a_ML, grad_MLPR, 0.5, overlapped=False)
    np.testing.assert_allclose(land, land_MLR)
    assert not late.any()
