"""``[rollout_engine] weight_sync = "nccl"`` on mocks (no GPU here): the stream is the HF export's tensors, the
sender drives vLLM's routes in order around a broadcast in that same order, the payloads parse as vLLM's own
dataclasses and the server flag as its CLI, errors drain the stream and name the problem, CPU jobs are refused."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from contextlib import contextmanager

import pytest
import torch

from titan_foremoe.rollouts.engines.sync_cost import bucket_bounds
from titan_foremoe.rollouts.engines.vllm_api import weight_transfer_args
from titan_foremoe.rollouts.engines.vllm_server import EngineError
from titan_foremoe.rollouts.engines.vllm_weights import HFWeightStream, NCCLWeightSender, ParamMeta


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A transformers-written tiny Qwen3-MoE folder, our model loaded from it, the checkpointer's adapter."""
    from safetensors.torch import load_file

    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts
    from titan_foremoe.models.build import build_model_config
    from titan_foremoe.models.hf import HFAdapter, model_args_from_hf, safetensors_files

    texts = read_texts("examples/arithmetic_word_problems.jsonl")
    hf = make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), texts, n_layers=2, head_dim=32)
    cfg = build_model_config(model_args_from_hf(hf), expert_dtype="float32")
    model, adapter = cfg.build(), HFAdapter(cfg, hf)
    files = {}
    for f in safetensors_files(hf):
        files.update(load_file(os.path.join(hf, f)))
    missing, unexpected = model.load_state_dict(adapter.from_hf(dict(files)), strict=False)
    assert not unexpected and all("expert_bias" in k or "tokens_per_expert" in k for k in missing), missing
    return model, adapter, files


def _stream(tiny, dtype=torch.float32, layout=None):
    model, adapter, _ = tiny
    return HFWeightStream(model.state_dict, adapter, dtype, layout or (lambda: _nullctx()))


