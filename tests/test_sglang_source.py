"""``[rl] rollout_source = "sglang"`` against a stand-in server (SGLang does not run on this machine).

The stand-in (``tests/sglang_standin.py``) speaks SGLang's HTTP formats as read from SGLang's source, with
transformers' Qwen3-MoE behind them. The references here are separate transformers forwards over the same tokens:

- the client's decoded routes equal transformers' router top-k of every fed token (prompt and completion), and
  its log-probs equal transformers' (``log_softmax(logits / temperature)``), for sampled and greedy requests and
  the probe's prompt log-probs;
- ``/update_weights_from_disk`` of another folder changes the outputs to that folder's model; a refused load is
  an error carrying SGLang's message;
- malformed answers (routes one position short, one layer too many, missing; log-probs short) are errors naming
  the field, the byte counts and the shape expected;
- ``SGLangSource`` runs two RL steps' rollouts: sync (update from disk + flush, the folders alternating), probe,
  generation; rows validated and routed; a policy the engine does not serve stops it at the probe;
- the config refuses bad ``[sglang_engine]`` values naming the key, the pre-flight an interpreter without SGLang.
"""

from __future__ import annotations

import functools
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang_standin import SGLangStandIn

LAYERS, TOP_K = 3, 2  # distinct: a transposed layout fails


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two tiny Qwen3-MoE folders (different seeds): the weights before and after an "update"."""
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    tmp = tmp_path_factory.mktemp("sglang")
    texts = read_texts("examples/arithmetic_word_problems.jsonl")
    return [make_tiny_checkpoint(str(tmp / name), texts, n_layers=LAYERS, top_k=TOP_K, seed=seed)
            for name, seed in (("a", 0), ("b", 1))]


@pytest.fixture()
def engine(folders):
    from titan_foremoe.rollouts.engines.sglang_server import SGLangClient

    standin = SGLangStandIn(folders[0])
    url = standin.start()
    yield standin, SGLangClient(url, layers=LAYERS, top_k=TOP_K, timeout_s=60, retries=0, concurrency=2)
    standin.close()


@functools.lru_cache(maxsize=4)
def _hf(folder):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def _reference(folder, tokens_T, temperature=1.0):
    """transformers' log p(token t | < t) for t >= 1 at ``temperature`` and its router top-k of every fed token."""
    model = _hf(folder)
    x = torch.tensor(tokens_T)[None]
    out = model(x, output_router_logits=True)
    logp = (out.logits[0, :-1] / temperature).log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]
    top = torch.stack([r.view(len(tokens_T), -1).topk(TOP_K, -1).indices for r in out.router_logits], 1)
    return logp.numpy(), top[:-1].numpy()


PROMPTS = [[3, 17, 5, 9, 22, 4], [8, 2, 11, 30]]


def test_routes_and_logprobs_equal_transformers(engine, folders):
    standin, client = engine
    groups = client.generate_many([dict(prompt_ids=p, n=2, max_tokens=6, temperature=0.8, top_p=1.0, seed=i)
                                   for i, p in enumerate(PROMPTS)])
    greedy = client.generate_many([dict(prompt_ids=PROMPTS[0], n=1, max_tokens=5, temperature=0.0, top_p=1.0,
                                        seed=0)])[0]
    for temp, p, group in [(0.8, PROMPTS[0], groups[0]), (0.8, PROMPTS[1], groups[1]), (1.0, PROMPTS[0], greedy)]:
        for c in group:
            tokens = [*p, *c.token_ids]
            lp, top = _reference(folders[0], tokens, temp)
            assert c.routes_RXK.shape == (len(tokens) - 1, LAYERS, TOP_K)
            assert (c.routes_RXK == top).all()  # prompt and completion positions
            np.testing.assert_allclose(c.logprobs, lp[len(p) - 1:], atol=1e-5)
    assert [e[0] for e in standin.calls] == ["/generate"] * 5
    assert standin.calls[0][1]["return_routed_experts"] and standin.calls[0][1]["return_logprob"]
    lp, routes = client.prompt_logprobs(PROMPTS[0])  # the probe: logprob_start_len 0
    ref_lp, ref_top = _reference(folders[0], PROMPTS[0])
    np.testing.assert_allclose(lp, ref_lp, atol=1e-5)
    assert routes.shape == (len(PROMPTS[0]), LAYERS, TOP_K) and (routes[:-1] == ref_top).all()


