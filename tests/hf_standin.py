"""A stand-in for the downloaded Qwen3-30B-A3B Hugging Face folder (no model hub here).

``config.json`` holds the real model's values (Qwen/Qwen3-30B-A3B, transformers 4.51.0; they differ from
transformers' ``Qwen3MoeConfig`` defaults, a 24-layer "15B-A2B" style model with ``norm_topk_prob = False``,
``max_position_embeddings = 32768`` and no ``head_dim``: 2048 / 32 = 64). The tokenizer is the tiny word-level
one of ``data/tiny_hf.py`` (ChatML template). The weights are ``model.safetensors`` with a real header naming
every tensor the model loads in bf16 (18,867 tensors) and its data left as a sparse hole: the file is as long as
the header says (61 GB) and takes a few MB of disk, so the config check's header and length checks pass, and
nothing reads the values (neither the config check nor the dry run loads weights).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def make_qwen3_30b_a3b_standin(out: Path) -> Path:
    """Write the stand-in folder to ``out``; returns ``out``."""
    from titan_foremoe.data.tiny_hf import build_tokenizer, read_texts
    from titan_foremoe.models.hf import expected_hf_tensors, model_args_from_hf

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643],
                                                            "pad_token_id": 151643}))
    build_tokenizer(read_texts(str(ROOT / "examples/arithmetic_word_problems.jsonl"))).save_pretrained(str(out))
    header, offset = {}, 0
    for name, shape in expected_hf_tensors(model_args_from_hf(str(out))).items():
        n = 2
        for s in shape:
            n *= s
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # a hole, not written bytes
    return out
