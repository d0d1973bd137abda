"""The bucketed weight sync (engines/weight_buckets.py): buckets of the HF export's bytes, gathered to the source
only, driven through vLLM's packed routes (mocked) and SGLang's stand-in over real gloo groups with several
trainer ranks (slices from every rank, relays in the group), and a rank that dies mid-sync."""

from __future__ import annotations

import contextlib
import json
import os
import sys

import numpy as np
import pytest
import torch

from titan_foremoe.rollouts.engines.vllm_weights import HFWeightStream, PackedNCCLSender
from titan_foremoe.rollouts.engines.weight_buckets import BucketStream, sync_buckets, unpack

sys.path.insert(0, os.path.dirname(__file__))
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from distributed_helpers import end_rank, run_ranks  # noqa: E402
from test_vllm_nccl import FakeEngine, FakeGroup, _check_with_vllm, _stream, tiny  # noqa: E402,F401

BUCKET = 40_000  # bytes: the tiny model's 70 tensors make several buckets


def test_buckets_are_the_hf_pass_bit_for_bit(tiny):
    """Oracle: the folder transformers wrote. Unpacked buckets give every tensor by HF name, bit-exact, in the
    engine dtype; the buckets close where the plan (vLLM's rule, from the metadata alone) says."""
    files = tiny[2]
    stream = BucketStream(_stream(tiny, torch.bfloat16), BUCKET, src=0)
    got = {}
    buckets = list(stream)
    assert len(buckets) == len(stream.buckets) > 3
    for b in buckets:
        assert b.problem is None and b.metas == stream.buckets[b.index]
        got.update(unpack(b.flat, b.metas))
    assert list(got) == [m.name for m in stream.meta] and set(got) == set(files)
    for name, t in got.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, files[name].to(torch.bfloat16)), name
    sizes = [sum(t.numel() * 2 for _, t in unpack(b.flat, b.metas)) for b in buckets]
    assert all(s - max(t.numel() * 2 for _, t in unpack(b.flat, b.metas)) <= BUCKET for s, b in zip(sizes, buckets))


def test_fused_buckets_carry_stacked_experts_larger_than_a_bucket(tiny):
    """Fused mode: a layer's gate_up (8 x 64 x 64 bf16 = 65,536 B) is larger than the 40,000 B bucket and travels
    whole, closing its bucket (vLLM 0.28-0.33's packed NCCL producer and consumer: a bucket ends on the tensor
    that takes it past ``packed_buffer_size_bytes``; the producer only warns). Unpacked, the buckets are the
    per-expert pass stacked (``stack_experts``, the extension's reading), bit for bit."""
    from titan_foremoe.rollouts.engines.vllm_fused_load import stack_experts

    model, adapter, _ = tiny
    stream = BucketStream(HFWeightStream(model.state_dict, adapter, torch.bfloat16, contextlib.nullcontext, fused=True),
                          BUCKET, src=0)
    buckets, got = list(stream), {}
    for b in buckets:
        assert b.problem is None
        got.update(unpack(b.flat, b.metas))
    want = dict(stack_experts(list(_stream(tiny, torch.bfloat16))))
    assert list(got) == [m.name for m in stream.meta] and set(got) == set(want)
    assert all(torch.equal(t, want[n]) for n, t in got.items())
    big = [b for b in buckets if any(m.name.endswith("gate_up_proj") for m in b.metas)]
    assert len(big) == 2 and all(b.metas[-1].name.endswith("gate_up_proj") for b in big)  # each closes its bucket
    assert all(b.flat.numel() > BUCKET for b in big)


