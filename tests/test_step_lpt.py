"""``step_lpt`` (RoutePack-style: one placement per optimizer step from the step's replayed loads, per-layer LPT):
the plan's contract against brute force, and in the trainer the same losses and parameters as ``off``.

Planner: owners stay in place (the first K slots), each rank's S spare slots are the same in every micro-step of a
step, a copy never sits on a rank that holds that expert, every token is assigned, copies move only at step
boundaries; LPT's straggler on the step's loads is within 4/3 of the best placement of the same copies found by
exhaustive search on tiny layers (Graham's bound for LPT). Trainer: two RL steps on 4 gloo ranks (EP 4, one spare
slot) with ``step_lpt`` and ``off``: equal losses and final parameters (fp32, relative difference <= 1e-5)."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from distributed_helpers import run_ranks
from titan_foremoe.planner import PlannerConfig, Topology, plan_stage
from titan_foremoe.planner.step_lpt import lpt_slots


def _loads(seed, M=4, L=3, R=4, E=8):
    rng = np.random.default_rng(seed)
    return rng.poisson(rng.lognormal(3.0, 1.2, size=(M, L, R, E))).astype(np.int64)


def test_plan_contract():
    loads = _loads(0)
    M, L, R, E = loads.shape
    K = E // R
    p = plan_stage("step_lpt", loads, Topology.from_ranks(R, 2), PlannerConfig(spare_slots=1), micro_steps_per_step=2)
    assert (p.assign_MLER.sum(axis=3) == loads.sum(axis=2)).all()  # every token on some rank
    owned = np.arange(E).reshape(R, K)
    assert (p.slots_MLRC[..., :K] == owned).all()  # owners read in place
    assert (p.slots_MLRC[0] == p.slots_MLRC[1]).all() and (p.slots_MLRC[2] == p.slots_MLRC[3]).all()
    spare = p.slots_MLRC[..., K:]
    assert not (spare[..., 0][..., None] == np.broadcast_to(owned, (M, L, R, K))).any()  # never its own expert
    # tokens only on the step's copies; copies move only at the step's first micro-step, from the owner
    hosts = np.zeros((M, L, E, R), dtype=bool)
    m, l, r, c = np.nonzero(p.slots_MLRC >= 0)
    hosts[m, l, p.slots_MLRC[m, l, r, c], r] = True
    assert not ((p.assign_MLER > 0) & ~hosts).any()
    assert set(p.transfers_T["micro_step"].tolist()) <= {0, 2}
    assert (p.transfers_T["src_rank"] == p.transfers_T["expert"] // K).all()
    assert p.info["owners_are_layout"]


def _even_loads(w_E, spare_R, R, K):
    """Rank loads when every expert's load splits evenly over its hosts (its owner and its copies)."""
    E = len(w_E)
    hosts = np.zeros((E, R), dtype=bool)
    hosts[np.arange(E), np.arange(E) // K] = True
    for r, e in enumerate(spare_R):
        if e >= 0:
            hosts[e, r] = True
    return (hosts * (w_E / hosts.sum(axis=1))[:, None]).sum(axis=0)


def test_lpt_near_exhaustive_optimum():
    """The straggler of the step's loads split evenly over the copies, against every filling of the spare slots
    (each rank one spare: any expert it does not own, or none; 9^4 placements) on tiny layers."""
    R, E, S = 4, 8, 1
    K = E // R
    ratios = []
    for seed in range(20):
        w = np.random.default_rng(seed).lognormal(3.0, 1.0, size=E)
        best = min(_even_loads(w, c, R, K).max() for c in itertools.product(range(-1, E), repeat=R)
                   if all(e < 0 or e // K != r for r, e in enumerate(c)))
        got = _even_loads(w, lpt_slots(w[None], R, S)[0, :, K], R, K).max()
        ratios.append(got / best)
    assert min(ratios) >= 1 - 1e-12  # the oracle is the optimum
    assert max(ratios) <= 1.25 and np.mean(ratios) <= 1.10, sorted(ratios)  # measured: 1.08 mean, 1.18 max
    assert _even_loads(w, lpt_slots(w[None], R, S)[0, :, K], R, K).max() < w.reshape(R, K).sum(axis=1).max()


def test_one_line_on_bad_loads():
    import pytest
    with pytest.raises(ValueError, match="source ranks"):
        plan_stage("step_lpt", _loads(1), Topology.from_ranks(8, 8))


def _two_steps(rank, world_size, tmp, out_path, balancer):
    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer

    cfg = load_config("train_configs/debug_tiny_rl.toml", [
        f"--job.dump_folder={tmp}/{balancer}", "--metrics.enable_tensorboard=false", "--rl.sft_warmup_steps=0",
        "--training.steps=2", f"--balance.balancer={balancer}", "--balance.spare_slots=1",
    ])
    trainer = RLTrainer(cfg)
    summary = trainer.train()
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in trainer.model.named_parameters()}
    trainer.close()
    if rank == 0:
        torch.save({"summary": summary, "params": params}, out_path)
    dist.destroy_process_group()


def test_step_lpt_trains_as_off(tmp_path):
    res = {}
    for balancer in ("off", "step_lpt"):
        out_path = tmp_path / f"{balancer}.pt"
        run_ranks(_two_steps, 4, str(tmp_path), str(out_path), balancer)
        res[balancer] = torch.load(out_path)
    off, lpt = res["off"]["summary"], res["step_lpt"]["summary"]
    assert len(off["loss"]) == len(lpt["loss"]) == 2
    for a, b in zip(off["loss"], lpt["loss"]):
        assert abs(a - b) <= 1e-5 * max(abs(a), 1e-3)
    for name, p in res["off"]["params"].items():
        q = res["step_lpt"]["params"][name]
        assert ((p - q).norm() / p.norm()).item() <= 1e-5, name
    assert lpt["placement/step_rows_minus_routed"] == [0.0] * 2  # every routed pair computed once
    assert min(lpt["placement/step_replicas"]) > 0 and sum(lpt["transfer/step_moves"]) > 0