@contextmanager
def _nullctx():
    yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_is_the_hf_checkpoint(tiny, dtype):
    """Oracle: the folder transformers wrote. Every tensor, by HF name, in the engine dtype, bit for bit; the
    metadata (nothing gathered) equals the pass element for element."""
    files = tiny[2]
    meta = _stream(tiny, dtype).metadata()
    pairs = list(_stream(tiny, dtype))
    assert [m.name for m in meta] == [n for n, _ in pairs]
    assert meta == [ParamMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in pairs]
    assert sorted(n for n, _ in pairs) == sorted(files)  # every HF tensor once (69: 2 layers x 8 experts x 3 + ...)
    for name, t in pairs:
        assert t.dtype == dtype and torch.equal(t, files[name].to(dtype)), name
    # experts in logical order within each layer: expert e's tensors come before e + 1's
    names = [m.name for m in meta]
    e = [int(n.split(".experts.")[1].split(".")[0]) for n in names if ".mlp.experts." in n and "gate_proj" in n]
    assert e == list(range(8)) * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_stream_is_transformers_stacked_experts(tiny, dtype):
    """Oracle: transformers' own Qwen3-MoE from the folder it wrote (5.x holds each layer's experts stacked under
    vLLM's fused names, gate rows then up rows). The fused pass yields exactly its state dict (every tensor bit for
    bit, in the engine dtype), two stacked tensors per layer instead of 3E; the per-expert pass stacked by
    ``vllm_fused_load.stack_experts`` (the extension's own reading) agrees; the metadata equals the pass."""
    from transformers import Qwen3MoeForCausalLM

    from titan_foremoe.rollouts.engines.vllm_fused_load import stack_experts

    model, adapter, _ = tiny
    ref = Qwen3MoeForCausalLM.from_pretrained(adapter.hf_assets_path, dtype=torch.float32).state_dict()
    ref = {k: v for k, v in ref.items() if k != "lm_head.weight" or not torch.equal(v, ref["model.embed_tokens.weight"])}
    stream = HFWeightStream(model.state_dict, adapter, dtype, lambda: _nullctx(), fused=True)
    pairs = list(stream)
    assert stream.metadata() == [ParamMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in pairs]
    assert sorted(n for n, _ in pairs) == sorted(ref)
    assert [n for n, _ in pairs if ".experts." in n] == [f"model.layers.{i}.mlp.experts.{k}_proj" for i in (0, 1)
                                                          for k in ("gate_up", "down")]
    for name, t in pairs:
        assert t.dtype == dtype and torch.equal(t, ref[name].to(dtype)), name
    assert ref["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)  # [E, 2F, D]
    per_expert = dict(stack_experts(list(_stream(tiny, dtype))))
    assert set(per_expert) == set(dict(pairs)) and all(torch.equal(t, per_expert[n]) for n, t in pairs)


def test_stream_reads_the_weights_inside_the_logical_layout(tiny):
    """The placement's ``logical()`` is entered before the state dict is read and left after the last tensor."""
    log = []
    model, adapter, _ = tiny

    @contextmanager
    def layout():
        log.append("enter")
        yield
        log.append("exit")

    def state_dict():
        log.append("read")
        return model.state_dict()

    stream = HFWeightStream(state_dict, adapter, torch.float32, layout)
    it = iter(stream)
    next(it)
    assert log == ["enter", "read"]
    for _ in it:
        pass
    assert log == ["enter", "read", "exit"]


class FakeEngine:
    """vLLM's routes as the trainer sees them: records every POST; ``/update_weights`` blocks (like the real one,
    inside NCCL) until the group has received every tensor it announced, and fails if it never does."""

    def __init__(self, group, fail: str = "", workers: int = 2):
        self.calls, self.group, self.fail, self.announced, self.workers = [], group, fail, 0, workers

    NO_RETRY = {"/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update"}

    def post(self, path, body, retry=True):
        assert retry is False or path not in self.NO_RETRY, f"{path} would be retried"
        self.calls.append((path, json.loads(json.dumps(body))))  # what would go over HTTP
        if path == self.fail:  # the engine dies there: /health fails from then on
            self.down = True
            raise EngineError(f"vLLM at http://fake{path}: HTTP 500")
        if path == "/reset_prefix_cache":
            return {"success": self.fail != "reset refused"}
        if path == "/collective_rpc":  # vLLM's answer: one str per worker; the extension's layers it can take
            assert body == {"method": "install_fused_expert_load"}
            return {"results": ["2"] * self.workers}
        if path == "/init_weight_transfer_engine":
            self.packed = body["init_info"].get("packed") and body["init_info"]["packed_buffer_size_bytes"]
            self.announced = len(self.group.sent)  # a group joined now: the broadcasts from here on are its own
        if path == "/update_weights":
            u = body["update_info"]
            first = self.announced
            if getattr(self, "packed", None):  # vLLM's packed consumer: one broadcast per bucket
                sizes = [math.prod(s) * getattr(torch, d).itemsize for d, s in zip(u["dtype_names"], u["shapes"])]
                self.announced += len(bucket_bounds(sizes, self.packed)) - 1
            else:
                self.announced += len(u["names"])
            if not self.group.received(self.announced, timeout=20):
                raise EngineError("fake engine: broadcasts never arrived")
            if getattr(self, "packed", None):  # what this engine's workers load: the buckets it received, unpacked
                from titan_foremoe.rollouts.engines.weight_buckets import plan, unpack

                meta = [ParamMeta(n, d, tuple(s)) for n, d, s in zip(u["names"], u["dtype_names"], u["shapes"])]
                flats = [t for *_, t in self.group.sent[first:self.announced]]
                self.loaded = dict(kv for f, m in zip(flats, plan(meta, self.packed)) for kv in unpack(f, m))
        return {}

    def healthy(self):
        return not getattr(self, "down", False)


class FakeGroup:
    """The communicator ``trainer_init`` returns: records each broadcast (shape, dtype, src, a copy)."""

    def __init__(self):
        self.sent, self.cond = [], threading.Condition()

    def broadcast(self, tensor, src, stream):
        with self.cond:
            self.sent.append((tuple(tensor.shape), tensor.dtype, src, stream, tensor.clone()))
            self.cond.notify_all()

    def received(self, n, timeout):
        with self.cond:
            return self.cond.wait_for(lambda: len(self.sent) >= n, timeout)


def _sender(engine, group, opened):
    return NCCLWeightSender(lambda path, body: engine.post(path, body, retry=False), master_address="10.0.0.1",
                            master_port=29511, engine_workers=4,
                            open_group=lambda info: opened.append(info) or group, stream=lambda: "S")


def test_sender_drives_vllm_routes_around_the_broadcast_in_order(tiny):
    group = FakeGroup()
    engine, opened = FakeEngine(group), []
    sender = _sender(engine, group, opened)
    sender.init()
    init_info = {"master_address": "10.0.0.1", "master_port": 29511, "rank_offset": 1, "world_size": 5,
                 "packed": False}
    assert engine.calls == [("/init_weight_transfer_engine", {"init_info": init_info})]
    assert opened == [init_info]
    for step in range(2):
        engine.calls.clear()
        group.sent.clear()
        engine.announced = 0
        stream = _stream(tiny, torch.bfloat16)
        meta = stream.metadata()
        sender.send(meta, stream)
        assert [p for p, _ in engine.calls] == ["/start_weight_update", "/update_weights", "/finish_weight_update",
                                                "/reset_prefix_cache"]
        update = engine.calls[1][1]["update_info"]
        pairs = list(_stream(tiny, torch.bfloat16))
        assert update["names"] == [n for n, _ in pairs]
        assert update["dtype_names"] == ["bfloat16"] * len(pairs)
        assert update["shapes"] == [list(t.shape) for _, t in pairs]
        assert [(s, d, src, st) for s, d, src, st, _ in group.sent] == [
            (tuple(t.shape), t.dtype, 0, "S") for _, t in pairs]
        assert all(torch.equal(got[4], t) for got, (_, t) in zip(group.sent, pairs))
    assert sender.updates == 2
    _check_with_vllm(init_info, update)


def _check_with_vllm(init_info, update):
    """Oracle: vLLM's own dataclasses take our payloads, and its server CLI takes our flag (the engine venv)."""
    from vllm_helpers import engine_python

    code = (
        "import json, sys\n"
        "from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo\n"
        "from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.openai.cli_args import make_arg_parser\n"
        "from vllm.engine.arg_utils import AsyncEngineArgs\n"
        "init, update, flags = json.load(sys.stdin)\n"
        "NCCLWeightTransferInitInfo(**init)\n"
        "u = NCCLWeightTransferUpdateInfo(**update)\n"
        "a = make_arg_parser(FlexibleArgumentParser()).parse_args(['--model', 'x', *flags])\n"
        "print(json.dumps([len(u.names), AsyncEngineArgs.from_cli_args(a).weight_transfer_config.backend]))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([engine_python(), "-c", code], input=json.dumps([init_info, update, weight_transfer_args()]),
                         capture_output=True, text=True, timeout=180, env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [len(update["names"]), "nccl"]


def test_a_refused_update_is_an_error_and_the_gathers_still_complete(tiny):
    group = FakeGroup()
    engine, opened = FakeEngine(group, fail="/update_weights"), []
    sender = _sender(engine, group, opened)
    sender.init()
    drawn = []
    stream = _stream(tiny)
    meta = stream.metadata()
    with pytest.raises(EngineError, match="update_weights"):
        sender.send(meta, (drawn.append(n) or (n, t) for n, t in stream))
    assert len(drawn) == len(meta)  # every rank's gathers ran to the end: no rank hangs
    assert "/finish_weight_update" not in [p for p, _ in engine.calls] and sender.updates == 0


def test_a_stream_that_disagrees_with_the_metadata_is_named(tiny):
    group = FakeGroup()
    sender = _sender(FakeEngine(group), group, [])
    sender.init()
    stream = _stream(tiny)
    meta = stream.metadata()
    wrong = [meta[0], ParamMeta(meta[1].name, "float16", meta[1].shape), *meta[2:]]
    with pytest.raises(EngineError, match=rf"tensor 1 is .*{meta[1].name}.*float32.*told.*float16"):
        sender.send(wrong, stream)
    with pytest.raises(EngineError, match=r"sent 69 tensors, the engine expects 70"):
        sender.send([*meta, meta[0]], _stream(tiny))


def test_launched_engine_gets_the_transfer_flag():
    from titan_foremoe.rollouts.engines.vllm_server import LaunchSpec, VLLMServer

    cmd = VLLMServer(LaunchSpec(python=sys.executable, model="/m", weight_transfer=True)).command()
    i = cmd.index("--weight-transfer-config")
    assert json.loads(cmd[i + 1]) == {"backend": "nccl"}
    assert "--weight-transfer-config" not in VLLMServer(LaunchSpec(python=sys.executable, model="/m")).command()


def test_launched_engine_gets_the_extension_importable_from_our_package_alone(tmp_path):
    """The fused load's launch: ``--worker-extension-cls`` and a ``PYTHONPATH`` holding only our package (a link),
    from which the engine venv's python imports the extension (oracle: that interpreter's import)."""
    from titan_foremoe.rollouts.engines.vllm_fused_load import EXTENSION, engine_path
    from titan_foremoe.rollouts.engines.vllm_server import LaunchSpec, VLLMServer

    cmd = VLLMServer(LaunchSpec(python=sys.executable, model="/m", worker_extension=EXTENSION)).command()
    assert cmd[cmd.index("--worker-extension-cls") + 1] == EXTENSION
    assert "--worker-extension-cls" not in VLLMServer(LaunchSpec(python=sys.executable, model="/m")).command()
    path = engine_path(str(tmp_path))
    assert os.listdir(path) == ["titan_foremoe"] and engine_path(str(tmp_path)) == path  # again: kept
    from vllm_helpers import engine_python

    module, cls = EXTENSION.rsplit(".", 1)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([engine_python(), "-c", f"import {module} as m; print(m.__file__, m.{cls}.__name__)"],
                         capture_output=True, text=True, timeout=180, env=env, cwd=str(tmp_path))
    assert out.returncode == 0 and out.stdout.split()[1] == cls, out.stderr[-2000:]
    assert out.stdout.startswith(path)


def test_a_user_run_engine_without_the_extension_is_one_line(tiny, tmp_path, monkeypatch):
    """``fused_expert_load = true`` and an engine whose workers lack the extension: the step fails before any
    gather, naming the flag to start it with; ``false`` syncs it with one HF tensor per expert, no install."""
    from titan_foremoe.rollouts.engines import vllm_weights
    from titan_foremoe.rollouts.engines.vllm_fused_load import EXTENSION

    group = FakeGroup()
    engine = FakeEngine(group, fail="/collective_rpc")
    monkeypatch.setattr(vllm_weights, "_vllm_trainer_init", lambda info: group)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "S")
    src, _ = _nccl_source(tiny, tmp_path, monkeypatch, engine, url="http://e:1")
    with pytest.raises(EngineError, match=r"^vLLM weight sync failed: rank 0: EngineError: vLLM at http://e:1 has "
                                          rf"no FusedExpertLoad worker extension .*--worker-extension-cls {EXTENSION}"):
        src.sync_weights()
    assert group.sent == []
    engine = FakeEngine(group)
    src, _ = _nccl_source(tiny, tmp_path, monkeypatch, engine, url="http://e:1", fused_expert_load=False)
    src.sync_weights()
    paths = [p for p, _ in engine.calls]
    assert "/collective_rpc" not in paths
    names = engine.calls[paths.index("/update_weights")][1]["update_info"]["names"]
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names and not any("gate_up" in n for n in names)


def test_a_second_worker_extension_is_refused_with_the_fused_load(tmp_path, monkeypatch):
    from titan_foremoe.config import ConfigError, load_config
    from titan_foremoe.config import validate as v
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    hf = make_tiny_checkpoint(str(tmp_path / "tiny"), read_texts("examples/arithmetic_word_problems.jsonl"),
                              n_layers=2, head_dim=32)
    monkeypatch.setattr(v, "_job_device_type", lambda: "cuda")
    monkeypatch.setattr(v, "_trainer_has", lambda package: True)

    def check(fused: bool):
        cfg = load_config("train_configs/qwen3_moe_hf_vllm.toml", [
            f"--job.dump_folder={tmp_path}", f"--model.hf_assets_path={hf}",
            f"--rollout_engine.python={sys.executable}", "--rollout_engine.weight_sync=nccl"])
        cfg.rollout_engine.extra_args = ["--worker-extension-cls", "my.Ext"]
        cfg.rollout_engine.fused_expert_load = fused
        return v.validate(cfg, 2)

    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] extra_args: --worker-extension-cls conflicts "
                                          r"with fused_expert_load = true"):
        check(True)
    assert check(False).rollout_sequences == 32  # the user's own extension, per-expert tensors


