"""SDPA attention with an optional KV cache (the embedded rollout) and packed rows (recompute and update).

Padded rows run plain causal SDPA (torchtitan's ``ScaledDotProductAttention``).
Packed rows (``packed_attention_masks``: several sequences concatenated in one row, positions restarting
at 0 for each) attend causally within their own sequence only: torch's ``varlen_attn`` where it runs (CUDA,
16-bit activations; FA3 only where installed, ``attention_kernels.py``: torchtitan's ``VarlenAttention`` would
import FA3 on every SM90), else SDPA with a block-diagonal causal boolean mask (FlexAttention, torchtitan's
other document-mask path, has no CPU backward in torch 2.13).
During generation the rollout installs a ``KVCache`` on every layer; new
queries then attend to all cached keys of their row that are valid (left
padding is masked), which lets a batch of prompts of different lengths decode
together with per-row positions. On CUDA in 16-bit the cache is read in place by varlen FlashAttention
(``flash_kvcache_attention``: no mask, no GQA expansion); elsewhere SDPA with a boolean mask.

Legend: B rows, L positions of a row, T cache positions, N heads, H head dim, S sequences of a packed row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import ScaledDotProductAttention, VarlenMetadata

from .attention_kernels import FLASH_DTYPES, flash_kvcache_attention, flash_problem, varlen_attention


def varlen_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """``varlen_attn`` (flash attention's variable-length kernel) runs here: CUDA with bf16/fp16 activations
    (the GPU generation and head dim are checked once at model build: ``attention_kernels.attention_problem``)."""
    return device.type == "cuda" and dtype in FLASH_DTYPES


def packed_attention_masks(positions_BL: torch.Tensor, cu_seqlens_S1: torch.Tensor, max_len: int,
                           dtype: torch.dtype) -> VarlenMetadata | torch.Tensor:
    """The ``attention_masks`` of packed rows: query q sees key k of its row iff ``q - positions[q] <= k <= q``
    (causal, within its own sequence; positions restart at 0 for every sequence).

    ``cu_seqlens_S1`` (int32, on the device) and ``max_len`` (a host int) are known on the host: no sync.
    Where ``varlen_runs``: torchtitan's ``VarlenMetadata`` (4 bytes per sequence; only the pairs inside each
    sequence are computed). Elsewhere: a boolean ``[B, 1, L, L]`` mask for SDPA, built once per forward and
    shared by every layer: L^2 bytes (16k packed tokens per rank: 256 MiB) and every pair computed, the
    cross-sequence ones then masked (SDPA's math kernel on CPU also holds ``[B, N, L, L]`` scores)."""
    if varlen_runs(positions_BL.device, dtype):
        return VarlenMetadata(cu_seqlens_S1, cu_seqlens_S1, max_len, max_len)
    i_L = torch.arange(positions_BL.shape[1], device=positions_BL.device)
    start_BL1 = (i_L - positions_BL)[..., None]  # where each query's sequence starts
    mask_BLL = (i_L[None, None, :] <= i_L[None, :, None]) & (i_L[None, None, :] >= start_BL1)
    return mask_BLL[:, None]


class KVCache:
    """Keys/values ``[B, T_max, N_kv, H]`` of one layer plus the key validity mask."""

    def __init__(self, key_valid_BT: torch.Tensor, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 first_B: torch.Tensor | None = None):
        B, T = key_valid_BT.shape
        self.k_BTNH = torch.zeros(B, T, n_kv_heads, head_dim, dtype=dtype, device=key_valid_BT.device)
        self.v_BTNH = torch.zeros_like(self.k_BTNH)
        self.key_valid_BT = key_valid_BT  # shared by all layers; the rollout updates it in place
        self.first_B = first_B  # cache position of each row's first key (its left padding); None: masks only
        self.use_flash: bool | None = None  # decided at the first write (device, dtype, head dim)
        self.start = 0  # cache positions [0, start) are filled

    def write(self, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor) -> int:
        """Write the new keys and values at ``[start, start + L)``; returns the new end."""
        end = self.start + k_BLNH.shape[1]
        self.k_BTNH[:, self.start : end] = k_BLNH
        self.v_BTNH[:, self.start : end] = v_BLNH
        return end

    def flash(self, k_BLNH: torch.Tensor) -> bool:
        """Read in place by varlen FlashAttention (CUDA, 16-bit, rows' first keys known), else masked SDPA;
        decided once per cache."""
        if self.use_flash is None:
            self.use_flash = self.first_B is not None and flash_problem(
                k_BLNH.device, k_BLNH.dtype, k_BLNH.shape[-1], training=False) is None
        return self.use_flash

    def attend_flash(self, q_BLNH, k_BLNH, v_BLNH, scale: float | None) -> torch.Tensor:
        """Append, then attend to each row's keys ``[first_B, end)`` in place (``flash_kvcache_attention``).
        Finished rows' later keys are attended too (their output is never read), so no mask is needed."""
        end = self.write(k_BLNH, v_BLNH)
        self.start = end
        return flash_kvcache_attention(q_BLNH, self.k_BTNH, self.v_BTNH, self.first_B, end, scale=scale)

    def append(self, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write the new keys; return all keys, values and the ``[B, L, T]`` attention mask."""
        end = self.write(k_BLNH, v_BLNH)
        q_pos_L = torch.arange(self.start, end, device=k_BLNH.device)
        k_pos_T = torch.arange(end, device=k_BLNH.device)
        causal_LT = k_pos_T[None, :] <= q_pos_L[:, None]
        # A padded query sees only itself, so no softmax row is empty (an empty row gives NaN).
        self_LT = k_pos_T[None, :] == q_pos_L[:, None]
        mask_BLT = (causal_LT[None] & self.key_valid_BT[:, None, :end]) | self_LT[None]
        self.start = end
        return self.k_BTNH[:, :end], self.v_BTNH[:, :end], mask_BLT


class CachedSDPA(ScaledDotProductAttention):
    """torchtitan's SDPA inner attention, plus a KV-cache path used while generating and the packed-row
    paths of ``packed_attention_masks`` (``VarlenMetadata``: torch's ``varlen_attn``; a boolean mask: SDPA with
    it)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.kv_cache: KVCache | None = None

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False,
                is_causal=True, **kwargs):
        if isinstance(attention_masks, VarlenMetadata):  # cu_seq_q == cu_seq_k: one packed row's sequences
            dtype = q_BLNH.dtype if q_BLNH.dtype in FLASH_DTYPES else torch.bfloat16  # AMP may upcast
            out_BLNH = varlen_attention(*(t.to(dtype) for t in (q_BLNH, k_BLNH, v_BLNH)), attention_masks.cu_seq_q,
                                        attention_masks.max_q, scale=scale, enable_gqa=enable_gqa)
            return out_BLNH.to(q_BLNH.dtype)
        if isinstance(attention_masks, torch.Tensor):  # packed rows: block-diagonal causal [B, 1, L, L]
            out_BNLH = F.scaled_dot_product_attention(
                q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
                attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa,
            )
            return out_BNLH.transpose(1, 2)
        if self.kv_cache is None:
            return super().forward(q_BLNH, k_BLNH, v_BLNH, attention_masks=attention_masks, scale=scale,
                                   enable_gqa=enable_gqa, is_causal=is_causal, **kwargs)
        if self.kv_cache.flash(k_BLNH):
            return self.kv_cache.attend_flash(q_BLNH, k_BLNH, v_BLNH, scale)
        k_BTNH, v_BTNH, mask_BLT = self.kv_cache.append(k_BLNH, v_BLNH)
        out_BNLH = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2), k_BTNH.transpose(1, 2), v_BTNH.transpose(1, 2),
            attn_mask=mask_BLT[:, None], scale=scale, enable_gqa=enable_gqa,
        )
        return out_BNLH.transpose(1, 2)
