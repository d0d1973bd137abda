"""The 64-GPU config passes the config check, and the dry run builds one rank's share at a small scale.

The dry run (``scripts/dry_run.py``) is rank 3 of 16 on torchtitan's fake backend, with the
Qwen3-30B-A3B job's parallelism shrunk onto ``debug_tiny`` shapes: EP = 8 inside a node, FSDP
across (efsdp = 2). Checked against what we did not measure: the weight shard equals the
unparallelised model's parameters divided by their shard counts (experts by EP x efsdp, the
rest by dp_shard), AdamW holds two copies of it, banks are bounded by two banks of C slots per
layer, and extrapolating from 1 or from 2 built layers gives the same totals.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "train_configs/qwen3_30b_a3b_grpo.toml"
SMALL = ["--model.flavor=debug_tiny", "--model.n_layers=4", "--training.seq_len=64", "--rl.max_new_tokens=32",
         "--training.max_tokens_per_micro_step=128",  # the config's budget is its local_batch_size x seq_len too
         "--model.expert_dtype=float32", "--training.mixed_precision_param=float32"]

RUN = """
import json, sys
sys.path.insert(0, "scripts")
from dry_run import dry_run
small = json.loads(sys.argv[1])
out = [dry_run("{config}", 16, 3, n, small, ranks_per_node=8) for n in (1, 2)]
import dry_run as d
codes = [d.main(["--config", "{config}", "--world-size", "16", "--rank", "3", "--n-layers", "1", *small, *budget])
         for budget in ([], ["--budget-gib", "1e-6"])]
print("RESULT" + json.dumps({{"runs": out, "exit_codes": codes}}))
"""


HF_CONFIGS = ("train_configs/qwen3_30b_a3b_hf_grpo.toml", "train_configs/qwen3_30b_a3b_hf_vllm.toml")

RUN_HF = """
import json, sys
sys.path.insert(0, "scripts")
from dry_run import dry_run
hf = sys.argv[1]
out = [dry_run(config, 64, 0, 1, [f"--model.hf_assets_path={{hf}}"], ranks_per_node=8) for config in {configs}]
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    """The Qwen3-30B-A3B HF folder's stand-in: the real config.json, a tiny tokenizer, header-only weights."""
    from hf_standin import make_qwen3_30b_a3b_standin

    return make_qwen3_30b_a3b_standin(tmp_path_factory.mktemp("qwen3_30b_a3b"))