def test_nccl_sync_is_refused_on_cpu_and_without_vllm(tmp_path, monkeypatch):
    from titan_foremoe.config import ConfigError, load_config
    from titan_foremoe.config import validate as v
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    hf = make_tiny_checkpoint(str(tmp_path / "tiny"), read_texts("examples/arithmetic_word_problems.jsonl"),
                              n_layers=2, head_dim=32)

    def check():
        return v.validate(load_config("train_configs/qwen3_moe_hf_vllm.toml", [
            f"--job.dump_folder={tmp_path}", f"--model.hf_assets_path={hf}",
            f"--rollout_engine.python={sys.executable}", "--rollout_engine.weight_sync=nccl"]), 2)

    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] weight_sync: 'nccl' needs GPUs.*device is cpu"):
        check()  # this machine: no GPU
    monkeypatch.setattr(v, "_job_device_type", lambda: "cuda")
    monkeypatch.setattr(v, "_trainer_has", lambda package: False)
    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] weight_sync: 'nccl' needs vllm importable"):
        check()
    monkeypatch.setattr(v, "_trainer_has", lambda package: package == "vllm")
    assert check().rollout_sequences == 32  # a GPU job with vLLM: accepted


def _nccl_source(tiny, tmp_path, monkeypatch, engine, **engine_keys):
    """A ``VLLMSource`` with ``weight_sync = "nccl"`` whose client posts to the fake ``engine``; the folders it
    exports are recorded."""
    from titan_foremoe.config.job_config import JobConfig
    from titan_foremoe.rollouts.sources.vllm import VLLMSource

    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.rollout_engine.weight_sync = "nccl"
    for key, value in engine_keys.items():
        setattr(cfg.rollout_engine, key, value)
    exported = []
    src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None,
                     export=exported.append, policy_logprobs=None, rank=0, dp_rank=0,
                     weights=lambda: _stream(tiny, torch.bfloat16))
    monkeypatch.setattr(src, "_connect", lambda url, k=0: setattr(src, "client", type("C", (), {"url": url,
                                                                                          "post": engine.post})()))
    return src, exported