def test_weight_update_from_disk_changes_the_outputs(engine, folders):
    from titan_foremoe.rollouts.engines.vllm_server import EngineError

    standin, client = engine
    before, _ = client.prompt_logprobs(PROMPTS[1])
    client.reload_weights(folders[1])
    client.reset_prefix_cache()
    after, routes = client.prompt_logprobs(PROMPTS[1])
    ref_lp, ref_top = _reference(folders[1], PROMPTS[1])
    np.testing.assert_allclose(after, ref_lp, atol=1e-5)
    assert (routes[:-1] == ref_top).all() and np.abs(after - before).max() > 1e-3
    assert [e[0] for e in standin.calls[1:3]] == ["/update_weights_from_disk", "/flush_cache"]
    assert standin.calls[1][1]["model_path"] == folders[1]
    with pytest.raises(EngineError, match=r"HTTP 400.*Failed to update weights"):
        client.reload_weights("/nonexistent/folder")


@pytest.mark.parametrize("fault, match", [
    ("short_routes", r"meta_info\.routed_experts holds 120 bytes = 30 int32 ids, expected 144 bytes = 6 positions "
                     r"\(tokens 0\.\.5\) x 3 layers x 2 experts"),
    ("extra_layer", r"meta_info\.routed_experts holds 192 bytes = 48 int32 ids, expected 144 bytes .* "
                    r"\(8 ids per position instead of 6: does the engine serve a model with another layer count "
                    r"or top-k\?\)"),
    ("no_routes", r"meta_info has no routed_experts \(start SGLang with --enable-return-routed-experts"),
    ("short_logprobs", r"meta_info\.output_token_logprobs has 2 entries for 3 tokens"),
])
def test_malformed_answers_are_clear_errors(engine, fault, match):
    from titan_foremoe.rollouts.engines.vllm_server import EngineError

    standin, client = engine
    standin.fault = fault
    with pytest.raises(EngineError, match=r"SGLang at http://127\.0\.0\.1:\d+/generate: " + match):
        client.generate_many([dict(prompt_ids=PROMPTS[1], n=1, max_tokens=3, temperature=0.0, top_p=1.0, seed=0)])


class _Prompts:
    """The embedded source's prompt side: ``prompts(step)`` -> (examples, token lists)."""

    def prompts(self, step):
        return [SimpleNamespace(answer="x", prompt="p"), SimpleNamespace(answer="y", prompt="q")], PROMPTS


def _source(tmp_path, url, export, policy_logprobs):
    from titan_foremoe.config.job_config import JobConfig
    from titan_foremoe.rollouts.sample import ModelSpec
    from titan_foremoe.rollouts.sources.sglang import SGLangSource

    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.rl.samples_per_prompt, cfg.rl.max_new_tokens, cfg.rl.temperature = 2, 4, 1.0
    cfg.sglang_engine.url = url
    tokenizer = SimpleNamespace(pad_id=0, eos_ids=[1], decode=lambda ids: " ".join(map(str, ids)))
    return SGLangSource(cfg, prompts=_Prompts(), tokenizer=tokenizer, task=None,
                        reward_fn=lambda task, ex, c: float(len(c)), spec=ModelSpec(LAYERS, TOP_K, 8, None),
                        export=export, policy_logprobs=policy_logprobs, rank=0, dp_rank=0)


