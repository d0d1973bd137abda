"""``weight_sync = "ipc"`` (engines/ipc_weights.py) against a stand-in of vLLM's IPC receiver in its own process
(tests/vllm_ipc_standin.py): gloo ranks hold the policy as sharded DTensors; buckets reach every worker through
shared-memory handles (the CPU form of CUDA IPC handles), bit-exact under HF names, in the planned buckets; an engine
or a rank that dies mid-sync ends the sync in one line on every surviving rank."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed_helpers import end_rank, rank_results, run_ranks  # noqa: E402
from test_vllm_nccl import tiny  # noqa: E402,F401
from test_weight_buckets import BUCKET, _sharded_stream, tiny_folder  # noqa: E402,F401

from titan_foremoe.rollouts.engines.sync_cost import SyncLinks, SyncSetting, colocated_ipc_cost  # noqa: E402

STANDIN = os.path.join(os.path.dirname(__file__), "vllm_ipc_standin.py")


def _start_standin(workers: list[str], out: str):
    port_file = os.path.join(out, "port")
    proc = subprocess.Popen([sys.executable, STANDIN, "--workers", ",".join(workers), "--port-file", port_file])
    for _ in range(600):
        if os.path.exists(port_file):
            return proc, f"http://127.0.0.1:{open(port_file).read()}"
        time.sleep(0.05)
    raise RuntimeError("the IPC stand-in did not start")


COLLECTIVES = ("all_gather", "all_reduce", "gather", "broadcast", "all_gather_object", "broadcast_object_list",
               "all_gather_into_tensor", "barrier")


def _record_threads(dist) -> list:
    """Every torch.distributed collective this process issues, by the name of the thread that issued it."""
    seen = []
    for name in COLLECTIVES:
        fn = getattr(dist, name)

        def wrapped(*a, _fn=fn, _name=name, **k):
            import threading

            seen.append([_name, threading.current_thread().name])
            return _fn(*a, **k)

        setattr(dist, name, wrapped)
    return seen


def _ranks_ipc(rank, world, folder, out, per_node, die, die_at):
    """Every "node" (``per_node`` ranks) runs one stand-in engine on its ranks' "GPUs" (``cpu:<rank>``), launched
    and fed by its first rank (the layout's source)."""
    import datetime

    import torch.distributed as dist

    from titan_foremoe.distributed import collectives, groups
    from titan_foremoe.rollouts.engines.ipc_weights import IPCSender, ipc_node, sync_ipc
    from titan_foremoe.rollouts.engines.vllm_server import VLLMClient
    from titan_foremoe.rollouts.engines.vllm_weights import RailGroups
    from titan_foremoe.rollouts.engines.weight_buckets import BucketStream, nbytes
    from titan_foremoe.rollouts.fleet.layout import engine_layout

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    groups.set_timeouts(datetime.timedelta(seconds=60))  # the block and rail groups too
    stream, ref = _sharded_stream(folder, rank, world)
    rails = RailGroups.make(world, per_node)
    layout = engine_layout(trainer_gpus=world, gpus_per_node=per_node, engines=0, gpus_per_engine=per_node,
                           colocated=True)
    node = ipc_node(layout, rank, world)
    proc = client = None
    if rank in layout.sources():
        os.makedirs(os.path.join(out, f"engine{rank}"), exist_ok=True)  # its own port file
        proc, url = _start_standin([f"cpu:{r}" for r in range(rank, rank + per_node)], os.path.join(out, f"engine{rank}"))
        client = VLLMClient(url, timeout_s=30, retries=0)
        node.poster = IPCSender(lambda p, b: client.post(p, b, retry=False))
        node.poster.init()
    collectives.barrier()
    if die is not None:  # a dead peer is found by this timeout at worst
        dist.distributed_c10d._get_default_group().set_timeout(datetime.timedelta(seconds=8))
        groups.set_timeouts(datetime.timedelta(seconds=8))
    buckets = BucketStream(stream, BUCKET, src=0, rails=rails, everywhere=True)
    if die == "rank" and rank == world - 1:  # a trainer rank of the engine's node dies mid-sync
        fill, filled = node.fill, []

        def dying_fill(flat):
            if len(filled) == die_at:
                os._exit(0)  # exit 0: spawn keeps the others
            filled.append(1)
            fill(flat)

        node.fill = dying_fill
    threads = _record_threads(dist)

    def sync():
        try:
            return sync_ipc(buckets, rank, node, weight_version="1", sources=layout.sources())
        except Exception as e:  # noqa: BLE001
            return f"raised {type(e).__name__}: {e}"

    result = {"err": sync(), "peak": node.peak_bytes if node else 0, "threads": sorted({t for _, t in threads}),
              "tensor_bytes": [nbytes(m) for m in buckets.meta],
              "bucket_bytes": [sum(nbytes(m) for m in b) for b in buckets.buckets]}
    if client is not None and die is None:
        result.update(client.get("/standin/state"), plan=[[m.name for m in b] for b in buckets.buckets],
                      ref={n: [str(t.dtype).removeprefix("torch."), list(t.shape),
                               hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                              ).hexdigest()] for n, t in ref.items()})
    if die is None:  # the source's own sync (its block group, rails, init): every rank, engine 0's URL
        from titan_foremoe.config.job_config import JobConfig
        from titan_foremoe.rollouts.sources.vllm import VLLMSource

        os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
        cfg = JobConfig()
        cfg.job.dump_folder, cfg.rollout_engine.weight_sync = out, "ipc"
        cfg.rollout_engine.engine_workers = per_node
        cfg.rollout_engine.url = collectives.broadcast_object(client.url if rank == 0 else None, src=0)
        src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None, export=None,
                         policy_logprobs=None, rank=rank, dp_rank=rank, weights=lambda: stream)
        try:
            src.sync_weights()
            result["source"] = src.syncs
            if rank == 0:  # fused_expert_load (the default): stacked experts, unstacked by the stand-in
                result["source_state"] = client.get("/standin/state")
            stream.fused = False  # the source set it on the stream it was given (the next sync's plan is per-expert)
        except Exception as e:  # noqa: BLE001
            result["source"] = f"{type(e).__name__}: {e}"
    if die is None:  # then engine 0 dies at the third bucket of the next sync
        if rank == 0:
            client.post("/standin/die_at", {"bucket": 2})
        collectives.barrier()
        result["engine_died"] = sync()
    if proc is not None:
        proc.kill()
        proc.wait()
    end_rank(out, rank, result, dead_peer=die is not None)


