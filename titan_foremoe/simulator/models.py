"""Model shapes the simulator knows, and their per-token FLOPs outside the routed experts.

Dims follow the public configs (Hugging Face ``config.json`` of openai/gpt-oss-20b,
Qwen/Qwen3-30B-A3B, deepseek-ai/DeepSeek-V3). An expert is a SwiGLU of three
``dim x moe_hidden`` matrices (gpt-oss's biases ignored). Attention FLOPs count the
projections plus the causal score/value products (2 * 2 * head dims per query-key pair).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    dim: int
    moe_hidden: int
    num_experts: int
    top_k: int
    moe_layers: int
    dense_layers: int = 0  # leading dense-MLP layers (DeepSeek-V3: 3)
    dense_hidden: int = 0
    shared_hidden: int = 0  # shared expert(s) hidden size, run on every token
    vocab: int = 0
    # GQA attention: q heads x head_dim, kv heads x head_dim
    n_heads: int = 1
    n_kv_heads: int = 1
    head_dim: int = 64
    # MLA (DeepSeek): low-rank q / kv, per-head nope + rope query dims, value dim
    q_lora: int = 0
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0

    @property
    def num_layers(self) -> int:
        return self.moe_layers + self.dense_layers

    @property
    def expert_params(self) -> int:
        return 3 * self.dim * self.moe_hidden

    def expert_flops_per_token(self) -> float:
        """Forward FLOPs of one token through one expert."""
        return 2.0 * self.expert_params

    def attn_linear_flops(self) -> float:
        """Forward FLOPs per token of one layer's attention projections."""
        d = self.dim
        if self.kv_lora:
            qk = self.qk_nope + self.qk_rope
            q = d * self.q_lora + self.q_lora * self.n_heads * qk
            kv = d * (self.kv_lora + self.qk_rope) + self.kv_lora * self.n_heads * (self.qk_nope + self.v_head)
            return 2.0 * (q + kv + self.n_heads * self.v_head * d)
        qd, kvd = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return 2.0 * (d * (qd + 2 * kvd) + qd * d)

    def attn_pair_flops(self) -> float:
        """Forward FLOPs per causal query-key pair of one layer (scores + weighted values)."""
        if self.kv_lora:
            return 2.0 * self.n_heads * (self.qk_nope + self.qk_rope + self.v_head)
        return 4.0 * self.n_heads * self.head_dim

    def layer_dense_flops(self, moe: bool) -> float:
        """Forward FLOPs per token of one layer outside attention-pairs and routed experts."""
        f = self.attn_linear_flops()
        if moe:
            f += 2.0 * self.dim * self.num_experts + 6.0 * self.dim * self.shared_hidden  # router, shared expert
        else:
            f += 6.0 * self.dim * self.dense_hidden
        return f

    def head_flops(self) -> float:
        """Forward FLOPs per token of the output head."""
        return 2.0 * self.dim * self.vocab

    def dense_params(self) -> int:
        """Parameters outside the routed experts (attention, dense / shared MLPs, embeddings, head)."""
        attn = self.attn_linear_flops() / 2
        mlp = self.moe_layers * (3 * self.dim * self.shared_hidden + self.dim * self.num_experts)
        mlp += self.dense_layers * 3 * self.dim * self.dense_hidden
        return int(self.num_layers * attn + mlp + 2 * self.vocab * self.dim)


MODELS = {
    "gpt_oss_20b": ModelSpec("gpt_oss_20b", dim=2880, moe_hidden=2880, num_experts=32, top_k=4, moe_layers=24,
                             vocab=201_088, n_heads=64, n_kv_heads=8, head_dim=64),
    "qwen3_30b_a3b": ModelSpec("qwen3_30b_a3b", dim=2048, moe_hidden=768, num_experts=128, top_k=8, moe_layers=48,
                               vocab=151_936, n_heads=32, n_kv_heads=4, head_dim=128),
    "deepseek_v3": ModelSpec("deepseek_v3", dim=7168, moe_hidden=2048, num_experts=256, top_k=8, moe_layers=58,
                             dense_layers=3, dense_hidden=18_432, shared_hidden=2048, vocab=129_280, n_heads=128,
                             q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128),
}


def get_model(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    return MODELS[name]