def test_sglang_source_syncs_probes_and_generates(engine, folders, tmp_path):
    """Two steps: the policy is folder a, then folder b; the engine is updated from the alternating folders."""
    from titan_foremoe.rollouts.engines.vllm_server import EngineError

    standin, client = engine
    policy = {"folder": folders[0]}

    def export(folder):  # the trainer's HF export of its current policy
        shutil.copytree(policy["folder"], folder, dirs_exist_ok=True)

    probed = []

    def policy_logprobs(tokens_T, routes_RXK):  # the trainer's forward (routes replayed): transformers here
        lp, top = _reference(policy["folder"], tokens_T)
        probed.append(bool((routes_RXK == top).all()))  # the engine's probe routes are the policy's
        return lp

    src = _source(tmp_path, client.url, export, policy_logprobs)
    for step, folder in enumerate(folders):
        policy["folder"] = folder
        batch = src.next_batch(step)
        r = batch.rollout
        assert r.tokens_BT.shape[0] == 4 and batch.rewards_B.shape == (4,)
        assert src.timings["rollout/probe_gap"] <= 1e-5
        for b in range(4):
            T = int(r.lengths_B[b])
            _, top = _reference(folder, r.tokens_BT[b, :T].tolist())
            assert (r.routes.experts_BTXK[b, : T - 1].numpy() == top).all()
            np.testing.assert_allclose(r.logprobs_BT[b, int(r.prompt_lens_B[b]):T].numpy(),
                                       _reference(folder, r.tokens_BT[b, :T].tolist())[0][int(r.prompt_lens_B[b]) - 1:],
                                       atol=1e-5)
    assert probed == [True, True]
    updates = [body["model_path"] for path, body in standin.calls if path == "/update_weights_from_disk"]
    assert [u.rsplit("/", 1)[1] for u in updates] == ["policy_0", "policy_1"]
    paths = [path for path, _ in standin.calls]
    assert paths[:3] == ["/update_weights_from_disk", "/flush_cache", "/generate"]

    def stale(folder):  # the engine gets folder a while the policy is b
        shutil.copytree(folders[0], folder, dirs_exist_ok=True)

    src.export = stale
    with pytest.raises(EngineError, match=r"SGLang at .*: probe log-probs differ from the trainer's by .* "
                                          r"\[sglang_engine\] probe_tolerance"):
        src.next_batch(2)


def test_sglang_engine_settings_are_checked(tmp_path, folders):
    from titan_foremoe.config import ConfigError, load_config
    from titan_foremoe.config.preflight import check_sglang_python
    from titan_foremoe.config.validate import validate

    def check(*extra):
        return validate(load_config("train_configs/qwen3_moe_hf_vllm.toml", [
            f"--job.dump_folder={tmp_path}", f"--model.hf_assets_path={folders[0]}", "--rl.rollout_source=sglang",
            *extra]), 2)

    ok = f"--sglang_engine.python={sys.executable}"
    assert check(ok).rollout_sequences == 32
    assert check("--sglang_engine.url=http://127.0.0.1:30000").rollout_sequences == 32
    with pytest.raises(ConfigError, match=r"\[sglang_engine\] python.*does not exist.*SGLang installed"):
        check("--sglang_engine.python=/nonexistent/python")
    with pytest.raises(ConfigError, match=r"\[sglang_engine\] python: must name"):
        check()
    with pytest.raises(ConfigError, match=r"\[sglang_engine\] url.*not an http URL"):
        check("--sglang_engine.url=localhost:30000")
    with pytest.raises(ConfigError, match=r"\[sglang_engine\] max_model_len"):
        check(ok, "--sglang_engine.max_model_len=8")
    with pytest.raises(ConfigError, match=r"\[sglang_engine\] concurrency"):
        check(ok, "--sglang_engine.concurrency=0")
    with pytest.raises(ConfigError, match=r"\[sglang_engine\] weight_sync"):
        check(ok, "--sglang_engine.weight_sync=nccl")
    with pytest.raises(ConfigError, match=r"^\[sglang_engine\] weight_sync: 'distributed' needs GPUs.*device is cpu"):
        check(ok, "--sglang_engine.weight_sync=distributed")
    with pytest.raises(ConfigError, match=r"^\[sglang_engine\] weight_sync_senders: must be >= 1, got 0$"):
        check(ok, "--sglang_engine.weight_sync=distributed", "--sglang_engine.weight_sync_senders=0")
    with pytest.raises(ConfigError, match=r"\[sglang_engine\] python: .* lacks sglang"):
        check_sglang_python(sys.executable)  # the trainer's own venv has no SGLang


