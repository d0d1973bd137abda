"""SDPA attention with an optional KV cache, for the embedded rollout.

Training runs plain causal SDPA (torchtitan's ``ScaledDotProductAttention``).
During generation the rollout installs a ``KVCache`` on every layer; new
queries then attend to all cached keys of their row that are valid (left
padding is masked), which lets a batch of prompts of different lengths decode
together with per-row positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import ScaledDotProductAttention


class KVCache:
    """Keys/values ``[B, T_max, N_kv, H]`` of one layer plus the key validity mask."""

    def __init__(self, key_valid_BT: torch.Tensor, n_kv_heads: int, head_dim: int, dtype: torch.dtype):
        B, T = key_valid_BT.shape
        self.k_BTNH = torch.zeros(B, T, n_kv_heads, head_dim, dtype=dtype, device=key_valid_BT.device)
        self.v_BTNH = torch.zeros_like(self.k_BTNH)
        self.key_valid_BT = key_valid_BT  # shared by all layers; the rollout updates it in place
        self.start = 0  # cache positions [0, start) are filled

    def append(self, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write the new keys; return all keys, values and the ``[B, L, T]`` attention mask."""
        L = k_BLNH.shape[1]
        end = self.start + L
        self.k_BTNH[:, self.start : end] = k_BLNH
        self.v_BTNH[:, self.start : end] = v_BLNH
        q_pos_L = torch.arange(self.start, end, device=k_BLNH.device)
        k_pos_T = torch.arange(end, device=k_BLNH.device)
        causal_LT = k_pos_T[None, :] <= q_pos_L[:, None]
        # A padded query sees only itself, so no softmax row is empty (an empty row gives NaN).
        self_LT = k_pos_T[None, :] == q_pos_L[:, None]
        mask_BLT = (causal_LT[None] & self.key_valid_BT[:, None, :end]) | self_LT[None]
        self.start = end
        return self.k_BTNH[:, :end], self.v_BTNH[:, :end], mask_BLT


class CachedSDPA(ScaledDotProductAttention):
    """torchtitan's SDPA inner attention, plus a KV-cache path used while generating."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.kv_cache: KVCache | None = None

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False,
                is_causal=True, **kwargs):
        if self.kv_cache is None:
            return super().forward(q_BLNH, k_BLNH, v_BLNH, attention_masks=attention_masks, scale=scale,
                                   enable_gqa=enable_gqa, is_causal=is_causal, **kwargs)
        k_BTNH, v_BTNH, mask_BLT = self.kv_cache.append(k_BLNH, v_BLNH)
        out_BNLH = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2), k_BTNH.transpose(1, 2), v_BTNH.transpose(1, 2),
            attn_mask=mask_BLT[:, None], scale=scale, enable_gqa=enable_gqa,
        )
        return out_BNLH.transpose(1, 2)
