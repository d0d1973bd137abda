"""The GPU check's fleet stages (``scripts/gpu_fleet_stages.py``) on CPU: the checker names a tensor one byte off;
``fleet_ipc`` through ``gpu_check.sh --cpu`` passes (two "nodes" fill their engines by one ``sync_ipc``, every
tensor bit-equal to transformers' file, the relay on the host) and fails, naming the tensor, when a byte is
flipped in one node's exported buffer after its copy; ``fleet_sleep`` is a SKIP with its reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

import gpu_fleet_stages as stages  # noqa: E402


def test_the_checker_names_a_tensor_one_byte_off():
    g = torch.Generator().manual_seed(0)
    ref = {f"model.layers.{i}.w": torch.randn(4, 8, generator=g).to(torch.bfloat16) for i in range(3)}
    want = {n: stages.digest(t) for n, t in ref.items()}
    assert stages.check_received({n: stages.digest(t.clone()) for n, t in ref.items()}, want) == []
    bad = ref["model.layers.1.w"].clone()
    bad.view(torch.uint8).view(-1)[17] ^= 1  # one bit of one byte
    got = {n: stages.digest(bad if n == "model.layers.1.w" else t) for n, t in ref.items()}
    problems = stages.check_received(got, want)
    assert len(problems) == 1 and problems[0].startswith("model.layers.1.w: received bfloat16 [4, 8] sha256")
    del got["model.layers.2.w"]
    got["extra"] = want["model.layers.0.w"]
    assert stages.check_received(got, want)[1:] == ["model.layers.2.w: not received", "extra: not in the checkpoint"]


def test_fleet_ipc_fails_on_a_flipped_byte(tmp_path):
    """The stage itself, a byte of node 1's second bucket flipped in its exported buffer after the copy: engine 1
    holds one tensor that differs from the checkpoint, named; engine 0 is clean."""
    r = stages.stage_fleet_ipc(True, tmp_path, flip=True)
    assert r["passed"] is False and list(r["problems"]) == ["engine 1"], r["line"]
    (line,) = r["problems"]["engine 1"]
    assert ": received " in line and "the checkpoint has" in line
    assert "engine 1: 1 wrong, first" in r["line"]


def test_fleet_stages_through_gpu_check_cpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    p = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--only", "fleet_ipc,fleet_sleep", "--out",
                        str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    st = json.loads((tmp_path / "report.json").read_text())["stages"]
    ipc, sleep = st["fleet_ipc"], st["fleet_sleep"]
    assert ipc["passed"] is True and ipc["problems"] == {} and "every tensor bit-equal" in ipc["line"], ipc["line"]
    assert len(ipc["ranks"]) == 2 and all(x["buckets"] == x["plan"] and len(x["plan"]) > 3 for x in ipc["ranks"])
    assert ipc["relay"] == {**ipc["relay"], "passed": True, "buffer_device": "cpu", "stream": None}
    assert sleep["passed"] is None and "1.5 GiB" in sleep["line"]
    assert "SKIP fleet sleep mode: on CPU" in p.stdout


def test_the_standin_opens_a_cuda_handle_on_the_device_of_its_uuid(monkeypatch):
    """The stand-in's CUDA branch (``open_handle``, faked: two GPUs, ``rebuild_cuda_tensor`` recorded): as vLLM's
    ``packed_ipc_consumer``, the handle's device index (position 6) becomes the index of the worker's GPU here,
    found by its UUID, whatever index the exporter had."""
    import torch.multiprocessing.reductions as reductions
    from vllm_ipc_standin import open_handle

    uuids = ["GPU-aaaa", "GPU-bbbb"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"uuid": uuids[i]})())
    seen = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: seen.append(a) or "buffer")
    handle = ("cls", (64,), (1,), 0, "storage_cls", torch.uint8, 0, b"h", 64, 0, b"ref", 0, b"ev", False)
    assert open_handle(handle, "GPU-bbbb") == "buffer"
    assert seen == [handle[:6] + (1,) + handle[7:]]
