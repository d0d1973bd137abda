"""Guards against NCCL hangs and silent divergence (issue 18 item 6, issue 23's config agreement).

* a stage's plan and splits: every rank of the EP group holds the same plan, and each send count equals its
  receiver's expectation; a plan or split monkeypatched on one rank gives the one-line ``DisagreementError``
  naming stage, micro-step, layer and ranks, not gloo's size error or a hang (2 gloo ranks);
* config and code at start-up: two ranks given different ``--optimizer.lr`` stop in the worker entry point with
  exit code 2 and one line naming the key (2 gloo ranks, the real ``train.__main__``);
* the NCCL flight recorder's buffer reaches torchtitan's ``init_distributed``; every group the project creates
  gets the job's timeout; ``ranks_per_node`` from ``LOCAL_WORLD_SIZE``.
"""

from __future__ import annotations

import io
import re
import sys
from contextlib import redirect_stderr
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from distributed_helpers import run_ranks
from titan_foremoe.config import ConfigError, load_config
from titan_foremoe.config.validate import ep_ranks_per_node, validate
from titan_foremoe.placement.tables import compile_stage, stage_splits
from titan_foremoe.planner import PlannerConfig, Topology, plan_stage

ROOT = Path(__file__).resolve().parents[1]
M, L, E, R = 4, 3, 8, 2


def _stage(seed: int = 0):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(E) * 0.3, size=L)
    loads = np.stack([[rng.multinomial(40, p[l], size=R) for l in range(L)] for _ in range(M)])
    plan = plan_stage("foremoe", loads, Topology.from_ranks(R, R), PlannerConfig(spare_slots=1), micro_steps_per_step=2)
    return plan, loads


def test_stage_splits_match_between_every_sender_and_receiver():
    """The oracle of ``check_splits``: on a consistent plan, rank r's send row to s is s's receive column from r."""
    rng = np.random.default_rng(3)
    Rb, p = 4, rng.dirichlet(np.ones(E) * 0.3, size=L)
    loads = np.stack([[rng.multinomial(40, p[l], size=Rb) for l in range(L)] for _ in range(M)])
    plan = plan_stage("foremoe", loads, Topology.from_ranks(Rb, 2), PlannerConfig(spare_slots=2), micro_steps_per_step=2)
    splits = [stage_splits(compile_stage(plan, loads, r, host_inter=True), Rb) for r in range(Rb)]
    send_RMLKS = np.stack([s for s, _ in splits])
    recv_SMLKR = np.stack([r for _, r in splits])
    assert send_RMLKS[:, :, :, 0].sum() == loads.sum() and send_RMLKS[:, :, :, 1:].sum() > 0  # tokens, moves
    np.testing.assert_array_equal(send_RMLKS, recv_SMLKR.transpose(4, 1, 2, 3, 0))