def test_vllm_source_syncs_a_user_run_engine_by_nccl_every_step(tiny, tmp_path, monkeypatch):
    """The source's step: the first sync joins the group (no folder is written), every sync is one update; a
    refused update is an ``EngineError`` on the step (no restart: a fresh engine would lack group and weights)."""
    from titan_foremoe.rollouts.engines import vllm_weights

    group = FakeGroup()
    engine = FakeEngine(group)
    monkeypatch.setattr(vllm_weights, "_vllm_trainer_init", lambda info: group)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "S")  # no GPU here
    src, exported = _nccl_source(tiny, tmp_path, monkeypatch, engine, url="http://e:1", gpus_per_engine=2)
    src.sync_weights()
    src.sync_weights()
    paths = [p for p, _ in engine.calls]
    step = ["/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"]
    assert paths == ["/collective_rpc", "/init_weight_transfer_engine", *step, *step]  # install, join, 2 syncs
    assert exported == [] and src.syncs == 2
    names = engine.calls[3][1]["update_info"]["names"]  # stacked experts under vLLM's fused names
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and not any(".experts.0." in n for n in names)
    assert engine.calls[1][1]["init_info"]["world_size"] == 3 and engine.calls[1][1]["init_info"]["packed"]
    assert len(group.sent) == 2 and all(d == torch.uint8 for _, d, *_ in group.sent)  # the tiny model: one bucket
    engine.fail = "/finish_weight_update"
    with pytest.raises(EngineError, match=r"finish_weight_update: HTTP 500"):
        src.sync_weights()
    engine.fail = "reset refused"
    with pytest.raises(EngineError, match=r"reset_prefix_cache refused"):
        src.sync_weights()


