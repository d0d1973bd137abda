"""Host metadata never reaches a backend without a CPU side, and only ``collectives`` calls collectives on it.

No NCCL here: the NCCL-only group is a mock whose collectives raise when handed
one of the caller's host tensors (NCCL's "no backend for device type cpu"),
simulating two ranks that hold the same values. On this CPU-only machine the
"device" the helper stages on is the CPU, so what is checked is that the
caller's host tensor itself is never handed over (a staged copy is) and that
values come back right; with a ``cuda:nccl,cpu:gloo`` group the host tensor goes
as it is (no staging). The grep test keeps every other module off raw collectives.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from titan_foremoe.distributed import collectives

ROOT = Path(__file__).resolve().parents[1] / "titan_foremoe"
RAW = re.compile(
    r"\b(?:dist|torch\.distributed)\.(all_reduce|all_gather\w*|broadcast\w*|reduce_scatter\w*|reduce|gather|scatter"
    r"|all_to_all\w*|barrier|send|recv|isend|irecv)\(|_functional_collectives import (\w+)"
)
# device tensors only: the token all-to-all and the replica weight moves (host staging: the EP group's gloo half)
ALLOWED = {
    "distributed/collectives.py": None,
    "models/dispatch.py": {"all_to_all_single"},
    "models/decode_dispatch.py": {"all_to_all_single"},  # decode steps: fixed-capacity token exchange
    "transfer/engine.py": {"all_to_all_single", "all_gather_into_tensor"},
    "transfer/groups.py": {"all_gather_object"},  # start-up: every EP group's ranks, to build the twin groups
    "placement/relayout.py": {"all_to_all_single"},  # expert rows and optimizer state: on the parameters' device
    # SGLang's weight-update group (trainer rank 0 and the engine's workers, device tensors): not a trainer group
    "rollouts/engines/sglang_weights.py": {"broadcast"},
    # the weight sync's gather of each state-dict entry to the source rank only, or whole on every rank (the
    # colocated IPC sync's all_gather_full); device tensors, each slice crossing nodes once per node
    "rollouts/engines/vllm_weights.py": {"all_gather", "gather"},
}


def test_no_raw_collectives_outside_the_helper():
    seen: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for m in RAW.finditer(path.read_text()):
            seen.setdefault(rel, set()).add(m.group(1) or m.group(2))
    assert "all_to_all_single" in seen.get("models/dispatch.py", set())  # the pattern does find calls
    assert "all_gather_into_tensor" in seen["distributed/collectives.py"]
    offenders = {f: calls for f, calls in seen.items() if f not in ALLOWED or (
        ALLOWED[f] is not None and not calls <= ALLOWED[f])}
    assert not offenders, f"collectives outside titan_foremoe/distributed/collectives.py: {offenders}"


class _MockGroup:
    def __init__(self, devices: list[str]):
        self.devices = devices


def _mock_dist(group: _MockGroup, host_tensors: list[torch.Tensor], calls: list[str]):
    """Two ranks with equal values; raises, as NCCL does, if handed a caller's host tensor without a CPU backend."""

    def check(*tensors):
        for t in tensors:
            if "cpu" not in group.devices and any(
                t.untyped_storage().data_ptr() == h.untyped_storage().data_ptr() for h in host_tensors
            ):
                raise RuntimeError("No backend type associated with device type cpu")

    def all_reduce(t, op=None, group=None):
        check(t)
        calls.append("all_reduce")
        t.mul_(2) if op in (None, collectives.ReduceOp.SUM) else None

    def all_gather_into_tensor(out, t, group=None):
        check(out, t)
        calls.append("all_gather")
        out.copy_(torch.cat([t, t]))

    def broadcast(t, src, group=None):
        check(t)
        calls.append("broadcast")

    return types.SimpleNamespace(
        is_initialized=lambda: True, get_world_size=lambda group=None: 2, all_reduce=all_reduce,
        all_gather_into_tensor=all_gather_into_tensor, broadcast=broadcast, ReduceOp=collectives.ReduceOp,
    )


@pytest.mark.parametrize("devices", [["cuda"], ["cuda", "cpu"]])
def test_host_tensors_never_reach_a_cpu_less_group(monkeypatch, devices):
    group = _MockGroup(devices)
    loads = torch.arange(24, dtype=torch.int64).view(2, 3, 4)
    metrics = torch.tensor([1.0, 2.0, 3.0])
    flag = torch.tensor([1])
    calls: list[str] = []
    monkeypatch.setattr(collectives, "dist", _mock_dist(group, [loads, metrics, flag], calls))
    monkeypatch.setattr(collectives, "_device_capability", lambda g: g.devices)
    monkeypatch.setattr(collectives, "staging_device", lambda g: torch.device("cpu"))

    out = collectives.all_gather(loads, group)
    assert out.shape == (2, 2, 3, 4) and out.device.type == "cpu" and torch.equal(out[1], loads)
    assert collectives.all_reduce(metrics, group=group) is metrics and metrics.tolist() == [2.0, 4.0, 6.0]
    assert collectives.broadcast(flag, 0, group) is flag
    assert calls == ["all_gather", "all_reduce", "broadcast"]

    # the mock does refuse a host tensor handed straight to a CPU-less group
    raw = _mock_dist(group, [metrics], [])
    if devices == ["cuda"]:
        with pytest.raises(RuntimeError, match="device type cpu"):
            raw.all_reduce(metrics)
    else:
        raw.all_reduce(metrics)


def test_mixed_group_needs_no_staging(monkeypatch):
    """With the ``cpu:gloo`` half present the helper hands the host tensor itself (no copy)."""
    group = _MockGroup(["cuda", "cpu"])
    monkeypatch.setattr(collectives, "_device_capability", lambda g: g.devices)
    t = torch.ones(3)
    buf, staged = collectives._stage(t, group)
    assert buf is t and not staged
    group.devices = ["cuda"]
    monkeypatch.setattr(collectives, "staging_device", lambda g: torch.device("cpu"))
    buf, staged = collectives._stage(t, group)
    assert staged and buf.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and NCCL")
def test_real_nccl_group_takes_host_metadata(tmp_path, monkeypatch):
    """One process: an NCCL-only group refuses host tensors; the helper stages them; a mixed group takes them."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        monkeypatch.setattr(collectives, "active", lambda group=None: True)
        assert not collectives.host_capable()
        with pytest.raises(Exception):
            dist.all_reduce(torch.ones(2))
        assert collectives.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]
        mixed = dist.new_group([0], backend="cuda:nccl,cpu:gloo")
        assert collectives.host_capable(mixed)
        assert collectives.all_gather(torch.ones(2), mixed).shape == (1, 2)
    finally:
        dist.destroy_process_group()