def test_launch_command_has_the_flags_the_client_relies_on(tmp_path):
    """The launched server's flags (names from SGLang's ``srt/server_args.py``); a missing interpreter is refused
    before anything starts."""
    from titan_foremoe.rollouts.engines.sglang_server import SGLangServer
    from titan_foremoe.rollouts.engines.vllm_server import EngineError, LaunchSpec

    server = SGLangServer(LaunchSpec(python="/nonexistent/python", model=str(tmp_path), max_model_len=512,
                                     extra_args=("--device", "cpu")))
    cmd = server.command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for flag in ("--enable-return-routed-experts", "--skip-tokenizer-init", "--model-path", "--context-length",
                 "--max-running-requests", "--random-seed", "--dtype"):
        assert flag in cmd, flag
    assert cmd[-2:] == ["--device", "cpu"] and server._env()["SGLANG_USE_CPU_ENGINE"] == "1"
    with pytest.raises(EngineError, match=r"\[sglang_engine\] python '/nonexistent/python' does not exist"):
        server.start()


def test_a_launch_that_fails_ends_in_one_line_with_sglangs_root_cause(tmp_path):
    """The launched server dies at start (a stand-in interpreter prints the log SGLang 0.5.23 wrote on this CPU,
    ``sgl_kernel`` without a CPU build, and exits 1): the source's launch ends in one line with the root cause,
    whose message SGLang puts on the line after ``ImportError:``."""
    from pathlib import Path

    from titan_foremoe.config.job_config import JobConfig
    from titan_foremoe.rollouts.engines.vllm_server import EngineError
    from titan_foremoe.rollouts.sources.sglang import SGLangSource

    log = Path(__file__).parent / "fixtures" / "sglang_0.5.23_cpu_no_common_ops.log"
    python = tmp_path / "engine_python"
    python.write_text(f"#!/bin/sh\ncat {log}\nexit 1\n")
    python.chmod(0o755)
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path / "dump")
    cfg.sglang_engine.python, cfg.sglang_engine.startup_timeout_s = str(python), 60
    src = SGLangSource(cfg, prompts=None, tokenizer=None, task=None, reward_fn=None, spec=None, export=None,
                       policy_logprobs=None, rank=0, dp_rank=0)
    with pytest.raises(EngineError, match=r"^SGLang server at http://127\.0\.0\.1:\d+ exited with code 1 while "
                                          r"starting: ImportError: \[sgl_kernel\] CRITICAL: Could not load any "
                                          r"common_ops library! \(engine log .*engine_weights/engine\.log\)$"):
        src._launch(str(tmp_path))


def _gloo_opener(info):
    """Trainer rank 0's side of the group on CPU: the rendezvous store's master and a gloo group (SGLang's helper
    makes the NCCL one on GPUs)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    timeout = datetime.timedelta(seconds=30)
    store = TCPStore(info["master_address"], info["master_port"], info["world_size"], True, timeout=timeout)
    pg = ProcessGroupGloo(PrefixStore(info["group_name"], store), 0, info["world_size"], timeout)

    class Group:
        store_ = store  # kept alive with the group

        def broadcast(self, tensor, src=0, stream=None):
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            pg.broadcast([tensor], opts).wait()

    return Group()


class _HFStream:
    """The policy's weights as the trainer's ``HFWeightStream`` yields them: HF names, one tensor at a time."""

    def __init__(self, folder):
        self.folder = folder

    def metadata(self):
        from titan_foremoe.rollouts.engines.vllm_weights import ParamMeta

        return [ParamMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
                for n, t in _hf(self.folder).state_dict().items()]

    def entry_metadata(self):
        return [[m] for m in self.metadata()]

    def __iter__(self):
        return iter(_hf(self.folder).state_dict().items())

    def entries(self, dst, rails=None):
        """The bucketed sync's pass (one process: every tensor is whole here)."""
        for name, t in _hf(self.folder).state_dict().items():
            yield [self.metadata()[0].__class__(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))], [t]