def test_packed_vllm_sender_names_everything_once_and_broadcasts_buckets(tiny):
    """vLLM's packed transfer: the init info asks for it (bucket size, two buffers, relays before the workers),
    one ``/update_weights`` names every tensor, then one broadcast per bucket, each the bucket's bytes."""
    group = FakeGroup()
    engine = FakeEngine(group)  # its /update_weights waits for one broadcast per bucket when packed

    sender = PackedNCCLSender(lambda p, b: engine.post(p, b, retry=False), master_address="10.0.0.1", master_port=29511, engine_workers=4,
                              bucket_bytes=BUCKET, relays=3, open_group=lambda info: group, stream=lambda: "S")
    sender.init()
    init_info = engine.calls[0][1]["init_info"]
    assert init_info == {"master_address": "10.0.0.1", "master_port": 29511, "rank_offset": 4, "world_size": 8,
                         "packed": True, "packed_buffer_size_bytes": BUCKET, "packed_num_buffers": 2}
    stream = BucketStream(_stream(tiny, torch.bfloat16), BUCKET, src=0)
    assert sync_buckets(stream, 0, sender, weight_version="3") is None
    assert [p for p, _ in engine.calls[1:]] == ["/start_weight_update", "/update_weights", "/finish_weight_update",
                                                "/reset_prefix_cache"]
    update = engine.calls[2][1]["update_info"]
    assert update["names"] == [m.name for m in stream.meta]
    assert len(group.sent) == len(stream.buckets) and all(d == torch.uint8 for _, d, _, _, _ in group.sent)
    flat = torch.cat([t for *_, t in group.sent])
    names = [m.name for m in stream.meta]
    got = dict(unpack(flat, stream.meta))
    assert list(got) == names and torch.equal(got[names[0]], tiny[2][names[0]].to(torch.bfloat16))
    assert engine.calls[3][1] == {"weight_version": "3"} and sender.updates == 1
    _check_with_vllm(init_info, update)


def test_one_packed_sender_feeds_several_servers_in_one_group(tiny):
    """An engine fleet's one group: each server is told its own rank offset (after rank 0 and 3 relays: 4 and 8
    for servers of 4 workers) with the same world size (12) and port, which vLLM's own init-info dataclass takes;
    every route goes to every server, each bucket is broadcast once and both servers load every tensor bit-exact.
    One server refusing the update is the sync's error, in one line."""
    group = FakeGroup()
    engines = [FakeEngine(group), FakeEngine(group)]
    sender = PackedNCCLSender([lambda p, b, e=e: e.post(p, b, retry=False) for e in engines], master_address="10.0.0.1",
                              master_port=29511, engine_workers=4, bucket_bytes=BUCKET, relays=3,
                              open_group=lambda info: group, stream=lambda: "S")
    sender.init()
    infos = [e.calls[0][1]["init_info"] for e in engines]
    assert [(i["rank_offset"], i["world_size"], i["master_port"]) for i in infos] == [(4, 12, 29511), (8, 12, 29511)]
    assert sender.init_info["world_size"] == 12  # rank 0's and the relays' rendezvous: the whole group
    stream = BucketStream(_stream(tiny, torch.bfloat16), BUCKET, src=0)
    assert sync_buckets(stream, 0, sender, weight_version="3") is None
    step = ["/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"]
    assert [[p for p, _ in e.calls[1:]] for e in engines] == [step, step]
    assert len(group.sent) == len(stream.buckets) > 1 and sender.updates == 1
    want = {n: t.to(torch.bfloat16) for n, t in tiny[2].items()}
    for e in engines:
        assert sorted(e.loaded) == sorted(want) and all(torch.equal(e.loaded[n], want[n]) for n in want)
    _check_with_vllm(infos[1], engines[1].calls[2][1]["update_info"])  # the second server's offset too
    engines[1].fail = "/update_weights"
    err = sync_buckets(BucketStream(_stream(tiny, torch.bfloat16), BUCKET, src=0), 0, sender)
    assert err == "EngineError: vLLM at http://fake/update_weights: HTTP 500" and sender.updates == 1


def test_a_refused_update_stops_at_a_bucket_with_one_line(tiny):
    group = FakeGroup()
    engine = FakeEngine(group, fail="/start_weight_update")
    sender = PackedNCCLSender(lambda p, b: engine.post(p, b, retry=False), master_address="h", master_port=1,
                              engine_workers=1, bucket_bytes=BUCKET, open_group=lambda info: group,
                              stream=lambda: None)
    sender.init()
    err = sync_buckets(BucketStream(_stream(tiny), BUCKET, src=0), 0, sender)
    assert err == "EngineError: vLLM at http://fake/start_weight_update: HTTP 500" and group.sent == []


