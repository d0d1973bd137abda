"""``weight_sync = "ipc"`` (engines/ipc_weights.py) against a stand-in of vLLM's IPC receiver in its own process
(tests/vllm_ipc_standin.py): gloo ranks hold the policy as sharded DTensors; buckets reach every worker through
shared-memory handles (the CPU form of CUDA IPC handles), bit-exact under HF names, in the planned buckets; an engine
or a rank that dies mid-sync ends the sync in one line on every surviving rank."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
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


def _ranks_ipc(rank, world, folder, out, per_node, die, die_at):
    import datetime

    import torch.distributed as dist

    from titan_foremoe.distributed import collectives, groups
    from titan_foremoe.rollouts.engines.ipc_weights import IPCNode, IPCSender, sync_ipc
    from titan_foremoe.rollouts.engines.vllm_server import VLLMClient
    from titan_foremoe.rollouts.engines.vllm_weights import RailGroups
    from titan_foremoe.rollouts.engines.weight_buckets import BucketStream, nbytes

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    groups.set_timeouts(datetime.timedelta(seconds=60))  # the node and rail groups too
    stream, ref = _sharded_stream(folder, rank, world)
    rails = RailGroups.make(world, per_node)
    node_group = groups.subgroups([list(range(k, k + per_node)) for k in range(0, world, per_node)])
    proc = client = None
    if rank == 0:
        proc, url = _start_standin([f"cpu:{r}" for r in range(per_node)], out)
        client = VLLMClient(url, timeout_s=30, retries=0)
        sender = IPCSender(lambda p, b: client.post(p, b, retry=False))
        sender.init()
    collectives.barrier()
    if die is not None:  # a dead peer is found by this timeout at worst
        dist.distributed_c10d._get_default_group().set_timeout(datetime.timedelta(seconds=8))
        groups.set_timeouts(datetime.timedelta(seconds=8))
    node = IPCNode(node_group if per_node > 1 else None, rank, sender if rank == 0 else None) \
        if rank < per_node else None
    buckets = BucketStream(stream, BUCKET, src=0, rails=rails)
    if die == "rank" and rank == world - 1:  # a trainer rank of the engine's node dies mid-sync
        receive = node.receive
        node.receive = lambda b: os._exit(0) if b.index == die_at else receive(b)  # exit 0: spawn keeps the others
    def sync():
        try:
            return sync_ipc(buckets, rank, node, weight_version="1")
        except Exception as e:  # noqa: BLE001
            return f"raised {type(e).__name__}: {e}"

    result = {"err": sync(), "peak": node.peak_bytes if node else 0,
              "tensor_bytes": [nbytes(m) for m in buckets.meta],
              "bucket_bytes": [sum(nbytes(m) for m in b) for b in buckets.buckets]}
    if rank == 0 and die is None:
        result.update(client.get("/standin/state"), plan=[[m.name for m in b] for b in buckets.buckets],
                      ref={n: [str(t.dtype).removeprefix("torch."), list(t.shape),
                               hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                              ).hexdigest()] for n, t in ref.items()})
    if die is None:  # the source's own sync (its node group, rails, init): every rank, the engine's URL
        from titan_foremoe.config.job_config import JobConfig
        from titan_foremoe.rollouts.sources.vllm import VLLMSource

        os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
        cfg = JobConfig()
        cfg.job.dump_folder, cfg.rollout_engine.weight_sync = out, "ipc"
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
    if die is None:  # then the engine dies at the third bucket of the next sync
        if rank == 0:
            client.post("/standin/die_at", {"bucket": 2})
        collectives.barrier()
        result["engine_died"] = sync()
    if rank == 0:
        proc.kill()
        proc.wait()
    end_rank(out, rank, result, dead_peer=die is not None)


def test_four_ranks_on_two_nodes_fill_a_colocated_engine(tiny_folder, tmp_path):
    """Four trainer ranks (two "nodes" of two), the engine's two workers on node 0's ranks 0 and 1: every HF
    tensor arrives bit-exact (SHA-256 of the bytes against transformers' folder) under its HF name in both workers,
    in the planned buckets, one ``/update_weights`` each; rank 1 holds one bucket at a time, never more. Then the
    engine process dies at the next sync's third bucket: every rank ends that sync with one line."""
    run_ranks(_ranks_ipc, 4, tiny_folder, str(tmp_path), 2, None, None)
    r = rank_results(tmp_path, 4)
    assert [x["err"] for x in r] == [None] * 4
    s = r[0]
    assert s["buckets"] == s["plan"] and len(s["buckets"]) > 3
    assert s["digests"] == s["ref"]
    assert s["calls"][:2] == ["/init_weight_transfer_engine", "/start_weight_update"]
    assert s["calls"].count("/update_weights") == len(s["plan"])
    assert s["calls"][-3:] == ["/finish_weight_update", "/reset_prefix_cache", "/standin/state"]
    assert r[1]["peak"] == max(r[1]["bucket_bytes"]) and r[2]["peak"] == r[3]["peak"] == 0
    # the cost model charges this run: its buckets, a node GPU's extra memory (sync_cost.colocated_ipc_cost)
    cost = colocated_ipc_cost(r[0]["tensor_bytes"], SyncSetting("bucketed", 4, 0, 2, 2, bucket_bytes=BUCKET),
                              SyncLinks(1e9, 1e9, 1e-6))
    assert cost["buckets"] == len(s["plan"]) and cost["sender"]["node_gpu_extra_bytes"] == r[1]["peak"]
    # the source's sync on every rank (one 1 MiB bucket: the tiny model) reaches both workers, init sent again
    assert [x["source"] for x in r] == [1] * 4
    # ... with the stacked experts of our extension (installed first): the same tensors, bit-exact
    fused = r[0]["source_state"]
    assert "/collective_rpc" in fused["calls"][len(s["calls"]):] and fused["fused"] > 0
    assert any(n.endswith(".mlp.experts.gate_up_proj") for b in fused["buckets"][len(s["buckets"]):] for n in b)
    assert fused["digests"] == s["ref"]
    # the engine process exits at the next sync's third bucket: every rank ends it with one line
    died = [x["engine_died"] for x in r]
    print(died)
    assert all(e and "\n" not in e for e in died)
    assert "vLLM at http://127.0.0.1" in died[0] and "/update_weights" in died[0]
    assert died[1:] == ["stopped by the failure of rank 0 (a source)"] * 3


def test_a_rank_that_dies_mid_sync_ends_it_in_one_line(tiny_folder, tmp_path):
    """Trainer rank 2 (a receiver on the engine's node) exits at the third bucket: ranks 0 and 1 end the sync
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


def test_ipc_is_refused_off_the_node_on_cpu_and_past_the_node(tmp_path, monkeypatch):
    from titan_foremoe.config import ConfigError, load_config
    from titan_foremoe.config import validate as v
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    hf = make_tiny_checkpoint(str(tmp_path / "tiny"), read_texts("examples/arithmetic_word_problems.jsonl"),
                              n_layers=2, head_dim=32)

    def check(*more):
        return v.validate(load_config("train_configs/qwen3_moe_hf_vllm.toml", [
            f"--job.dump_folder={tmp_path}", f"--model.hf_assets_path={hf}",
            f"--rollout_engine.python={sys.executable}", "--rollout_engine.weight_sync=ipc", *more]), 2)

    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] weight_sync: 'ipc' needs GPUs.*device is cpu"):
        check()  # this machine: no GPU, a launched engine
    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] url: weight_sync = 'ipc' .* not at '10.0.0.7'"):
        check("--rollout_engine.url=http://10.0.0.7:8000")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] gpus_per_engine: 4 engine workers .* has 2 trainer"):
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