def test_weights_by_broadcast_reach_the_engine(engine, folders, monkeypatch):
    """``/init_weights_update_group`` then ``/update_weights_from_distributed`` while rank 0 broadcasts the named
    tensors in order over a real (gloo) group: the engine then serves folder b; a name it does not know is
    SGLang's refusal, after the whole stream was drawn."""
    from titan_foremoe.rollouts.engines import sglang_weights
    from titan_foremoe.rollouts.engines.vllm_server import EngineError, free_port
    from titan_foremoe.rollouts.engines.vllm_weights import ParamMeta

    standin, client = engine
    sender = sglang_weights.SGLangWeightSender(lambda path, body: client.post(path, body, retry=False),
                                               master_address="127.0.0.1", master_port=free_port(),
                                               engine_workers=1, backend="gloo", open_group=_gloo_opener)
    sender.init()
    stream = _HFStream(folders[1])
    sender.send(stream.metadata(), iter(stream))
    lp, routes = client.prompt_logprobs(PROMPTS[1])
    ref_lp, ref_top = _reference(folders[1], PROMPTS[1])
    np.testing.assert_allclose(lp, ref_lp, atol=1e-5)
    assert (routes[:-1] == ref_top).all()
    init, update = standin.calls[0][1], standin.calls[1][1]
    assert [c[0] for c in standin.calls[:2]] == ["/init_weights_update_group", "/update_weights_from_distributed"]
    assert init == {"master_address": "127.0.0.1", "master_port": sender.init_info["master_port"], "rank_offset": 1,
                    "world_size": 2, "group_name": sglang_weights.GROUP, "backend": "gloo"}
    assert update["names"] == [m.name for m in stream.metadata()] and update["flush_cache"] is True
    drawn = []
    meta = [ParamMeta("model.not_a_weight", "float32", (2,))]
    with pytest.raises(EngineError, match=r"SGLang at http://127\.0\.0\.1:\d+/update_weights_from_distributed: "
                                          r"HTTP 400: .*unknown .*model\.not_a_weight"):
        sender.send(meta, (drawn.append(1) or p for p in [("model.not_a_weight", torch.zeros(2))]))
    assert drawn == [1] and sender.updates == 1


def test_sglang_source_streams_weights_every_step(engine, folders, tmp_path, monkeypatch):
    """``weight_sync = "distributed"`` with a user-run engine: every step (the first too) is one broadcast update,
    no folder is written, and the probe then finds the engine serving the step's policy."""
    from titan_foremoe.rollouts.engines import sglang_weights

    standin, client = engine
    monkeypatch.setattr(sglang_weights, "BACKEND", "gloo")
    monkeypatch.setattr(sglang_weights, "_sglang_group", _gloo_opener)
    policy = {"folder": folders[0]}
    src = _source(tmp_path, client.url, None, lambda tokens_T, routes_RXK: _reference(policy["folder"], tokens_T)[0])
    src.eng.weight_sync = "distributed"
    src.weights = lambda: _HFStream(policy["folder"])
    for step, folder in enumerate([folders[1], folders[0]]):
        policy["folder"] = folder
        src.next_batch(step)
        assert src.timings["rollout/probe_gap"] <= 1e-5
    paths = [path for path, _ in standin.calls]
    assert paths.count("/init_weights_update_group") == 1 and paths.count("/update_weights_from_distributed") == 2
    assert "/update_weights_from_disk" not in paths and not (tmp_path / "engine_weights").exists()


def test_a_source_on_another_node_hosts_its_group_on_its_own_address(monkeypatch):
    """Rank 0's node: ``nccl_address`` as configured; another node: this host's address towards the engine."""
    from titan_foremoe.rollouts.sources.vllm import source_address

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert source_address(1, "10.1.2.3", "http://127.0.0.1:30000") == "10.1.2.3"
    assert source_address(2, "10.1.2.3", "http://127.0.0.1:30000") == "127.0.0.1"