def _plan_ranks(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from titan_foremoe.distributed import agreement
    from titan_foremoe.placement import runtime as runtime_mod

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    plan, loads = _stage()
    tables = compile_stage(plan, loads, rank)

    def check(plan_, tables_):
        rt = SimpleNamespace(plan=plan_, loads_MLSE=loads, tables=tables_, engine=SimpleNamespace(group=group), R=R)
        try:
            runtime_mod.PlacementRuntime.check_agreement(rt, "update")
        except agreement.DisagreementError as e:
            return str(e)
        return None

    results = {"agree": check(plan, tables)}
    # rank 1 holds another plan (one count moved between ranks in micro-step 2, layer 1)
    other = plan
    if rank == 1:
        import copy

        other = copy.deepcopy(plan)
        a = other.assign_MLER[2, 1]
        e = int(np.argmax(a.sum(1)))
        a[e, 0] += 1
        a[e, 1] -= 1
    results["plan"] = check(other, tables)
    # rank 1's tables send one token row too many to rank 0 in micro-step 3, layer 2 (the plan is the same)
    real = runtime_mod.stage_splits

    def skewed(tables_, n):
        send, recv = real(tables_, n)
        if rank == 1:
            send[3, 2, 0, 0] += 1
        return send, recv

    runtime_mod.stage_splits = skewed
    results["splits"] = check(plan, tables)
    runtime_mod.stage_splits = real
    # config: the same check the trainer runs at start-up, on items that differ in one key
    items = {"[training] steps": 3, "[optimizer] lr": 3e-3 if rank == 0 else 1e-3, "[job] seed": 0}
    try:
        agreement.check_same("config and code", items, group)
        results["config"] = None
    except agreement.DisagreementError as e:
        results["config"] = str(e)
    Path(out, f"rank{rank}.txt").write_text(repr(results))
    dist.destroy_process_group()


def test_plan_and_split_disagreement_is_a_clear_error(tmp_path):
    run_ranks(_plan_ranks, 2, str(tmp_path), apply_patches=False)
    res = [eval((tmp_path / f"rank{r}.txt").read_text()) for r in range(2)]
    assert res[0] == res[1]  # every rank raises the same line
    r = res[0]
    assert r["agree"] is None
    assert r["plan"] == ("update stage (foremoe): plan: ranks disagree on assignment of micro-step 2 layer 1: "
                         + re.search(r"rank 0 \d+; rank 1 \d+", r["plan"]).group(0))
    assert r["splits"] == ("update stage (foremoe): micro-step 3 layer 2: rank 1 sends "
                           + re.search(r"\d+ rows \(tokens\) to rank 0, which expects \d+", r["splits"]).group(0))
    a, b = map(int, re.findall(r"sends (\d+) .* expects (\d+)", r["splits"])[0])
    assert a == b + 1
    assert r["config"] == "config and code: ranks disagree on [optimizer] lr: rank 0 0.003; rank 1 0.001"


def _main_ranks(rank: int, world: int, out: str) -> None:
    from titan_foremoe.train.__main__ import main

    lr = "3e-3" if rank == 0 else "1e-3"
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(["--job.config_file", str(ROOT / "train_configs" / "debug_tiny_cpu.toml"),
                     f"--job.dump_folder={out}/job", f"--optimizer.lr={lr}", "--comm.init_timeout_seconds=60",
                     "--parallelism.expert_parallel_degree=2", "--training.steps=1"])  # valid on 2 ranks
    Path(out, f"rank{rank}.txt").write_text(f"{code}\n{err.getvalue()}")


def test_ranks_with_different_overrides_stop_at_start_up(tmp_path):
    run_ranks(_main_ranks, 2, str(tmp_path))
    codes = [(tmp_path / f"rank{r}.txt").read_text().split("\n", 1) for r in range(2)]
    assert [c for c, _ in codes] == ["2", "2"]
    line = "error: config and code: ranks disagree on [optimizer] lr: rank 0 0.003; rank 1 0.001\n"
    assert codes[0][1].endswith(line) and line not in codes[1][1]


def test_flight_recorder_reaches_torchtitan(monkeypatch, tmp_path):
    from torchtitan.config import CommConfig

    from titan_foremoe.distributed import groups, parallelize

    seen = []
    monkeypatch.setattr(parallelize.dist_utils, "init_distributed", lambda c, **kw: seen.append(c) or 1)
    monkeypatch.setattr(groups, "_timeout", None)
    cfg = load_config(ROOT / "train_configs" / "debug_tiny_cpu.toml", [f"--job.dump_folder={tmp_path}"])
    parallelize.init_distributed(cfg)
    assert seen[0].trace_buf_size == CommConfig().trace_buf_size > 0  # torchtitan's default: recorder on
    assert groups.current_timeout() == timedelta(seconds=cfg.comm.init_timeout_seconds)
    cfg = load_config(ROOT / "train_configs" / "debug_tiny_cpu.toml", ["--comm.trace_buf_size=0"])
    parallelize.init_distributed(cfg)
    assert seen[1].trace_buf_size == 0
    with pytest.raises(ConfigError, match=r"^\[comm\] trace_buf_size: must be >= 0, got -1$"):
        validate(load_config(ROOT / "train_configs" / "debug_tiny_cpu.toml", ["--comm.trace_buf_size=-1"]), 4)


GROUP_CALLS = re.compile(r"\b(?:dist|torch\.distributed)\.(new_group|new_subgroups\w*)\(")


def test_every_group_the_project_creates_gets_the_job_timeout(monkeypatch, tmp_path):
    """Only ``distributed/groups.py`` creates groups; they get the timeout in effect, and ``set_timeouts`` moves
    them all (twin group, host lane's gloo group, re-layout group: the same ``subgroups``)."""
    import torch.distributed as dist

    from titan_foremoe.distributed import groups
    from titan_foremoe.placement.relayout import replica_group
    from titan_foremoe.transfer.groups import twin_group

    makers = {p.relative_to(ROOT).as_posix() for p in (ROOT / "titan_foremoe").rglob("*.py")
              if GROUP_CALLS.search(p.read_text())}
    assert makers == {"titan_foremoe/distributed/groups.py"}
    monkeypatch.setattr(groups, "_groups", [])
    monkeypatch.setattr(groups, "_timeout", timedelta(seconds=300))
    calls = []
    real = dist.new_subgroups_by_enumeration
    monkeypatch.setattr(dist, "new_subgroups_by_enumeration", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "ep"))
        made = [twin_group(dist.group.WORLD), twin_group(dist.group.WORLD, backend="gloo"),
                replica_group(distribute_tensor(torch.zeros(2, 2), mesh, [Shard(0), Shard(0)]))]
        assert [kw["timeout"] for kw in calls] == [timedelta(seconds=300)] * 3
        timeout = lambda g: g._get_backend(torch.device("cpu")).options._timeout  # noqa: E731
        assert [timeout(g) for g in made] == [timedelta(seconds=300)] * 3
        groups.set_timeouts(timedelta(seconds=42))  # what set_train_timeouts does after the first step
        assert [timeout(g) for g in made] == [timedelta(seconds=42)] * 3
    finally:
        dist.destroy_process_group()