def test_hf_64gpu_configs_check(standin, capsys):
    """The realistic 64-GPU configs pass the config check (the prompt file read with the folder's tokenizer and chat
    template, the weight files' headers against config.json); without the folder, one line names the key."""
    from titan_foremoe.config.check import main

    for config in HF_CONFIGS:
        assert main([str(ROOT / config), "--world-size", "64", f"--model.hf_assets_path={standin}"]) == 0
        assert ("world=64 dp_shard=64 ep=8 experts=128 top_k=8 micro_steps=by a 9216-token budget per rank rows=400"
                in capsys.readouterr().out)
    assert main([str(ROOT / HF_CONFIGS[0]), "--world-size", "64", f"--model.hf_assets_path={standin}/absent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: [model] hf_assets_path: ") and err.count("\n") == 1


def test_hf_64gpu_configs_dry_run(standin):
    """Rank 0 of 64 on the real shape (one layer built, 48 extrapolated): compiled, AC full; the embedded rollout
    holds the KV cache of its 32 rows x seq_len, the vLLM one none (the engine's GPUs hold it) but the weight sync's
    buckets (its peak from sync_cost); both fit the 64 GiB target."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUN_HF.format(configs=repr(HF_CONFIGS)), str(standin)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    embedded, vllm = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
    for r in (embedded, vllm):
        assert (r["world_size"], r["ep"], r["efsdp"], r["layers_built"], r["layers_full"]) == (64, 8, 8, 1, 48)
        assert r["peaks"]["per_rank"] <= 64 * 2**30
    kv = next(v for k, v in embedded["rollout_peak"].items() if k.startswith("KV cache"))
    assert kv == 48 * 32 * 4608 * 4 * 128 * 2 * 2  # layers x rows x seq_len x KV heads x head_dim x (K, V) x bf16
    assert not any(k.startswith("KV cache") for k in vllm["rollout_peak"])
    sync = vllm["rollout_peak"]["weight sync (nccl): peak extra, busiest rank"]  # sync_cost: rank 0's buckets
    assert 151936 * 2048 * 2 < sync < 3 * (512 << 20) + 151936 * 2048 * 2
    assert embedded["peaks"]["rollout"] > embedded["peaks"]["training"] > vllm["peaks"]["rollout"]


COLOCATED = "train_configs/qwen3_30b_a3b_hf_vllm_colocated.toml"


def test_colocated_64gpu_config_checks_and_dry_runs_within_64_gib(standin, monkeypatch, capsys):
    """The colocated config (an engine on every node, ipc, sleep level 1) passes the config check as on its GPUs
    (on this CPU machine ipc and sleep_level are refused in one line), and its dry run states each phase's peak
    per rank (rollout with the engine awake, weight sync, training with it asleep) and the host memory of sleep
    level 1, all within 64 GiB."""
    from titan_foremoe.config import validate as v
    from titan_foremoe.config.check import main

    keys = [f"--model.hf_assets_path={standin}", f"--rollout_engine.python={sys.executable}"]
    assert main([str(ROOT / COLOCATED), "--world-size", "64", *keys]) == 2
    assert "[rollout_engine] weight_sync: 'ipc' needs GPUs" in capsys.readouterr().err
    monkeypatch.setattr(v, "_job_device_type", lambda: "cuda")
    assert main([str(ROOT / COLOCATED), "--world-size", "64", *keys]) == 0
    capsys.readouterr()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "scripts/dry_run.py", "--config", COLOCATED, "--world-size", "64",
                           "--rank", "0", "--n-layers", "1", *keys], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    out = proc.stdout
    line = next(l for l in out.splitlines() if l.startswith("colocated engine per rank: "))
    rollout, sync, training = (float(x) for x in re.findall(r"([\d.]+) GiB", line)[:3])
    assert sync < rollout and training < rollout <= 64, line  # the engine's KV cache only while it generates
    assert re.search(r"\| engine awake: weight share \(the model / 8 GPUs\) \| 7\.1\d\d GiB \|", out)
    assert re.search(r"\| engine asleep \(sleep_level 1\): CUDA context \+ allocator reserve \| 1\.500 GiB \|", out)
    host = re.search(r"sleep_level 1 host memory per node: ([\d.]+) GiB pinned", out)
    assert host and 56 < float(host[1]) < 58, out[-2000:]  # one Qwen3-30B-A3B in bf16 (61 GB) per node
    peak = re.search(r"per-rank peak: .* = ([\d.]+) GiB .* within the 64 GiB target", out)
    assert peak and float(peak[1]) <= 64


def test_config_check_world_64():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, "-m", "titan_foremoe.config.check", CONFIG, "--world-size", "64"],
                        cwd=ROOT, env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "world=64 dp_shard=64 ep=8 experts=128 top_k=8" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "titan_foremoe.config.check", CONFIG, "--world-size", "60"],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "expert_parallel_degree" in bad.stderr


@pytest.fixture(scope="module")
def result():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUN.format(config=CONFIG), json.dumps(SMALL)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.fixture(scope="module")
def runs(result):
    return result["runs"]


def _unparallelised(n_layers: int) -> tuple[int, int]:
    """(routed-expert, other) parameter counts of the unparallelised debug_tiny model."""
    from titan_foremoe.config import load_config
    from titan_foremoe.config.validate import model_args
    from titan_foremoe.distributed.parallelize import build_model

    cfg = load_config(CONFIG, [*SMALL, f"--model.n_layers={n_layers}"])
    with torch.device("meta"):
        model = build_model(cfg, model_args(cfg), None, torch.device("meta"))
    experts = sum(p.numel() for n, p in model.named_parameters() if "routed_experts" in n)
    return experts, sum(p.numel() for n, p in model.named_parameters() if "routed_experts" not in n)


def _expected_weight_bytes(n_layers: int, dp_shard: int, ep: int) -> float:
    """Unparallelised debug_tiny parameters, divided by their shard counts (fp32)."""
    experts, rest = _unparallelised(n_layers)
    return 4 * (experts / ep + rest / dp_shard)  # experts: EP x efsdp = dp_shard shards as well


def test_dry_run_small(runs):
    one, two = runs
    for r in (one, two):
        assert (r["world_size"], r["rank"], r["ep"], r["efsdp"], r["dp_shard"]) == (16, 3, 8, 2, 16)
        assert r["layers_full"] == 4
    assert (one["layers_built"], two["layers_built"]) == (1, 2)
    for r in (one, two):
        w = r["table"]["weights (fp32 master shard)"]["measured_bytes"]
        assert w == pytest.approx(_expected_weight_bytes(r["layers_built"], 16, 16), rel=0.02)
        opt = r["table"]["optimizer state (AdamW)"]["measured_bytes"]
        assert opt == pytest.approx(2 * w, rel=1e-6)
        banks = r["table"]["replica banks"]["measured_bytes"]
        expert_bytes = 3 * 64 * 64 * 4
        assert 0 < banks <= 2 * (8 // 8 + 2) * expert_bytes * r["layers_built"] + 1024  # + the engine's topology
        assert r["table"]["placement tables (micro-step 0, all layers)"]["measured_bytes"] > 0
        assert r["plan_ms_per_micro_step"] > 0
    for name in one["table"]:  # the same extrapolation from one and from two built layers
        if name.startswith("prefetch"):  # each layer's moves depend on its plan
            continue
        a, b = one["table"][name]["bytes_at_4_layers"], two["table"][name]["bytes_at_4_layers"]
        # tables depend on each layer's plan (replicas, moves), so they extrapolate only roughly
        assert a == pytest.approx(b, rel=0.1 if name.startswith("placement tables") else 0.02), name


def test_dry_run_held_for_backward(runs):
    """Activations without AC at least the grouped GEMMs' inputs (k rows of D and 3 of F per token: a bound we did
    not measure), with full AC the blocks' inputs plus one block recomputed; the slot-weight copies (C slots x 3 matrices per layer) held before, none after."""
    D = F = 64
    k, vocab, tokens = 2, 64, 2 * 64  # debug_tiny (top-2), local_batch_size 2 x seq_len 64
    for r in runs:
        t = r["table"]
        assert r["tokens_per_micro_step"] == tokens
        act = t[f"activations held for backward ({tokens} tokens, AC full; before: no AC)"]
        no_ac, full_ac = act["before_bytes_at_4_layers"], act["bytes_at_4_layers"]
        assert no_ac >= 4 * tokens * k * (D + 3 * F) * 4
        # full AC (the 64-GPU config): every block keeps its fp32 input, one block's activations are recomputed
        assert full_ac == pytest.approx(4 * tokens * D * 4 + no_ac / 4, rel=1e-9)
        logits = t["logits held for backward ([tokens, vocab])"]  # the fused log-prob head keeps none
        assert logits["bytes_at_4_layers"] == 0 and logits["before_bytes_at_4_layers"] == tokens * vocab * 4
        copies = t["slot-weight copies held for backward"]
        assert copies["bytes_at_4_layers"] == 0
        assert copies["before_bytes_at_4_layers"] == (8 // 8 + 1) * 3 * D * F * 4 * 4  # C = 1 owned + 1 spare (the config's)
        # prefetch buffers: send rows only after (received rows land in their bank slot), send + receive before
        pf = t["prefetch send/recv buffers (next micro-step)"]
        assert pf["bytes_at_4_layers"] <= pf["before_bytes_at_4_layers"]
        assert r["total_before_bytes_at_4_layers"] - r["total_bytes_at_4_layers"] == pytest.approx(
            copies["before_bytes_at_4_layers"] + pf["before_bytes_at_4_layers"] - pf["bytes_at_4_layers"]
            + no_ac - full_ac + logits["before_bytes_at_4_layers"], rel=1e-9)


def test_dry_run_rollout_training_and_nccl(result):
    """The rollout peak counts the KV cache at the rollout's rows and full length and the weights unsharded for
    decode (every dense weight, this rank's EP-local experts); NCCL's buffers follow its defaults per
    communicator; the per-rank peak is the larger stage plus NCCL, and exceeding ``--budget-gib`` exits 1."""
    MiB = 2**20
    rows, T, layers = 512 * 4 // 16, 64, 4  # global batch x updates_per_rollout / DP; seq_len; debug_tiny depth
    experts, rest = _unparallelised(layers)
    for r in result["runs"]:
        roll = r["rollout_peak"]
        kv = next(v for k, v in roll.items() if k.startswith("KV cache"))
        assert kv == layers * rows * T * 2 * 16 * 2 * 4  # 2 KV heads x head_dim 16, keys and values, fp32
        assert roll["weights unsharded for decode (compute dtype)"] == pytest.approx(4 * (experts / 8 + rest))
        assert roll["gradients (fp32 shard, kept from the last update)"] == r["table"]["gradients (fp32 shard)"][
            "bytes_at_4_layers"]
        comms = {c["name"]: c for c in r["nccl_communicators"]}
        assert {n: (c["n_ranks"], c["n_nodes"]) for n, c in comms.items()} == {
            "default (world) = batch = loss = fsdp": (16, 2), "efsdp": (2, 2), "ep": (8, 1),
            "ep twin (prefetch)": (8, 1), "ep twin (gradient return)": (8, 1)}
        conn = 4 * MiB + 4800 * 1024 + 512 * 1024  # Simple (NCCL_BUFFSIZE) + LL128 + LL, per connection
        assert comms["efsdp"]["collective"] == 16 * 4 * conn and comms["efsdp"]["all_to_all"] == 0
        assert comms["ep"]["collective"] == 16 * 2 * conn  # one node: ring only
        assert comms["ep"]["all_to_all"] == comms["ep twin (prefetch)"]["all_to_all"] == 7 * 16 * 2 * 4 * MiB
        assert comms["ep twin (gradient return)"]["collective"] == 0
        pk = r["peaks"]
        assert pk["rollout"] == pytest.approx(sum(roll.values())) and pk["nccl"] == sum(
            c["bytes"] for c in comms.values())
        assert pk["per_rank"] == max(pk["rollout"], pk["training"], pk["recompute"]) + pk["nccl"]
        assert pk["training"] >= r["total_bytes_at_4_layers"]
        # the recompute (the config's recompute_merge k micro-steps as one forward): one block's forward at k x the
        # micro-step's tokens, at most what it keeps for a backward (k x the table's no-AC figure per layer); below
        # the update's backward under full AC
        from titan_foremoe.config import load_config

        merge = load_config(CONFIG).rl.recompute_merge
        rec = r["recompute_peak"]
        block = next(v for k, v in rec.items() if k.startswith(f"one block's forward at recompute_merge {merge} x 128 "))
        no_ac = r["table"]["activations held for backward (128 tokens, AC full; before: no AC)"]
        assert block == pytest.approx(merge * no_ac["before_bytes_at_4_layers"] / layers, rel=1e-9)
        assert pk["recompute"] == pytest.approx(sum(rec.values())) and pk["recompute"] < pk["training"]
    assert result["exit_codes"] == [0, 1]


def test_kv_cache_bytes_is_what_generate_allocates(monkeypatch):
    """The dry run's KV cache row is the caches the rollout really allocates: every layer's keys and values of
    [rows, longest prompt + max_new_tokens, KV heads, head_dim], at the first token (debug model, one process)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from dry_run import kv_cache_bytes

    from titan_foremoe.config import load_config
    from titan_foremoe.config.validate import model_args
    from titan_foremoe.distributed.parallelize import build_model
    from titan_foremoe.rollouts import generate as gen

    cfg = load_config(None, ["--model.expert_dtype=float32"])
    args = model_args(cfg, vocab_size=64)
    torch.manual_seed(0)
    model = build_model(cfg, args, None, torch.device("cpu"))
    allocated = []
    append = gen._LazyKVCache.append

    def recording_append(self, k_BLNH, v_BLNH):
        fresh = self.k_BTNH is None
        out = append(self, k_BLNH, v_BLNH)
        if fresh:
            allocated.append(self.k_BTNH.nbytes + self.v_BTNH.nbytes)
        return out

    monkeypatch.setattr(gen._LazyKVCache, "append", recording_append)
    prompts, max_new = [[1, 5, 6], [1, 2, 3, 4, 5], [1, 7]], 6
    gen.generate(model, prompts, gen.GenerationConfig(max_new_tokens=max_new), eos_id=2, pad_id=0,
                 num_experts=args.num_experts, generator=torch.Generator().manual_seed(0))
    assert len(allocated) == args.n_layers
    assert sum(allocated) == kv_cache_bytes(args.n_layers, len(prompts), 5 + max_new, args.n_kv_heads,
                                            args.head_dim, 4)