def test_a_failed_join_is_agreed_before_any_gather(tiny, tmp_path, monkeypatch):
    """The engine refuses ``/init_weight_transfer_engine``: every rank learns it before the pass starts (no rank
    is left in a gather), and the step fails naming the route, in one line."""
    from titan_foremoe.config.job_config import JobConfig
    from titan_foremoe.rollouts.engines import vllm_weights
    from titan_foremoe.rollouts.sources.vllm import VLLMSource

    group = FakeGroup()
    engine = FakeEngine(group, fail="/init_weight_transfer_engine")
    monkeypatch.setattr(vllm_weights, "_vllm_trainer_init", lambda info: group)
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.rollout_engine.url, cfg.rollout_engine.weight_sync = "http://e:1", "nccl"
    drawn = []

    class Counting:
        def __init__(self):
            drawn.append(1)

    src = VLLMSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None, export=None,
                     policy_logprobs=None, rank=0, dp_rank=0, weights=Counting)
    src.client = type("C", (), {"url": "http://e:1", "post": engine.post})()
    with pytest.raises(EngineError, match=r"^vLLM weight sync failed: rank 0: EngineError: .*"
                                          r"init_weight_transfer_engine: HTTP 500$"):
        src.sync_weights()
    assert drawn == [] and group.sent == []


