"""The CUDA path executed on CPU under the checked backend (``distributed/checked.py``, ``[debug] check_streams``).

The RL step runs through ``run_train.sh`` on 4 gloo ranks, EP 2 (experts FSDP-sharded over 2: transfers are
issued inside the layers' forwards, with a window), full activation checkpointing, for the four balancers
(foremoe with a re-layout and off through the self-test's rung 2, which also compares their losses), with no
sanitizer report and no host sync inside a stage's micro-steps. Faults put
into the workers through a ``sitecustomize`` hook must each fail: the transfer's first-use wait removed (the
sanitizer: the compute stream reads bank rows the collective wrote), an ``.item()`` in every MoE layer's forward
(strict mode), a micro-batch the plan was not made for (one error on every rank, before any all-to-all). The removed ``record_stream`` and the checker's own verdicts are tested in one process: they
need no job.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed_helpers import rerun_if_killed

from titan_foremoe import selftest
from titan_foremoe.distributed import device as dev
from titan_foremoe.distributed.checked import HostSyncError, StreamError, checking

ROOT = Path(__file__).resolve().parents[1]
JOB = [*selftest.RL_STEP, "--debug.check_streams=true"]  # one RL step (two optimizer steps), EP 2, full AC

FAULTS = {
    # the first-use wait of a transfer: neither the collective's work nor the side stream's event is waited on
    "no_wait": """
        from titan_foremoe.transfer.engine import TransferEngine
        def wait(self, layer):
            lb = self.layers.get(layer)
            if lb is not None and lb.pending is not None:
                lb.pending = None
                self.layers_in_flight -= 1
        TransferEngine.wait = wait
    """,
    "item_in_layer": """
        from titan_foremoe.models import moe as _moe
        _forward = _moe.MaskedMoE.forward
        def forward(self, x, *a, **k):
            x.detach().abs().sum().item()
            return _forward(self, x, *a, **k)
        _moe.MaskedMoE.forward = forward
    """,
    # rank 1's micro-batch 0 has a token fewer than the plan was made for (a plan from other loads); exact's runtime
    # has its own start_stage (no plan: it sizes quotas from the loads)
    "batch_off_plan": """
        import os
        from titan_foremoe.placement.exact import ExactRuntime
        from titan_foremoe.placement.runtime import PlacementRuntime
        def off_by_one(cls):
            _start = cls.start_stage
            def start_stage(self, plan, loads, tables=None, name="stage", tokens_M=None):
                if tokens_M is not None and os.environ.get("RANK") == "1":
                    tokens_M = tokens_M.copy()
                    tokens_M[0] -= 1
                return _start(self, plan, loads, tables, name, tokens_M)
            cls.start_stage = start_stage
        for cls in (PlacementRuntime, ExactRuntime):
            off_by_one(cls)
    """,
}


def _job(tmp_path: Path, balancer: str, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """One RL step under the checked backend on 4 ranks (efsdp 2); with a fault, on 2 ranks (efsdp 1)."""
    env = dict(os.environ, NGPU="4" if fault is None else "2", LOG_RANK="0", PYTHON=sys.executable)
    if fault is not None:
        extra = ("--training.global_batch_size=8", *extra)
    if fault is not None:
        hook = tmp_path / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(textwrap.dedent(FAULTS[fault]))
        env["PYTHONPATH"] = os.pathsep.join([str(hook), env.get("PYTHONPATH", "")])
    return subprocess.run([str(ROOT / "run_train.sh"), f"--job.dump_folder={tmp_path / 'out'}",
                           f"--balance.balancer={balancer}", *JOB, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _clean(out: str) -> None:
    assert "check_streams: finished" in out, out[-4000:]
    assert "StreamError" not in out and "HostSyncError" not in out and "IssueOrderError" not in out
    assert "host tensors in device ops" not in out, out[-4000:]  # on CUDA each such op raises
    # NCCL's issue order across the EP group and its twins agreed at every stage boundary (issue_order.py)
    m = re.search(r"collective issue order agreed at (\d+) checks .*?\[0, 1\]: (\d+)", out)
    assert m and int(m.group(1)) >= 2 and int(m.group(2)) > 0, out[-4000:]


@pytest.mark.parametrize("balancer", ["static", "reactive", "exact"])
def test_rl_step_is_clean_under_the_checked_backend(tmp_path, balancer):
    # exact's known 4-rank gloo heap crash on torch 2.13 CPU (docs/testing.md: a rank dies with ``malloc():
    # unaligned tcache chunk detected``, a crash, not a wrong result): the job once more, as run_ranks does
    proc = (rerun_if_killed(lambda: _job(tmp_path, balancer), tmp_path / "out", "test_checked_streams")
            if balancer == "exact" else _job(tmp_path, balancer))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    _clean(out)


def test_selftest_cpu_rungs(tmp_path, capsys):
    """``python -m titan_foremoe.selftest`` on CPU: rung 1 (slot GEMM vs dense in bf16, a MoE step under strict
    mode) in this process; rung 2 (foremoe with a re-layout against off, 4 ranks, EP 2, efsdp 2, full AC, both
    under the checked backend: the same losses) as two jobs."""
    assert selftest.main(["--gpus", "1", "--out", str(tmp_path)]) == 0
    assert "rung 1 (one device): PASS" in capsys.readouterr().out
    r = selftest.rung2(2, tmp_path / "rung2", cuda=False)
    assert r.passed, r.line()
    for balancer in ("foremoe", "off"):
        _clean((tmp_path / "rung2" / balancer / "log.txt").read_text())
    assert selftest.rung3(8, tmp_path, cuda=False, hf_path=None).passed is None  # says it needs GPUs


@pytest.mark.parametrize("fault,message", [
    ("no_wait", "CUDA sanitizer (checked backend): unsynchronized read"),
    ("item_in_layer", "host sync inside the recompute stage's micro-steps: item at"),
    # one clear error on every rank of the EP group (rank 0 says it too), before any all-to-all: no hang
    ("batch_off_plan", "rank 0 failed in phase 'step 1 recompute': DisagreementError: recompute stage (foremoe): "
                       "rank 1: micro-step 0 layer 0: the micro-batch has"),
])
def test_injected_faults_fail_with_the_checkers_message(tmp_path, fault, message):
    proc = _job(tmp_path, "foremoe", fault=fault)
    log = tmp_path / "out" / "launch.log"  # torchrun's report of every failed rank (the screen ends with the first)
    out = proc.stdout + proc.stderr + (log.read_text() if log.is_file() else "")
    assert proc.returncode != 0
    assert message in out, out[-4000:]


def test_exact_refuses_a_micro_batch_off_the_loads_on_every_rank(tmp_path):
    """``exact`` sizes its quotas and padding from the loads' token counts: a rank whose micro-batch differs fails
    every rank of the group with one message, before any layer's all-gather (no hang)."""
    proc = _job(tmp_path, "exact", fault="batch_off_plan")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert ("rank 0 failed in phase 'step 1 recompute': DisagreementError: recompute stage (exact): ranks disagree on "
            "a micro-batch off the loads") in out, out[-4000:]


