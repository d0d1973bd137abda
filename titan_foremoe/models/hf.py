"""Hugging Face Qwen3-MoE folders: model shape from ``config.json``, shard checks, the state-dict adapter.

The parameter names of our model (``build.py``) are torchtitan's Qwen3 names
(``layers.{i}.attention.qkv_linear.wq.weight``, ``layers.{i}.moe.router.gate.weight``,
``layers.{i}.moe.routed_experts.inner_experts.w1_EFD`` ...): ``ReplayRouter``,
``MaskedMoE`` and ``DtypeGroupedExperts`` subclass torchtitan's modules and add
no parameters, so torchtitan's ``Qwen3StateDictAdapter`` maps them to HF's
``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` ... unchanged. With it,
torchtitan's checkpointer reads HF safetensors through DCP's
``HuggingFaceStorageReader``: every rank asks only for its own DTensor shards
(its experts, its FSDP rows), never the whole model.

Qwen3-MoE specifics carried over: router softmax over all experts, then top-k,
renormalized when ``norm_topk_prob`` (``route_norm``); QK-norm; RoPE theta;
RMSNorm eps. Not supported (refused with a clear error): tied embeddings, dense
(``mlp_only_layers`` / ``decoder_sparse_step`` != 1) layers, attention bias,
sliding windows, RoPE scaling.
"""

from __future__ import annotations

import json
import os
import struct

from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from .flavors import MoEModelArgs

# Files copied next to an HF export so it loads in transformers as a complete folder.
HF_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
)


class HFCheckpointError(ValueError):
    """An HF folder that cannot be used: missing/truncated file, unsupported architecture."""


def read_hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise HFCheckpointError(f"{path} does not exist")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{path}: invalid JSON ({e})") from None


def _rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default"):
        raise HFCheckpointError(f"config.json: RoPE scaling {kind!r} is not supported (only the default RoPE)")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10_000.0)))


def model_args_from_hf(folder: str) -> MoEModelArgs:
    """``MoEModelArgs`` of a Qwen3-MoE ``config.json``; refuses what our model cannot represent."""
    cfg = read_hf_config(folder)
    where = os.path.join(folder, "config.json")
    if cfg.get("model_type") != "qwen3_moe":
        raise HFCheckpointError(f"{where}: model_type {cfg.get('model_type')!r} is not 'qwen3_moe'")
    n_layers = int(cfg["num_hidden_layers"])
    dense = [i for i in range(n_layers)
             if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % int(cfg.get("decoder_sparse_step", 1)) != 0]
    problems = [
        (bool(cfg.get("tie_word_embeddings", False)), "tie_word_embeddings = true"),
        (bool(dense), f"dense (non-MoE) layers {dense[:8]} (mlp_only_layers / decoder_sparse_step)"),
        (bool(cfg.get("attention_bias", False)), "attention_bias = true"),
        (bool(cfg.get("use_sliding_window", False)), "use_sliding_window = true"),
        (cfg.get("hidden_act", "silu") != "silu", f"hidden_act {cfg.get('hidden_act')!r}"),
    ]
    for bad, what in problems:
        if bad:
            raise HFCheckpointError(f"{where}: {what} is not supported")
    num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)))
    dim = int(cfg["hidden_size"])
    n_heads = int(cfg["num_attention_heads"])
    return MoEModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads", n_heads)),
        head_dim=int(cfg.get("head_dim") or dim // n_heads),
        vocab_size=int(cfg["vocab_size"]),
        moe_hidden_dim=int(cfg["moe_intermediate_size"]),
        num_experts=num_experts,
        top_k=int(cfg["num_experts_per_tok"]),
        max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
        rope_theta=_rope_theta(cfg),
        route_norm=bool(cfg.get("norm_topk_prob", False)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        fuse_qkv=False,  # separate Q/K/V: each rank reads only its FSDP rows of them (see MoEModelArgs)
    )


def safetensors_files(folder: str) -> list[str]:
    """The weight files of an HF folder (from ``model.safetensors.index.json`` when there is one)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")) if os.path.isdir(folder) else []
    if not files:
        raise HFCheckpointError(f"{folder}: no *.safetensors weight files")
    return files


def check_safetensors(folder: str) -> dict[str, tuple[list[int], str]]:
    """Every weight file exists and is as long as its header says; returns ``name -> (shape, file)``.

    Reads only the headers (a few KB per file), so it is cheap enough to run
    before any worker starts, even for a 60 GB checkpoint.
    """
    tensors: dict[str, tuple[list[int], str]] = {}
    for name in safetensors_files(folder):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise HFCheckpointError(f"weight file {path} is missing")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HFCheckpointError(f"weight file {path} is truncated ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            raw = f.read(n)
        if len(raw) < n:
            raise HFCheckpointError(f"weight file {path} is truncated (header of {n} bytes, file {size})")
        try:
            header = json.loads(raw)
        except json.JSONDecodeError:
            raise HFCheckpointError(f"weight file {path} has a corrupt header") from None
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise HFCheckpointError(f"weight file {path} is truncated: {size} bytes, its header needs {8 + n + end}")
        for k, v in header.items():
            if k != "__metadata__":
                tensors[k] = (v["shape"], name)
    return tensors


def expected_hf_tensors(args: MoEModelArgs) -> dict[str, list[int]]:
    """Every tensor name a Qwen3-MoE checkpoint of this shape holds, with its shape (issue 23: a missing
    expert crashed in the workers). 18.9k names at Qwen3-30B-A3B (48 layers x 128 experts x 3 + 9 per layer)."""
    D, F, E, H = args.dim, args.moe_hidden_dim, args.num_experts, args.head_dim
    expect = {"model.embed_tokens.weight": [args.vocab_size, D], "lm_head.weight": [args.vocab_size, D],
              "model.norm.weight": [D]}
    for i in range(args.n_layers):
        p = f"model.layers.{i}"
        expect.update({
            f"{p}.self_attn.q_proj.weight": [args.n_heads * H, D],
            f"{p}.self_attn.k_proj.weight": [args.n_kv_heads * H, D],
            f"{p}.self_attn.v_proj.weight": [args.n_kv_heads * H, D],
            f"{p}.self_attn.o_proj.weight": [D, args.n_heads * H],
            f"{p}.self_attn.q_norm.weight": [H],
            f"{p}.self_attn.k_norm.weight": [H],
            f"{p}.input_layernorm.weight": [D],
            f"{p}.post_attention_layernorm.weight": [D],
            f"{p}.mlp.gate.weight": [E, D],
        })
        for e in range(E):
            q = f"{p}.mlp.experts.{e}"
            expect.update({f"{q}.gate_proj.weight": [F, D], f"{q}.up_proj.weight": [F, D],
                           f"{q}.down_proj.weight": [D, F]})
    return expect


def check_tensor_shapes(folder: str, args: MoEModelArgs) -> None:
    """The checkpoint holds every tensor this model loads, with the shape ``config.json`` promises
    (names and shapes from the safetensors headers only)."""
    tensors = check_safetensors(folder)
    expect = expected_hf_tensors(args)
    for key, shape in expect.items():
        if key not in tensors:
            raise HFCheckpointError(f"{folder}: tensor {key} is missing from the weight files")
        if list(tensors[key][0]) != shape:
            raise HFCheckpointError(
                f"{folder}/{tensors[key][1]}: {key} has shape {tensors[key][0]}, config.json implies {shape}"
            )


class HFAdapter(Qwen3StateDictAdapter):
    """torchtitan's Qwen3 adapter for our model (same parameter names; see the module docstring)."""