def test_four_ranks_on_two_nodes_fill_an_engine_on_each_node(tiny_folder, tmp_path):
    """Four trainer ranks in two "nodes" of two, one stand-in engine per node whose two workers run on its node's
    ranks (``engine_layout(colocated=True)``), both filled in the same sync: every HF tensor arrives bit-exact
    (SHA-256 of the bytes against transformers' folder) under its HF name in both workers of both engines, in the
    planned buckets, one ``/update_weights`` each; every rank holds one bucket's buffer, never more; every
    collective of the sync is issued from the calling thread (the sources' posts, HTTP only, run on their own).
    Then engine 0 dies at the next sync's third bucket: every rank ends that sync with one line."""
    run_ranks(_ranks_ipc, 4, tiny_folder, str(tmp_path), 2, None, None)
    r = rank_results(tmp_path, 4)
    assert [x["err"] for x in r] == [None] * 4
    assert [x["threads"] for x in r] == [["MainThread"]] * 4  # issue 45: no collective off the main thread
    for s in (r[0], r[2]):  # engine 0 (ranks 0, 1) and engine 1 (ranks 2, 3)
        assert s["buckets"] == s["plan"] and len(s["buckets"]) > 3
        assert s["digests"] == s["ref"]
        assert s["calls"][:2] == ["/init_weight_transfer_engine", "/start_weight_update"]
        assert s["calls"].count("/update_weights") == len(s["plan"])
        assert s["calls"][-3:] == ["/finish_weight_update", "/reset_prefix_cache", "/standin/state"]
    assert {x["peak"] for x in r} == {max(r[1]["bucket_bytes"])}
    # the cost model charges this run: its buckets, a GPU's extra memory (sync_cost.colocated_ipc_cost)
    cost = colocated_ipc_cost(r[0]["tensor_bytes"], SyncSetting("bucketed", 4, 0, 2, 2, bucket_bytes=BUCKET),
                              SyncLinks(1e9, 1e9, 1e-6))
    assert cost["buckets"] == len(r[0]["plan"]) and cost["sender"]["node_gpu_extra_bytes"] == r[1]["peak"]
    # the source's sync on every rank (one 1 MiB bucket: the tiny model) reaches engine 0's workers, init sent again
    assert [x["source"] for x in r] == [1] * 4
    # ... with the stacked experts of our extension (installed first): the same tensors, bit-exact
    fused = r[0]["source_state"]
    assert "/collective_rpc" in fused["calls"][len(r[0]["calls"]):] and fused["fused"] > 0
    assert any(n.endswith(".mlp.experts.gate_up_proj") for b in fused["buckets"][len(r[0]["buckets"]):] for n in b)
    assert fused["digests"] == r[0]["ref"]
    # engine 0's process exits at the next sync's third bucket: every rank ends it with one line
    died = [x["engine_died"] for x in r]
    print(died)
    assert all(e and "\n" not in e for e in died)
    assert "vLLM at http://127.0.0.1" in died[0] and "/update_weights" in died[0]
    assert died[1:] == ["stopped by the failure of rank 0 (a source)"] * 3


