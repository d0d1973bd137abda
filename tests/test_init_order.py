"""Init order on an accelerator: ``set_device(local rank)`` before ``init_process_group``, with ``device_id``.

There is no GPU here: torchtitan's device globals are replaced by a recording stand-in of ``torch.cuda``
(``device_type = "cuda"``, 8 devices) and ``init_process_group`` by a recorder, so the CUDA branch of
``parallelize.init_distributed`` runs through torchtitan's own ``init_distributed`` up to the call itself.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from titan_foremoe.config import load_config
from titan_foremoe.distributed import groups, parallelize

ROOT = Path(__file__).resolve().parents[1]
TORCHTITAN_ENV = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                  "TORCH_FR_DUMP_TEMP_FILE")


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """(events, cfg): ``init_process_group`` and ``set_device`` calls in order; torchtitan's env writes undone."""
    events = []
    for name in TORCHTITAN_ENV:  # torchtitan's init writes these; monkeypatch restores them
        monkeypatch.setenv(name, "unset-by-test")
    monkeypatch.setattr(groups, "_timeout", None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 64)

    def init_process_group(backend=None, **kwargs):
        events.append(("init_process_group", backend, kwargs.get("device_id")))

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    cfg = load_config(ROOT / "train_configs" / "debug_tiny_cpu.toml", [f"--job.dump_folder={tmp_path}"])
    return events, cfg


def _fake_cuda(monkeypatch, events, local_rank: int):
    cuda = types.SimpleNamespace(device_count=lambda: 8, set_device=lambda d: events.append(("set_device", d)))
    monkeypatch.setattr(parallelize.tt_utils, "device_type", "cuda")
    monkeypatch.setattr(parallelize.tt_utils, "device_module", cuda)  # read by torchtitan's get_local_device
    monkeypatch.setattr(parallelize.dist_utils, "device_type", "cuda")  # torchtitan's backend string
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))


def test_cuda_sets_device_before_the_group_and_passes_device_id(monkeypatch, recorded):
    events, cfg = recorded
    _fake_cuda(monkeypatch, events, local_rank=3)
    original = torch.distributed.init_process_group
    assert parallelize.init_distributed(cfg) == 64
    cuda3 = torch.device("cuda", 3)
    assert events == [("set_device", cuda3), ("init_process_group", "cuda:nccl,cpu:gloo", cuda3)]
    assert torch.distributed.init_process_group is original  # the device_id wrapper is gone afterwards


def test_cpu_and_fake_backend_unchanged(monkeypatch, recorded):
    events, cfg = recorded
    assert parallelize.init_distributed(cfg) == 64  # CPU: no set_device, no device_id
    assert events == [("init_process_group", "gloo", None)]
    events.clear()
    _fake_cuda(monkeypatch, events, local_rank=3)
    cfg.comm.mode = "fake_backend"  # a dry run on a GPU box: torchtitan's fake group, no device bound
    monkeypatch.setenv("NGPU", "64")
    monkeypatch.setattr(parallelize.dist_utils, "init_fake_mode", lambda *a, **k: events.append("fake"))
    assert parallelize.init_distributed(cfg) == 64
    assert events == ["fake"]