def test_sends_overlap_the_next_gathers_with_one_bucket_in_flight(tiny):
    """The source's pipeline: bucket b + 1's entries are gathered while bucket b's send is still running, and a
    send starts only once the previous one ended (at most two buckets held: one travelling, one being packed).
    Each send waits (up to 10 s) for the gathers that complete the next bucket, so a source that gathered only
    after a send ended fails here on every machine, and a loaded one cannot make it look serial."""
    import threading

    log, cond = [], threading.Condition()
    stream = _stream(tiny, torch.bfloat16)
    entries = stream.entries

    def logged(dst, rails=None):
        for metas, values in entries(dst, rails):
            with cond:
                log.append(("gather", metas[0].name))
                cond.notify_all()
            yield metas, values

    stream.entries = logged
    buckets = BucketStream(stream, BUCKET, src=0)
    n = len(buckets.buckets)
    per_entry = np.cumsum([len(e) for e in stream.entry_metadata()])
    done_at = [int(np.searchsorted(per_entry, c)) + 1 for c in np.cumsum([len(b) for b in buckets.buckets])]

    def gathers():
        return sum(kind == "gather" for kind, _ in log)

    class Slow:
        def begin(self, meta, buckets):
            pass

        def send_bucket(self, flat, index, metas):
            with cond:
                log.append(("start", index))
                if index + 1 < n and done_at[index + 1] > done_at[index]:  # the next bucket needs a gather
                    cond.wait_for(lambda: gathers() >= done_at[index + 1], timeout=10)
                log.append(("end", index))

        def end(self, weight_version=None):
            pass

        def abort(self):
            pass

    assert sync_buckets(buckets, 0, Slow()) is None
    at = {e: i for i, e in enumerate(log)}
    assert n > 3 and all(("end", b) in at for b in range(n))
    assert all(at[("start", b + 1)] > at[("end", b)] for b in range(n - 1))  # one send in flight
    gathered = [sum(kind == "gather" for kind, _ in log[:at[("end", b)]]) for b in range(n - 1)]
    assert gathered == done_at[1:]  # bucket b + 1 gathered (and no further) before bucket b's send ended


def test_a_send_that_fails_mid_sync_stops_the_pipeline_in_one_line(tiny):
    """Bucket 2's send fails on the sender thread: the source learns it when handing over bucket 3, starts
    nothing more, and the sync ends with that error in one line."""
    started = []

    class Failing:
        def begin(self, meta, buckets):
            pass

        def send_bucket(self, flat, index, metas):
            started.append(index)
            if index == 2:
                raise RuntimeError("engine refused bucket 2")

        def end(self, weight_version=None):
            raise AssertionError("end after a failure")

        def abort(self):
            pass

    err = sync_buckets(BucketStream(_stream(tiny), BUCKET, src=0), 0, Failing())
    assert err == "RuntimeError: engine refused bucket 2" and started == [0, 1, 2]