class FakeServer:
    """A launched engine's lifetime: ``up`` until a test kills it; ``start`` records the folder and comes back up on
    the next URL (``base:2``, ``base:3``, ...)."""

    def __init__(self, base: str):
        self.base, self.starts, self.up = base, [], True

    def alive(self):
        return self.up

    def start(self, folder):
        self.starts.append(folder)
        self.up = True
        return f"{self.base}:{len(self.starts) + 1}"


def test_an_engine_that_dies_mid_sync_is_restarted_on_the_policy_and_joined_again(tiny, tmp_path, monkeypatch):
    """A launched engine dies during the bucketed sync: every rank exports the policy, rank 0 starts the engine
    again on that folder (it then serves the current weights: refilled) within ``max_restarts``, and the next sync
    joins the new engine's transfer group and succeeds; a second death past ``max_restarts`` is the error."""
    from titan_foremoe.rollouts.engines import vllm_weights

    group = FakeGroup()
    engine = FakeEngine(group, fail="/start_weight_update")
    monkeypatch.setattr(vllm_weights, "_vllm_trainer_init", lambda info: group)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "S")

    src, exported = _nccl_source(tiny, tmp_path, monkeypatch, engine, url="", max_restarts=1)
    src.server, src.syncs = FakeServer("http://e"), 1  # launched on the first folder at step 0
    src._connect("http://e:1")
    src.server.up = False  # the engine died: its next weight-sync call fails
    src.sync_weights()
    assert src.restarts == 1 and src.server.starts == exported == [str(tmp_path / "engine_weights" / "policy_1")]
    assert src.client.url == "http://e:2" and not src.joined
    engine.fail, engine.calls = "", []
    src.sync_weights()
    assert [p for p, _ in engine.calls][:3] == ["/collective_rpc", "/init_weight_transfer_engine",
                                                "/start_weight_update"]  # the new engine: installed, joined
    engine.fail, src.server.up = "/start_weight_update", False
    with pytest.raises(EngineError, match=r"^vLLM weight sync failed: rank 0: EngineError: .*start_weight_update"):
        src.sync_weights()