# -- one process: the checker's verdicts and the engine's record_stream --------------------------------------
@pytest.fixture
def checked():
    with checking() as b:
        yield b


DEV = "cpu"  # the job's device: a factory call with ``device=`` makes a device tensor, one without a host tensor


def test_checker_sees_what_cuda_would_race(checked):
    x = torch.zeros(8, 4, device=DEV)
    side = dev.new_stream()
    side.wait_stream(dev.current_stream())
    with dev.use_stream(side):
        x[4:].add_(1)
    x[:4].mul(2)  # other rows: no conflict (torch's sanitizer keys by data_ptr and would not see the next one)
    with pytest.raises(StreamError, match="unsynchronized read"):
        x.sum()
    done = dev.event()
    done.record(side)
    dev.current_stream().wait_event(done)
    x.sum()  # ordered now


def test_strict_mode_names_host_reads_and_pageable_uploads(checked):
    d = torch.zeros(3, device=DEV)  # made on the device
    h = torch.tensor([1.0, 2.0, 3.0])  # host data
    with dev.strict("a stage"):
        h.tolist()  # a host tensor: no sync
        torch.arange(3).tolist()  # no device=: a host tensor, as in a CUDA program
        dev.to_device(dev.host_empty(3, torch.float32).copy_(h), "cpu")  # pinned: no sync
        for read in (lambda: d.sum().item(), lambda: d.tolist(), lambda: d.cpu(), lambda: d[d > 0],
                     lambda: dev.to_device(h, "cpu")):
            with pytest.raises(HostSyncError, match="host sync inside a stage"):
                read()
        with dev.expected_sync("a documented read"):
            d.tolist()


