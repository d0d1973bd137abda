"""The CUDA IPC weight-sync buffer is allocated with expandable segments off (faked allocator settings)."""

from __future__ import annotations

import torch

from titan_foremoe.distributed import ipc_alloc


def test_expandable_segments_are_read_from_the_launcher_variable():
    on = ipc_alloc.expandable_segments_on
    assert on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert on({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True"})
    assert not on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) and not on({})


def test_the_buffer_is_made_with_expandable_segments_off_then_on_again(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with ipc_alloc.ipc_shareable(torch.device("cuda", 0)):
        calls.append("allocate")
    assert calls == ["expandable_segments:False", "allocate", "expandable_segments:True"]
    calls.clear()
    with ipc_alloc.ipc_shareable(torch.device("cpu")):  # CPU: shared memory, no allocator settings
        calls.append("allocate")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    with ipc_alloc.ipc_shareable(torch.device("cuda", 0)):  # already off: left alone
        calls.append("allocate")
    assert calls == ["allocate", "allocate"]


def test_ipc_node_prepares_its_buffer_inside(monkeypatch):
    """``IPCNode.prepare`` allocates under ``ipc_shareable`` (wired, not only defined)."""
    import inspect

    from titan_foremoe.rollouts.engines import ipc_weights

    src = inspect.getsource(ipc_weights.IPCNode.prepare)
    assert "with ipc_shareable(self.device):" in src and src.index("ipc_shareable") < src.index("torch.empty")