# -- several trainer ranks over gloo, SGLang's stand-in engine -------------------------------------------------
def _gloo_group(info, rank, seconds=60):
    """A member of the engine's transfer group on CPU (SGLang's helper makes the NCCL one on GPUs)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    timeout = datetime.timedelta(seconds=seconds)
    store = TCPStore(info["master_address"], info["master_port"], info["world_size"], rank == 0, timeout=timeout)
    pg = ProcessGroupGloo(PrefixStore(info["group_name"], store), rank, info["world_size"], timeout)

    class Group:
        store_ = store

        def broadcast(self, tensor, src=0, stream=None):
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            pg.broadcast([tensor], opts).wait()

    return Group()


def _sharded_stream(folder, rank, world):
    """The tiny folder's weights in our model, its state dict as DTensors sharded over every rank (dim 0), as FSDP
    holds it; and the folder's own tensors (the oracle: what transformers wrote). The GPU check's own stream
    (``scripts/gpu_fleet_stages.py``), on CPU."""
    from gpu_fleet_stages import sharded_stream

    return sharded_stream(folder, world, torch.device("cpu"))


def _count_gathers(counter: dict) -> None:
    """Count the bytes this rank receives as a gather's destination (its own part left out): with the relays'
    broadcasts, everything a rank receives in a sync beyond headers and go flags."""
    import torch.distributed as dist

    real = dist.gather

    def gather(tensor, gather_list=None, *args, **kwargs):
        out = real(tensor, gather_list, *args, **kwargs)
        if gather_list:
            counter["bytes"] += sum(t.numel() * t.element_size() for t in gather_list[1:])
        return out

    dist.gather = gather


def _ranks_sync(rank, world, folder, out, die_at, per_node, senders=1):
    import datetime

    import torch.distributed as dist

    from titan_foremoe.rollouts.engines import sglang_weights
    from titan_foremoe.rollouts.engines.sync_cost import sender_groups
    from titan_foremoe.rollouts.engines.vllm_server import free_port
    from titan_foremoe.rollouts.engines.weight_buckets import Relay

    seconds = 60 if die_at is None else 20  # a dead peer is found by this timeout at worst
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=seconds))
    from titan_foremoe.distributed import collectives

    stream, ref = _sharded_stream(folder, rank, world)
    from titan_foremoe.rollouts.engines.vllm_weights import RailGroups

    groups = sender_groups(world, per_node, senders)
    mine = next((k for k, g in enumerate(groups) if rank in g), None)
    rails = RailGroups.make(world, per_node)
    standin = sender = relay = url = None
    if rank == 0:
        from sglang_standin import SGLangStandIn

        standin = SGLangStandIn(folder)
        url = standin.start()
    url = collectives.broadcast_object(url, src=0)
    info = None
    if mine is not None and groups[mine][0] == rank:  # a source: its own named group on the engine
        from titan_foremoe.rollouts.engines.sglang_server import SGLangClient

        client = SGLangClient(url, layers=2, top_k=2, timeout_s=60, retries=0, concurrency=1)
        sender = sglang_weights.SGLangBucketSender(lambda p, b: client.post(p, b, retry=False),
                                                   master_address="127.0.0.1", master_port=free_port(),
                                                   engine_workers=1, relays=len(groups[mine]) - 1, backend="gloo",
                                                   open_group=lambda i: _gloo_group(i, 0, seconds),
                                                   group_name=f"{sglang_weights.GROUP}_{mine}")
        info = dict(sender.init_info)
    infos = collectives.all_gather_objects(info)
    if sender is not None:
        sender.init()  # the engine joins the groups one at a time, as SGLang's does
    elif mine is not None:
        relay = Relay(_gloo_group(infos[groups[mine][0]], groups[mine].index(rank), seconds), mine)
    buckets = BucketStream(stream, BUCKET, src=[g[0] for g in groups], rails=rails)
    if die_at is not None and rank == world - 1:  # a trainer rank (a relay) dies mid-sync
        receive = relay.receive
        relay.receive = lambda b: os._exit(0) if b.index >= die_at else receive(b)  # exit 0: spawn keeps the others
    counter = {"bytes": 0}
    _count_gathers(counter)
    try:
        err = sync_buckets(buckets, rank, sender, relay)
    except Exception as e:  # noqa: BLE001
        err = f"raised {type(e).__name__}: {e}"
    from titan_foremoe.rollouts.engines.weight_buckets import nbytes

    result = {"err": err, "received": counter["bytes"] + (relay.received if relay else 0),
              "model": sum(nbytes(m) for m in buckets.meta),
              "planned": [[buckets.bucket_src(b), sum(nbytes(m) for m in metas)]
                          for b, metas in enumerate(buckets.buckets)]}
    if die_at is None:
        dist.barrier()  # every source done: the stand-in (on rank 0) has served every update
    if rank == 0:
        plan = [[f"{sglang_weights.GROUP}_{int(buckets.bucket_sender[b])}", [m.name for m in metas]]
                for b, metas in enumerate(buckets.buckets)]
        result.update(buckets=standin.buckets, plan=plan,
                      exact=sorted(n for n, t in ref.items() if torch.equal(standin.loaded.get(n, torch.empty(0)), t)),
                      names=sorted(ref), init=[body for path, body in standin.calls
                                               if path == "/init_weights_update_group"])
        standin.close()
    end_rank(out, rank, result, dead_peer=die_at is not None)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tinyb")), read_texts(
        "examples/arithmetic_word_problems.jsonl"), n_layers=2, head_dim=32)


def test_four_ranks_on_two_nodes_fill_an_engine_in_buckets(tiny_folder, tmp_path):
    """One sender: four trainer ranks (two "nodes" of two) hold the policy in uneven slices (DTensors); every
    parameter reaches the engine bit-exact under its HF name, in the planned buckets (one
    ``/update_weights_from_distributed`` each); the slices of every rank reach rank 0 in two hops (rank 3's via
    rank 1, its rail on node 0), rank 1 is in the engine's group as a relay (the engine at rank_offset 2); rank 0
    and its relay receive about the model (the single-sender cost the several senders remove)."""
    run_ranks(_ranks_sync, 4, tiny_folder, str(tmp_path), None, 2)
    r = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(4)]
    assert [x["err"] for x in r] == [None] * 4
    assert [(i["rank_offset"], i["world_size"]) for i in r[0]["init"]] == [(2, 3)]
    assert r[0]["buckets"] == r[0]["plan"] and len(r[0]["buckets"]) > 3
    assert r[0]["exact"] == r[0]["names"]
    M = r[0]["model"]
    assert r[0]["received"] > 0.7 * M and r[1]["received"] >= M and r[2]["received"] == r[3]["received"] == 0


def test_two_senders_each_send_a_share_of_the_model(tiny_folder, tmp_path):
    """Two sender groups (ranks 0 + 1 on "node" 0, ranks 2 + 3 on node 1), each its own named group on the
    stand-in engine (which takes one update at a time, as SGLang): every parameter arrives bit-exact under its
    HF name, each bucket through its planned source's group, both sources used; bytes received per rank, counted
    in the collectives, are the planned share of its group (~M / 2, not M)."""
    run_ranks(_ranks_sync, 4, tiny_folder, str(tmp_path), None, 2, 2)
    r = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(4)]
    assert [x["err"] for x in r] == [None] * 4
    assert sorted((i["group_name"], i["rank_offset"], i["world_size"]) for i in r[0]["init"]) == [
        ("titan_foremoe_weights_0", 2, 3), ("titan_foremoe_weights_1", 2, 3)]
    got = sorted(map(json.dumps, r[0]["buckets"]))
    assert got == sorted(json.dumps(p) for p in r[0]["plan"]) and len(got) > 3  # each bucket from its source
    assert {g for g, _ in r[0]["plan"]} == {"titan_foremoe_weights_0", "titan_foremoe_weights_1"}
    assert r[0]["exact"] == r[0]["names"]
    M = r[0]["model"]
    share = {src: sum(b for s, b in r[0]["planned"] if s == src) for src in (0, 2)}
    assert max(share.values()) < 0.7 * M and sum(share.values()) == M
    for rank, src in ((0, 0), (1, 0), (2, 2), (3, 2)):
        # a source: its buckets less its own slices (3/4, padded); a relay: its group's broadcasts plus, as the
        # rail member of its node's source, the other node's slices of that source's entries (1/4)
        assert 0.6 * share[src] <= r[rank]["received"] <= 1.3 * share[src], (rank, r[rank]["received"], share)
        assert r[rank]["received"] < 0.7 * M


def test_a_rank_that_dies_mid_sync_ends_it_in_one_line(tiny_folder, tmp_path):
    """Rank 2 dies after two buckets' gathers: ranks 0 and 1 end the sync with one line each, no hang."""
    run_ranks(_ranks_sync, 3, tiny_folder, str(tmp_path), 2, 3)
    for i in range(2):
        err = json.load(open(tmp_path / f"rank{i}.json"))["err"]
        print(f"rank {i}: {err}")
        assert err and "\n" not in err, (i, err)


