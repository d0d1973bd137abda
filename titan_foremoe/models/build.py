"""Assemble a torchtitan ``Qwen3Model.Config`` from ``MoEModelArgs``.

Everything is torchtitan's own (GQA attention with QK-norm, RoPE, RMSNorm,
all-to-all token dispatcher, Qwen3 block and decoder) except the router
(``ReplayRouter``), the MoE's token mask (``MaskedMoE``), the experts' compute
dtype and slot weights (``DtypeGroupedExperts``), the token dispatcher that
follows a placement plan (``PlannedTokenDispatcher``, torchtitan's all-to-all
dispatcher when no plan is active) and the KV cache of the inner attention
(``CachedSDPA``, torchtitan's SDPA otherwise). SDPA is used because
FlexAttention has no CPU backward.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch.nn as nn
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.moe import RoutedExperts
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

from .flavors import MoEModelArgs
from .attention import CachedSDPA
from .dispatch import PlannedTokenDispatcher
from .moe import DtypeGroupedExperts, MaskedMoE, ReplayRouter

_NORMAL = partial(nn.init.normal_, std=0.02)
_LINEAR_INIT = {"weight": _NORMAL, "bias": nn.init.zeros_}


def _norm(dim: int, eps: float = 1e-6) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=dim, eps=eps, param_init={"weight": nn.init.ones_})


def build_model_config(
    args: MoEModelArgs,
    *,
    expert_dtype: Literal["bfloat16", "float32"] = "bfloat16",
    load_balance_coeff: float | None = None,
) -> Qwen3Model.Config:
    """A Qwen3-MoE decoder: every block is MoE; optional shared expert."""
    residual_init = partial(nn.init.normal_, std=0.02 / (2 * args.n_layers) ** 0.5)
    layers = []
    for _ in range(args.n_layers):
        shared = None
        if args.shared_expert_hidden_dim > 0:
            shared = make_ffn_config(
                dim=args.dim,
                hidden_dim=args.shared_expert_hidden_dim,
                w1_param_init=_LINEAR_INIT,
                w2w3_param_init=_LINEAR_INIT,
            )
        moe = MaskedMoE.Config(
            num_experts=args.num_experts,
            load_balance_coeff=load_balance_coeff,
            shared_experts=shared,
            router=ReplayRouter.Config(
                num_experts=args.num_experts,
                gate=Linear.Config(
                    in_features=args.dim, out_features=args.num_experts, param_init=_LINEAR_INIT
                ),
                top_k=args.top_k,
                score_func=args.score_func,
                route_norm=args.route_norm,
            ),
            routed_experts=RoutedExperts.Config(
                inner_experts=DtypeGroupedExperts.Config(
                    dim=args.dim,
                    hidden_dim=args.moe_hidden_dim,
                    num_experts=args.num_experts,
                    compute_dtype=expert_dtype,
                    param_init={"w1_EFD": _NORMAL, "w3_EFD": _NORMAL, "w2_EDF": residual_init},
                ),
                token_dispatcher=PlannedTokenDispatcher.Config(
                    num_experts=args.num_experts, top_k=args.top_k
                ),
            ),
        )
        layers.append(
            Qwen3TransformerBlock.Config(
                attention_norm=_norm(args.dim, args.norm_eps),
                ffn_norm=_norm(args.dim, args.norm_eps),
                attention=make_gqa_config(
                    dim=args.dim,
                    n_heads=args.n_heads,
                    n_kv_heads=args.n_kv_heads,
                    head_dim=args.head_dim,
                    wqkv_param_init=_LINEAR_INIT,
                    wo_param_init={"weight": residual_init, "bias": nn.init.zeros_},
                    inner_attention=CachedSDPA.Config(),
                    fuse_qkv=args.fuse_qkv,
                    rope=CosSinRoPE.Config(
                        dim=args.head_dim, max_seq_len=args.max_seq_len, theta=args.rope_theta
                    ),
                    qk_norm=_norm(args.head_dim, args.norm_eps),
                ),
                moe=moe,
            )
        )
    return Qwen3Model.Config(
        vocab_size=args.vocab_size,
        dim=args.dim,
        norm=_norm(args.dim, args.norm_eps),
        tok_embeddings=Embedding.Config(
            num_embeddings=args.vocab_size, embedding_dim=args.dim, param_init={"weight": _NORMAL}
        ),
        lm_head=Linear.Config(
            in_features=args.dim, out_features=args.vocab_size, param_init=_LINEAR_INIT
        ),
        layers=layers,
    )
