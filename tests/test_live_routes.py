"""Routes the engine did not record (``-1``): accepted on import, routed live by the recompute, replayed after.

The multi-rank test (2 gloo ranks, EP 2, a placement balancer) imports the same embedded rollouts twice,
once whole and once with holes punched into one rank's rows. The brute-force reference for a hole is the
expert set the rollout's own decode picked there (same weights): the run with holes must fill every hole
with exactly it, so losses, foresight loads and placement rows equal the run without holes, and
``rollout/live_routed_tokens`` counts the holes' tokens.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import torch

from distributed_helpers import run_ranks, train_recording_samples
from titan_foremoe.rollouts import ModelSpec, RolloutStore
from titan_foremoe.rollouts.sample import RolloutError, RolloutSample, to_logical, validate_sample
from titan_foremoe.rollouts.store import RolloutWriter
from titan_foremoe.routing_log import RoutingLog
from titan_foremoe.routing_log.log import RoutingLogError

SPEC = ModelSpec(num_layers=2, top_k=2, num_experts=4, vocab_size=50)


def _sample(routes):
    T = routes.shape[0] + 1
    return RolloutSample(np.arange(1, T + 1), 2, np.asarray(routes))


def test_validation_accepts_whole_holes_and_refuses_partial_ones():
    r = np.array([[[0, 1], [2, 3]], [[-1, -1], [1, 2]], [[3, 0], [-1, -1]]])
    validate_sample(_sample(r), SPEC, "s")  # a hole is -1 in all top-k entries of (position, layer)
    partial = r.copy()
    partial[0, 0] = [-1, 2]
    with pytest.raises(RolloutError, match="-1 in all top-k entries"):
        validate_sample(_sample(partial), SPEC, "s")
    # a physical-to-logical map leaves holes as holes
    logical = to_logical(r, np.array([[3, 2, 1, 0], [0, 1, 2, 3]]), "s")
    assert (logical[1, 0] == -1).all() and (logical[2, 1] == -1).all() and logical[0, 0].tolist() == [3, 2]


def test_store_round_trip_and_log_holes(tmp_path):
    r = np.array([[[0, 1], [2, 3]], [[-1, -1], [1, 2]], [[3, 0], [-1, -1]]])
    w = RolloutWriter(tmp_path / "d", SPEC)
    w.add(_sample(r), 0)
    whole = r.copy()
    whole[1, 0], whole[2, 1] = [2, 3], [0, 1]
    w.add(_sample(whole[:2]), 1)
    index = w.close()
    assert index["has_no_route"] and index["route_dtype"] == "uint8"
    st = RolloutStore(tmp_path / "d")
    assert np.array_equal(st.read(0).routes_RXK, r) and np.array_equal(st.read(1).routes_RXK, whole[:2])
    log = RoutingLog.from_sequences([torch.from_numpy(st.read(i).routes_RXK) for i in (0, 1)], [4, 3], 4)
    assert log.holes() == 2 and log.live_BTX[0, 1, 0] and log.live_BTX[0, 2, 1] and not log.live_BTX[1].any()
    log.validate(token_lengths=[4, 3], num_layers=2, top_k=2, num_experts=4)
    inputs = log.routes_for_inputs(3)
    assert (inputs[0, 1, 0] == -1).all() and (inputs[0, 2, 1] == -1).all() and (inputs[1] >= 0).all()
    with pytest.raises(ValueError, match="without a route"):
        from titan_foremoe.loads import micro_step_loads
        micro_step_loads(log, [[0, 1]])
    used = torch.from_numpy(whole).to(torch.int64)[None].expand(2, -1, -1, -1)
    log.fill_holes([0, 1], used)
    assert log.live_BTX is None and torch.equal(log.experts_BTXK[0, :3].long(), torch.from_numpy(whole))
    with pytest.raises(RoutingLogError, match="-1 in all top-k"):
        RoutingLog.from_sequences([torch.tensor([[[0, -1], [1, 2]]])], [2], 4)


def test_router_fills_only_the_holes():
    from titan_foremoe.models.build import Linear, _LINEAR_INIT
    from titan_foremoe.models.moe import ReplayRouter

    torch.manual_seed(0)
    router = ReplayRouter(ReplayRouter.Config(
        num_experts=6, top_k=2, score_func="softmax", route_norm=False,
        gate=Linear.Config(in_features=8, out_features=6, param_init=_LINEAR_INIT)))
    with torch.no_grad():
        router.gate.weight.normal_()
    x = torch.randn(2, 5, 8)
    _, live, _ = router(x)
    logged = (live + 1) % 6  # every token differs from the live choice
    logged[0, 1] = -1
    logged[1, 4] = -1
    router.logged_expert_ids_BLK, router.holes = logged, True
    _, used, _ = router(x)
    hole = (logged < 0).all(-1)
    assert torch.equal(used[hole], live[hole]) and torch.equal(used[~hole], logged[~hole])
    assert int(router.mismatch_count) == int((~hole).sum())  # holes take the live experts: no mismatch


OVERRIDES = ["--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0", "--training.steps=2",
             "--training.local_batch_size=4", "--training.global_batch_size=8", "--rl.samples_per_prompt=4",
             "--rl.updates_per_rollout=1", "--rl.save_loads=true", "--parallelism.expert_parallel_degree=2",
             # the balanced schedule spreads expert signatures only when every route is known before the recompute,
             # which a directory with holes is not: rollout order lays out both runs' micro-steps alike
             "--rl.sequence_schedule=rollout_order"]
# (row, positions, layers) punched out of rank 0's rows of step 0; rank 1 and step 1 keep every route
HOLES = [(0, [1, 2, 3], [0, 1, 2, 3]), (2, [0, 5], [1]), (3, [-1], [3])]


def _run(rank, world_size, tmp, out_path):
    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.rollouts import import_rollouts
    from titan_foremoe.rollouts.export import write_engine_file
    from titan_foremoe.train.rl_trainer import RLTrainer

    def trainer_for(name, extra=()):
        cfg = load_config("train_configs/debug_tiny_rl.toml", [f"--job.dump_folder={tmp}/{name}", *OVERRIDES, *extra])
        return RLTrainer(cfg)

    _, samples = train_recording_samples(trainer_for("embedded"), rank, world_size, samples_per_prompt=4)
    holes = 0
    if rank == 0:
        spec = ModelSpec(4, 2, 8, 64)
        write_engine_file("vllm", samples, f"{tmp}/whole.jsonl", samples_per_prompt=4)
        import_rollouts("vllm", [f"{tmp}/whole.jsonl"], f"{tmp}/whole", spec)
        for row, positions, layers in HOLES:
            r = samples[row].routes_RXK
            for p in positions:
                r[p, layers] = -1
            holes += len(positions)
        write_engine_file("vllm", samples, f"{tmp}/holes.jsonl", samples_per_prompt=4)
        import_rollouts("vllm", [f"{tmp}/holes.jsonl"], f"{tmp}/holes", spec)
    dist.barrier()
    results = {"n_holes": holes}
    for name, d, extra in [("whole", "whole", []), ("holes", "holes", []),
                           ("holes_static", "holes", ["--balance.balancer=static"])]:
        t = trainer_for(name, ["--rl.rollout_source=file", f"--rl.rollout_dir={tmp}/{d}", *extra])
        results[name] = t.train()
        t.close()
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


def test_holes_are_routed_live_like_the_rollout(tmp_path):
    out_path = tmp_path / "out.pt"
    run_ranks(_run, 2, str(tmp_path), str(out_path))
    res = torch.load(out_path, weights_only=False)
    whole, holes, static = res["whole"], res["holes"], res["holes_static"]
    assert res["n_holes"] == 6
    assert "rollout/live_routed_tokens" not in whole  # a directory without holes: the old path, no new metric
    assert holes["rollout/live_routed_tokens"] == [6.0, 0.0] == static["rollout/live_routed_tokens"]
    for got in (holes, static):
        for a, b in zip(whole["loss"], got["loss"]):
            assert abs(a - b) <= 1e-5 * max(abs(a), 1e-3), (whole["loss"], got["loss"])
        assert got["rl/recompute_route_mismatch"] == [0.0, 0.0] and got["rl/route_mismatch"] == [0.0, 0.0]
        assert got["placement/step_rows_off_plan"] == [0.0, 0.0]
        assert got["placement/step_rows_minus_routed"] == [0.0, 0.0]
    assert holes["foresight/step_static_max_over_mean"] == whole["foresight/step_static_max_over_mean"]
    a = sorted(glob.glob(str(tmp_path / "whole" / "loads" / "*.pt")))
    b = sorted(glob.glob(str(tmp_path / "holes" / "loads" / "*.pt")))
    assert [os.path.basename(p) for p in a] == [os.path.basename(p) for p in b] and a
    for x, y in zip(a, b):  # the holes were filled with the rollout's own experts before planning
        assert torch.equal(torch.load(x)["loads_MLSE"], torch.load(y)["loads_MLSE"])


def test_no_route_in_an_unsigned_wire_buffer():
    """vLLM sends uint16 beyond 256 experts: a -1 written into it arrives as 65535 and means no route."""
    import base64

    from titan_foremoe.rollouts.formats import read_sglang

    r = np.array([[[300, 1]], [[65535, 65535]], [[2, 299]]], dtype=np.uint16)
    rec = {"input_ids": [1, 2], "output_ids": [3, 4],
           "meta_info": {"routed_experts": base64.b64encode(r.tobytes()).decode(), "routed_experts_dtype": "uint16"}}
    got = read_sglang(rec, "x", (1, 2))[0]
    assert got.routes_RXK.tolist() == [[[300, 1]], [[-1, -1]], [[2, 299]]]
    validate_sample(got, ModelSpec(1, 2, 512, 10), "x")