def test_host_and_device_tensors_in_one_op_as_cuda_has_them(checked):
    """An op over host tensors and a Python number is a host op (packed rows' sequence sums over the host loss
    masks, ``rl/losses.py``: once counted as a device op, a false report); a device op given a host tensor is
    counted, as CUDA raises there; a device op's 0-d result read is a host sync."""
    from titan_foremoe.rl.losses import Segments

    seq_BL = torch.tensor([[0, 0, 1, -1]])  # host data
    mask_BL = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    assert Segments(seq_BL, 2).sums(mask_BL).tolist() == [2.0, 0.0]
    torch.where(seq_BL >= 0, seq_BL, 2)
    assert not checked.counts
    d = torch.zeros(4, device=DEV)
    torch.where(d > 0, seq_BL[0], 2)
    assert [kind for kind, _ in checked.counts] == ["host tensor in a device op (aten.where.self)"]
    torch.where(d > 0, d, 2).sum().item()
    assert sum(n for (kind, _), n in checked.counts.items() if kind == "item") == 1


def _engine_with_kept_rows():
    """A one-rank engine whose tables keep a replica from the other bank, indices uploaded per call (the path
    of the reactive runtime and of direct engine use: no stage upload keeps them alive)."""
    from titan_foremoe.transfer.engine import TransferEngine
    from titan_foremoe.transfer.schedule import Exchange, LayerTransfers

    empty = Exchange(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    lt = LayerTransfers(direct=empty, host=empty, keep_row_U=np.array([0]), keep_prev_row_U=np.array([1]),
                        grad=empty, send_inter_T=np.zeros(0, bool), stale=True)
    engine = TransferEngine(None, 0, 1, np.zeros(1, dtype=np.int64))
    owned = tuple(torch.randn(2, *s, device=DEV) for s in ((4, 8), (8, 4), (4, 8)))
    return engine, owned, lt


def test_engine_record_streams_what_the_side_stream_reads(checked, monkeypatch):
    """The banks are allocated on the compute stream and written (kept rows) and read (the other bank) on the side
    stream: if they are freed before the first-use wait (here: the engine drops its layers), the caching
    allocator may hand their memory out while the side stream still copies; ``record_stream`` prevents it."""
    for faulty in (False, True):
        if faulty:
            monkeypatch.setattr(dev, "record_stream", lambda t, s: None)  # the fault: record_stream removed
        engine, owned, lt = _engine_with_kept_rows()
        engine.prefetch(0, owned, lt, 0, 2, torch.float32)
        engine.layers.clear()  # banks freed on the compute stream, the side stream's copy not waited for
        if faulty:
            with pytest.raises(StreamError, match="freed while stream .* may still use it .* not record_stream-ed"):
                torch.ones(1, device=DEV) + 1  # frees are reported at the next op
        else:
            torch.ones(1, device=DEV) + 1