def test_ranks_per_node_from_local_world_size(monkeypatch):
    assert [ep_ranks_per_node(0, 8, None), ep_ranks_per_node(0, 8, "4"), ep_ranks_per_node(0, 4, "8"),
            ep_ranks_per_node(2, 8, "4")] == [8, 4, 4, 2]
    with pytest.raises(ConfigError, match=r"LOCAL_WORLD_SIZE = 3, which neither divides"):
        ep_ranks_per_node(0, 8, "3")
    on = ["--parallelism.expert_parallel_degree=4", "--balance.balancer=foremoe"]
    cfg = load_config(ROOT / "train_configs" / "debug_tiny_rl.toml", on)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two nodes of 2 processes: EP 4 spans them
    assert validate(cfg, 4).ranks_per_node == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert validate(cfg, 4).ranks_per_node == 4


def _same(a, b) -> bool:
    """Recursive equality of dataclasses, lists and arrays (the tables)."""
    import dataclasses

    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def test_planner_process_gives_the_thread_plan_and_tables():
    from titan_foremoe.planner.planahead import StagePlanner
    from titan_foremoe.train.placement_plans import PlanTables

    rng = np.random.default_rng(5)
    Rb, p = 4, rng.dirichlet(np.ones(E) * 0.3, size=L)
    loads = np.stack([[rng.multinomial(40, p[l], size=Rb) for l in range(L)] for _ in range(M)])
    out = {}
    for mode in ("thread", "process"):
        with StagePlanner(mode) as planner:
            out[mode] = planner.submit("foremoe", loads, Topology.from_ranks(Rb, 2), PlannerConfig(spare_slots=2),
                                       micro_steps_per_step=2, then=PlanTables(loads, 1, False, True)).result()
    (pt, tt), (pp, tp) = out["thread"], out["process"]
    for name in ("slots_MLRC", "assign_MLER", "owner_MLE", "transfers_T"):
        assert _same(getattr(pt, name), getattr(pp, name)), name
    assert _same(tt, tp) and len(tt) == M and pp.assign_MLER.sum() == loads.sum()
    with pytest.raises(ValueError, match="planner mode must be one of"):
        StagePlanner("fork")