def test_a_rank_that_dies_mid_sync_ends_it_in_one_line(tiny_folder, tmp_path):
    """Trainer rank 2 (a worker's GPU of the engine) exits at the third bucket: ranks 0 and 1 end the sync
    with one line each, no hang."""
    run_ranks(_ranks_ipc, 3, tiny_folder, str(tmp_path), 3, "rank", 2)
    for i, x in enumerate(rank_results(tmp_path, 3)[:2]):
        print(f"rank {i}: {x['err']}")
        assert x["err"] and "\n" not in x["err"], (i, x)


# -- the source's step (one rank, the stand-in in this process) ------------------------------------------------
class _Engine:
    """The stand-in's routes called in this process (its handle opens from the shared-memory cache); ``fail``: a
    route answered with HTTP 500."""

    def __init__(self):
        from vllm_ipc_standin import IPCStandIn

        self.standin, self.fail, self.calls = IPCStandIn(["cpu:0"]), "", []

    def post(self, path, body=None, retry=True):
        from titan_foremoe.rollouts.engines.errors import EngineError

        self.calls.append(path)
        code, out = (500, {}) if path == self.fail else self.standin.handle("POST", path, body or {})
        if code != 200:
            raise EngineError(f"vLLM at http://fake{path}: HTTP {code}: {out}")
        return out


def _ipc_source(tiny, tmp_path, monkeypatch, engine, **engine_keys):
    from test_vllm_nccl import _nccl_source

    return _nccl_source(tiny, tmp_path, monkeypatch, engine, weight_sync="ipc", weight_sync_bucket_mb=1,
                        **engine_keys)