def test_a_relay_that_dies_with_two_senders_ends_every_rank_in_one_line(tiny_folder, tmp_path):
    """Two senders; rank 3 (a relay of the second) dies at its group's third bucket: ranks 0-2 end with one line."""
    run_ranks(_ranks_sync, 4, tiny_folder, str(tmp_path), 4, 2, 2)
    for i in range(3):
        err = json.load(open(tmp_path / f"rank{i}.json"))["err"]
        print(f"rank {i}: {err}")
        assert err and "\n" not in err, (i, err)


def _ranks_fused(rank, world, folder, out):
    import datetime

    import torch.distributed as dist

    from titan_foremoe.rollouts.engines.vllm_fused_load import stack_experts
    from titan_foremoe.rollouts.engines.vllm_weights import RailGroups

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    stream, files = _sharded_stream(folder, rank, world)
    stream.fused = True
    buckets = BucketStream(stream, BUCKET, src=0, rails=RailGroups.make(world, 1))
    got = {}
    for b in buckets:
        if b.flat is not None:
            got.update(unpack(b.flat, b.metas))
    want = dict(stack_experts(list(files.items())))
    result = {"names": list(got), "want": sorted(want), "exact": sorted(n for n, t in got.items()
                                                                    if torch.equal(t, want[n]))}
    with open(os.path.join(out, f"fused{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_fused_buckets_from_sharded_ranks_are_the_stacked_checkpoint(tiny_folder, tmp_path):
    """Fused mode over two ranks on two "nodes" (DTensor slices, the two-hop gather): a layer's w1 and w3 are
    gathered to rank 0 as one entry and arrive as ``gate_up_proj``; every tensor equals the transformers-written
    folder's per-expert tensors stacked (``stack_experts``), bit for bit; rank 1 holds none."""
    run_ranks(_ranks_fused, 2, tiny_folder, str(tmp_path))
    r0, r1 = (json.load(open(tmp_path / f"fused{i}.json")) for i in range(2))
    assert sorted(r0["names"]) == r0["want"] == r0["exact"] and r1["names"] == []
    assert "model.layers.1.mlp.experts.gate_up_proj" in r0["names"]


class _BucketMB(int):
    """``weight_sync_bucket_mb`` whose ``<< 20`` (the source's MiB to bytes) is ``BUCKET`` bytes."""

    def __lshift__(self, bits):
        return BUCKET


def _fleet_source(rank, world, folder, out):
    """One rank of the test below: a ``VLLMSource`` with ``weight_sync = "nccl"``, ``urls`` of two engines of 2
    GPUs each and both trainer ranks on one node, so the one group is rank 0 (source), rank 1 (relay), engine 0's
    workers, engine 1's. The engines are fake vLLMs (``FakeEngine``) behind one recording group on rank 0 (a
    broadcast reaches every member); rank 1's relay side records its joins."""
    import datetime

    import torch.distributed as dist

    from titan_foremoe.config.job_config import JobConfig
    from titan_foremoe.rollouts.engines import vllm_weights
    from titan_foremoe.rollouts.fleet import engine as engine_mod
    from titan_foremoe.rollouts.sources.vllm import VLLMSource

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    group = FakeGroup()
    engines = [FakeEngine(group), FakeEngine(group)]
    vllm_weights._vllm_trainer_init = lambda info: group
    relay_joins = []

    class RelayGroup:  # rank 1's side: takes part in each broadcast (a CPU stand-in)
        def broadcast(self, tensor, src, stream):
            pass

    vllm_weights.vllm_relay_group = lambda info, r: relay_joins.append([info["master_port"], info["world_size"], r]) \
        or RelayGroup()
    torch.cuda.current_stream = lambda: "S"  # no GPU here
    other = []

    def connect(self, url):
        e = engines[int(url[-1])]
        post = e.post if rank == 0 else (lambda p, b, retry=True: other.append(p))
        self.client = type("C", (), {"url": url, "post": staticmethod(post), "healthy": staticmethod(e.healthy)})()

    engine_mod.Engine.connect = connect
    stream, ref = _sharded_stream(folder, rank, world)
    gathers = {"dst": set(), "all_to_all": 0}
    real_gather, real_a2a = dist.gather, dist.all_to_all_single

    def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
        gathers["dst"].add(dst if group_dst is None else group_dst)
        return real_gather(tensor, gather_list, dst=dst, group=group, async_op=async_op, group_dst=group_dst)

    def all_to_all_single(*a, **k):  # a gather to several sources would take it: one group never does
        gathers["all_to_all"] += 1
        return real_a2a(*a, **k)

    dist.gather, dist.all_to_all_single = gather, all_to_all_single
    cfg = JobConfig()
    cfg.job.dump_folder = out
    cfg.rollout_engine.weight_sync, cfg.rollout_engine.urls = "nccl", ["http://e:0", "http://e:1"]
    cfg.rollout_engine.gpus_per_engine = 2
    cfg.rollout_engine.weight_sync_bucket_mb = _BucketMB(1)  # BUCKET bytes: the tiny model in several buckets
    src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None, export=None,
                     policy_logprobs=None, rank=rank, dp_rank=rank, weights=lambda: stream)
    result = {"syncs": []}

    def sync(version):
        src.version = version
        before = len(group.sent)
        src.sync_weights()
        result["syncs"].append({"broadcasts": len(group.sent) - before, "alive": [e.alive for e in src.engines],
                                "versions": [e.version for e in src.engines]})

    for version in (0, 1):
        sync(version)
    from titan_foremoe.rollouts.engines.vllm_fused_load import stack_experts

    ref = dict(stack_experts(list(ref.items())))  # the folder's experts stacked (fused_expert_load, the default)
    exact = [sorted(n for n, t in ref.items() if torch.equal(e.__dict__.get("loaded", {}).get(n, torch.empty(0)), t))
             for e in engines]
    src.engines[1].alive = False  # the fleet agreed engine 1 is dead (a failed generation): every rank
    sync(2)
    src.engines[1].alive = True  # it answers again, but dies in the next sync: found dead, the survivor regrouped
    engines[1].fail = "/start_weight_update"
    sync(3)
    from titan_foremoe.rollouts.engines.weight_buckets import nbytes

    end_rank(out, rank, {**result, "paths": [[p for p, _ in e.calls] for e in engines], "other": other,
                         "init": [[b["init_info"] for p, b in e.calls if p == "/init_weight_transfer_engine"]
                                  for e in engines],
                         "exact": exact, "names": sorted(ref), "relay_joins": relay_joins,
                         "gather_dst": sorted(gathers["dst"]), "all_to_all": gathers["all_to_all"],
                         "buckets": len(src._bucket_stream(0).buckets),
                         "sent": sum(t.numel() * t.element_size() for *_, t in group.sent),
                         "model": sum(nbytes(m) for m in src._bucket_stream(0).meta), "failures":
                         [e.failures for e in src.engines],
                         "finish": [[b for p, b in e.calls if p == "/finish_weight_update"] for e in engines]})


def test_an_nccl_sync_feeds_every_engine_of_a_fleet_in_one_group(tiny_folder, tmp_path):
    """``[rollout_engine] urls`` = two engines of 2 GPUs, ``weight_sync = "nccl"``, 2 gloo ranks on one node: ONE
    transfer group (rank 0 the source, rank 1 its relay, engine 0's workers from offset 2, engine 1's from 4, world
    6, one port); each bucket broadcast once and both engines load every tensor bit-exact; every rank's slices go
    to rank 0 only (gather destinations), never to several sources. Engine 1 agreed dead: the next sync joins a
    new group of engine 0 alone (new port, world 4, the relay again); engine 1 back but dead mid-sync: found dead,
    the sync retried at once on the survivor's new group."""
    from distributed_helpers import rank_results

    run_ranks(_fleet_source, 2, tiny_folder, str(tmp_path))
    r0, r1 = rank_results(tmp_path, 2)
    e0, e1 = r0["init"]
    g1, g2 = e0[0], e1[0]
    assert (g1["rank_offset"], g1["world_size"], g2["rank_offset"], g2["world_size"]) == (2, 6, 4, 6)
    assert g1["master_port"] == g2["master_port"] and g1["master_address"] == g2["master_address"]
    step = ["/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"]
    join = ["/collective_rpc", "/init_weight_transfer_engine"]
    assert r0["paths"][1][:2 + 2 * len(step)] == [*join, *step, *step]
    B = r0["buckets"]
    assert B > 1 and [s["broadcasts"] for s in r0["syncs"]] == [B, B, B, B]  # once per bucket, for both engines
    assert r0["exact"] == [r0["names"], r0["names"]]  # both engines: every tensor bit-exact (the folder's)
    for r in (r0, r1):
        assert r["gather_dst"] == [0] and r["all_to_all"] == 0  # each rank's slice to the one source only
    assert r1["other"] == []  # the relay posts nothing
    # engine 1 out: a new group of engine 0 alone, new port, world 1 + 1 relay + 2
    assert (e0[1]["rank_offset"], e0[1]["world_size"]) == (2, 4) and e0[1]["master_port"] != g1["master_port"]
    assert r0["syncs"][2]["alive"] == [True, False] and r0["syncs"][2]["versions"] == [2, 1]
    # engine 1 back: both in a new group (world 6), engine 1 dead mid-sync, then engine 0 alone again (world 4)
    assert [(i["rank_offset"], i["world_size"]) for i in e0[2:]] == [(2, 6), (2, 4)]
    assert len({i["master_port"] for i in e0}) == 4
    assert r0["syncs"][3]["alive"] == [True, False] and r0["syncs"][3]["versions"] == [3, 1]
    assert r0["failures"] == r1["failures"] == [0, 1]
    assert [(s["alive"], s["versions"]) for s in r1["syncs"]] == [(s["alive"], s["versions"]) for s in r0["syncs"]]
    assert [j[1:] for j in r1["relay_joins"]] == [[6, 1], [4, 1], [6, 1], [4, 1]]  # the relay at group rank 1
    assert [b["weight_version"] for b in r0["finish"][0]] == ["0", "1", "2", "3"]
    assert [b["weight_version"] for b in r0["finish"][1]] == ["0", "1"]
