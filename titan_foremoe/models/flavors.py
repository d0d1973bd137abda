"""Named model sizes.

``debug_tiny`` trains on two CPU cores in seconds per step; the other two carry
the real shapes (layers, experts, top-k, dims) that the planner and the
benchmarks need. ``gpt_oss_20b`` is built as a Qwen3-style decoder with
gpt-oss's MoE shape (24 layers, 32 experts, top-4); its attention sinks,
sliding windows and clamped SwiGLU are not modelled, which does not change
where tokens go or how large an expert is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, kw_only=True)
class MoEModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    moe_hidden_dim: int
    num_experts: int
    top_k: int
    shared_expert_hidden_dim: int = 0  # 0: no shared expert
    max_seq_len: int = 4096
    rope_theta: float = 1_000_000.0
    score_func: str = "softmax"
    route_norm: bool = True
    """Renormalize the top-k gate probabilities to sum to 1 (HF ``norm_topk_prob``)."""
    norm_eps: float = 1e-6
    fuse_qkv: bool = True
    """One fused QKV weight. torchtitan splits it on save and merges it on load through a Replicate
    gather, so with HF load/save every rank would read the whole Q/K/V weights: HF models use three."""

    def expert_param_bytes(self, bytes_per_param: int = 2) -> int:
        """Bytes of one routed expert's weights (w1, w2, w3)."""
        return 3 * self.dim * self.moe_hidden_dim * bytes_per_param


FLAVORS: dict[str, MoEModelArgs] = {
    "debug_tiny": MoEModelArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=64,
        moe_hidden_dim=64,
        num_experts=8,
        top_k=2,
        shared_expert_hidden_dim=0,
        max_seq_len=256,
        rope_theta=10_000.0,
    ),
    "qwen3_30b_a3b": MoEModelArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        vocab_size=151_936,
        moe_hidden_dim=768,
        num_experts=128,
        top_k=8,
        max_seq_len=40_960,
    ),
    "gpt_oss_20b": MoEModelArgs(
        dim=2880,
        n_layers=24,
        n_heads=64,
        n_kv_heads=8,
        head_dim=64,
        vocab_size=201_088,
        moe_hidden_dim=2880,
        num_experts=32,
        top_k=4,
        max_seq_len=131_072,
        rope_theta=150_000.0,
    ),
}


def get_flavor(name: str, **overrides) -> MoEModelArgs:
    """The named flavor with any non-None fields replaced."""
    if name not in FLAVORS:
        raise ValueError(f"unknown model flavor {name!r}; known: {sorted(FLAVORS)}")
    return replace(FLAVORS[name], **{k: v for k, v in overrides.items() if v is not None})