def test_the_source_syncs_by_ipc_and_refills_an_engine_that_died(tiny, tmp_path, monkeypatch):
    """``VLLMSource`` with ``weight_sync = "ipc"``: the first sync sends the init info, every sync is start,
    one update per bucket, finish, reset, no folder written, every tensor loaded bit-exact (stacked experts, our
    extension installed before the init, as on every refilled engine); a launched engine that
    dies mid-sync is started again on a fresh export (refilled) and the next sync inits it again; past
    ``max_restarts`` the sync fails in one line."""
    from test_vllm_nccl import FakeServer, _stream

    from titan_foremoe.rollouts.engines.errors import EngineError

    engine = _Engine()
    src, exported = _ipc_source(tiny, tmp_path, monkeypatch, engine, url="http://127.0.0.1:1")
    src.sync_weights()
    src.sync_weights()
    n = engine.calls.count("/update_weights") // 2
    step = ["/start_weight_update", *["/update_weights"] * n, "/finish_weight_update", "/reset_prefix_cache"]
    # the extension installed first (fused_expert_load, the default: stacked experts, unstacked by the stand-in)
    assert engine.calls == ["/collective_rpc", "/init_weight_transfer_engine", *step, *step] and exported == [] \
        and src.syncs == 2 and engine.standin.fused > 0
    ref = dict(_stream(tiny, torch.bfloat16))
    assert set(engine.standin.digests) == set(ref) and all(
        engine.standin.digests[k][2] == hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()
                                                       .tobytes()).hexdigest() for k, t in ref.items())

    src, exported = _ipc_source(tiny, tmp_path, monkeypatch, engine, url="", max_restarts=1)
    src.server, src.syncs = FakeServer("http://127.0.0.1"), 1  # launched on the first folder at step 0
    src._connect("http://127.0.0.1:1")
    engine.fail, src.server.up = "/update_weights", False  # the engine died: its next update fails
    src.sync_weights()
    assert src.restarts == 1 and src.server.starts == exported == [str(tmp_path / "engine_weights" / "policy_1")]
    engine.fail, engine.calls = "", []
    src.sync_weights()
    assert engine.calls[:3] == ["/collective_rpc", "/init_weight_transfer_engine", "/start_weight_update"]
    engine.fail, src.server.up = "/update_weights", False
    with pytest.raises(EngineError, match=r"^vLLM weight sync failed: rank 0: EngineError: .*update_weights: HTTP 500"):
        src.sync_weights()


def vllm_config_check(tmp_path, *fixed):
    """``check(*overrides)``: the tiny vLLM config validated on 2 ranks with ``fixed`` and ``overrides``."""
    from titan_foremoe.config import load_config
    from titan_foremoe.config import validate as v
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    hf = make_tiny_checkpoint(str(tmp_path / "tiny"), read_texts("examples/arithmetic_word_problems.jsonl"),
                              n_layers=2, head_dim=32)

    def check(*more):
        return v.validate(load_config("train_configs/qwen3_moe_hf_vllm.toml", [
            f"--job.dump_folder={tmp_path}", f"--model.hf_assets_path={hf}",
            f"--rollout_engine.python={sys.executable}", *fixed, *more]), 2)

    return check


def test_ipc_is_refused_off_the_node_on_cpu_and_past_the_node(tmp_path, monkeypatch):
    from titan_foremoe.config import ConfigError
    from titan_foremoe.config import validate as v

    check = vllm_config_check(tmp_path, "--rollout_engine.weight_sync=ipc")

    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] weight_sync: 'ipc' needs GPUs.*device is cpu"):
        check()  # this machine: no GPU, a launched engine
    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] url: weight_sync = 'ipc' .* not at '10.0.0.7'"):
        check("--rollout_engine.url=http://10.0.0.7:8000")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] gpus_per_engine: 4 GPUs per engine .* a node has 2 trainer"):
        check("--rollout_engine.url=http://127.0.0.1:8000", "--rollout_engine.gpus_per_engine=4")
    assert check("--rollout_engine.url=http://127.0.0.1:8000", "--rollout_engine.gpus_per_engine=2")  # a stand-in
    monkeypatch.setattr(v, "_job_device_type", lambda: "cuda")
    assert check().rollout_sequences == 32  # a GPU job, the engine launched on rank 0's node: accepted


def test_vllms_own_ipc_classes_take_our_payloads():
    """Oracle: vLLM's own ``IPCWeightTransferInitInfo`` / ``IPCWeightTransferUpdateInfo`` (the engine venv) take
    our init info and a bucket's update (unpickling the handles we sent, keyed by GPU), and its CLI and env turn
    on the ``ipc`` backend with our launch flag."""
    from vllm_helpers import engine_python

    from titan_foremoe.rollouts.engines.vllm_api import (IPC_SERVER_ENV, ipc_init_info, ipc_update_info,
                                                         weight_transfer_args)

    handles = {"GPU-aaaa": (1, "args"), "GPU-bbbb": (2, "args")}
    update = ipc_update_info(["a.weight", "b.weight"], ["bfloat16", "float32"], [(2, 3), (4,)], handles, [12, 16])
    code = (
        "import json, sys\n"
        "from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo, "
        "IPCWeightTransferUpdateInfo\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.openai.cli_args import make_arg_parser\n"
        "from vllm.engine.arg_utils import AsyncEngineArgs\n"
        "init, update, flags = json.load(sys.stdin)\n"
        "i = IPCWeightTransferInitInfo(**init)\n"
        "u = IPCWeightTransferUpdateInfo(**update)\n"
        "a = make_arg_parser(FlexibleArgumentParser()).parse_args(['--model', 'x', *flags])\n"
        "print(json.dumps([i.packed, u.names, u.tensor_sizes, {k: list(v) for k, v in u.ipc_handles.items()},\n"
        "                  AsyncEngineArgs.from_cli_args(a).weight_transfer_config.backend]))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([engine_python(), "-c", code], input=json.dumps([ipc_init_info(), update,
                                                                          weight_transfer_args("ipc")]),
                         capture_output=True, text=True, timeout=180,
                         env={**env, "OMP_NUM_THREADS": "1", **IPC_SERVER_ENV})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        True, ["a.weight", "b.weight"], [12, 16], {"GPU-aaaa": [1, "args"], "GPU-bbbb": [2, "args"]}, "ipc"]


def test_a_buffer_on_the_device_is_drained_before_its_handle_is_posted(monkeypatch):
    """The CUDA branch of ``IPCNode.fill`` (faked: a device buffer and a recording stream): the copy into the
    exported buffer is followed by a drain of the stream it ran on, on the calling thread, before ``sync_ipc``'s
    agreement lets the source post the handle (the engine reads the bytes from another process, outside any
    stream order)."""
    from titan_foremoe.rollouts.engines.ipc_weights import IPCNode

    events = []

    class DeviceBuffer:
        is_cuda, device = True, "cuda:0"

        def __getitem__(self, index):
            return self

        def copy_(self, src):
            events.append(("copy", threading.current_thread().name))

    class Stream:
        def synchronize(self):
            events.append(("drain", threading.current_thread().name))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    node = IPCNode(None, 0)
    node.buffer = DeviceBuffer()
    node.fill(torch.zeros(3, dtype=torch.uint8))
    assert events == [("copy", "MainThread"), ("drain", "MainThread")]


def test_an_engine_block_that_does_not_divide_the_node_is_one_line(monkeypatch):
    """The IPC sync feeds blocks of ``gpus_per_engine`` GPUs inside a node (``fleet.layout``): 3 of 8 is refused
    before any worker starts, 4 of 8 accepted."""
    from titan_foremoe.config import ConfigError
    from titan_foremoe.config import validate as v

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")

    def fleet(g):
        return type("E", (), {"gpus_per_engine": g, "engines": 0, "colocated": True, "urls": [], "url": ""})()

    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] gpus_per_engine = 3 does not divide a node's 8 GPUs"):
        v._check_ipc_world(fleet(3), 16)
    v._check_ipc_world(fleet(4), 16)
