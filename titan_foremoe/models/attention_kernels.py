"""Which attention kernel runs where: chosen from the device and what is installed, refused in one line when none can.

torchtitan 0.3.0's ``VarlenAttention`` activates FA3 on SM90 and FA4 on SM100 in its constructor
(``get_cuda_flash_attention_impl``), which imports ``flash_attn_interface`` / ``flash_attn.cute.interface``:
packages nobody installed, so the first packed recompute raised ``ModuleNotFoundError`` after a whole rollout.
Here the packed path calls torch's own ``varlen_attn`` (torch's built-in FlashAttention-2, compiled for
sm80..sm121, no extra package) and activates FA3 only when ``flash_attn_interface`` is installed and the GPU is
SM90; FA4 is never activated (torch's FA2 serves SM100). The choice never imports a flash package that is absent
(``importlib.util.find_spec`` on a top-level name reads the path, it does not import).

Kernels per path (``describe_attention_kernels`` reports them for a real device):

- ``packed`` (RL recompute and update, ``[training] pack_sequences``): ``fa3`` / ``fa2`` (``varlen_attn``) on
  CUDA in bf16/fp16; ``sdpa_block_mask`` on CPU (a ``[B, 1, L, L]`` boolean mask, SDPA's math kernel).
- ``decode`` (the embedded rollout's prefill and decode steps): ``flash_kvcache`` on CUDA in bf16/fp16 --
  ``aten._flash_attention_forward`` reading the KV cache as it is (the ``[B, T, N_kv, H]`` buffer flattened, each
  row's keys from its first prompt token, ``seqused_k`` valid keys, GQA in the kernel, causal bottom-right): no
  mask, no K/V copy, no expansion of the KV heads, inference only; ``sdpa_masked`` elsewhere (boolean mask,
  SDPA's math kernel on CPU, which expands GQA heads: ``B x N x T x H`` per layer per token).
- ``padded`` (unpacked rows: torchtitan's causal SDPA with ``enable_gqa``, no mask, backends restricted to cuDNN,
  flash, math in that order): cuDNN or flash on CUDA in bf16/fp16 (both take GQA without a mask), math in fp32
  and on CPU.

Cost: the choice is host-only, once per process (a capability query); no host sync per micro-step.

Legend: B rows, L query positions of a row, T cache positions, N query heads, H head dim, Q = B*L queries.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from dataclasses import asdict, dataclass

import torch

FLASH_DTYPES = (torch.bfloat16, torch.float16)
FLASH_SM = ((8, 0), (12, 1))
"""torch's built-in FlashAttention-2 runs on sm80..sm121 (``check_flash_attention_hardware_support`` in
ATen's ``sdp_utils.cpp``); head dims up to 256."""
FA3_MODULE = "flash_attn_interface"
"""What ``torch.nn.attention._fa3.register_flash_attention_fa3`` imports (torch 2.11-2.13)."""


def module_installed(name: str) -> bool:
    """A top-level module can be imported, found without importing it (a faulty finder counts as absent)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA device's compute capability, None off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def varlen_impl(device: torch.device) -> str | None:
    """The flash implementation packed rows run on: ``FA3`` (SM90 with ``flash_attn_interface`` installed) or
    ``FA2`` (torch's built-in kernel); None off CUDA."""
    cap = capability(device)
    if cap is None:
        return None
    return "FA3" if cap[0] == 9 and module_installed(FA3_MODULE) else "FA2"


def flash_problem(device: torch.device, dtype: torch.dtype, head_dim: int, training: bool) -> str | None:
    """Why torch's flash kernels cannot run these shapes on ``device`` (None: they can)."""
    cap = capability(device)
    if cap is None:
        return f"no CUDA device ({device})"
    if not FLASH_SM[0] <= cap <= FLASH_SM[1]:
        return f"GPU sm{cap[0]}{cap[1]} is outside flash attention's sm80..sm121"
    if dtype not in FLASH_DTYPES:
        return f"flash attention runs bf16/fp16, not {str(dtype).replace('torch.', '')}"
    if head_dim > 256 or head_dim % 8:
        return f"head_dim {head_dim}: flash attention needs a multiple of 8 <= 256"
    if training and 192 < head_dim and (cap[0] == 8 and cap[1] >= 6 or cap[0] == 12):
        return f"head_dim {head_dim} > 192: flash attention's backward does not run on sm{cap[0]}{cap[1]}"
    return None


@dataclass(frozen=True)
class AttentionKernels:
    packed: str
    """``fa3`` / ``fa2`` (``varlen_attn``) or ``sdpa_block_mask`` (CPU)."""
    decode: str
    """``flash_kvcache`` or ``sdpa_masked``."""
    padded: str
    """SDPA's backend for unpacked causal rows under torchtitan's list: ``cudnn/flash`` or ``math``."""


def choose_kernels(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionKernels:
    """The kernel of each attention path for this device and activation dtype (refusals: ``attention_problem``)."""
    flash = flash_problem(device, dtype, head_dim, training=False) is None
    impl = varlen_impl(device)
    packed = impl.lower() if impl is not None and flash else "sdpa_block_mask"
    padded = "cudnn/flash" if flash else "math"  # torchtitan's SDPA leaves efficient attention out
    return AttentionKernels(packed=packed, decode="flash_kvcache" if flash else "sdpa_masked", padded=padded)


def attention_problem(device: torch.device, dtype: torch.dtype, head_dim: int, pack_sequences: bool) -> str | None:
    """One line when the job's attention cannot run on ``device``: packed rows on CUDA need the varlen kernel
    (the block-mask fallback holds ``[B, N, L, L]`` fp32 scores: 32 heads x 16k^2 is 32 GiB per layer)."""
    if device.type != "cuda" or not pack_sequences:
        return None
    why = flash_problem(device, dtype, head_dim, training=True)
    if why is None:
        return None
    return (f"[training] pack_sequences: no varlen attention kernel on {device}: {why} (set "
            f"[training] mixed_precision_param = \"bfloat16\" where the dtype is the reason, or pack_sequences = false)")


def activate_varlen_impl(device: torch.device) -> str | None:
    """Make torch's flash dispatch match ``varlen_impl`` (FA3 activated only where chosen; an FA3/FA4 activated
    elsewhere, e.g. by torchtitan, is restored to FA2 when it is not the choice). Returns the impl."""
    from torch.nn import attention as nn_attention

    impl = varlen_impl(device)
    current = nn_attention.current_flash_attention_impl()
    if impl == "FA3" and current != "FA3":
        nn_attention.activate_flash_attention_impl("FA3")
    elif impl == "FA2" and current is not None:
        nn_attention.restore_flash_attention_impl()
    return impl


@functools.cache
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_kwargs(enable_gqa: bool, impl: str | None) -> dict:
    """Keyword arguments of ``varlen_attn`` this torch has: 2.11's has no ``enable_gqa`` (FA2 reads fewer KV heads
    as GQA anyway) nor ``num_splits``; with FA2, one split (batch-invariant sums, torchtitan's choice)."""
    have = _varlen_params()
    kw: dict = {"window_size": (-1, 0)}
    if enable_gqa and "enable_gqa" in have:
        kw["enable_gqa"] = True
    if impl in (None, "FA2") and "num_splits" in have and torch.version.hip is None:
        kw["num_splits"] = 1
    return kw


def varlen_attention(q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, cu_seqlens_S1: torch.Tensor,
                     max_len: int, *, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """Causal attention within each sequence of packed rows by torch's ``varlen_attn`` (autograd included), on
    the flash implementation ``activate_varlen_impl`` made current at model build (nothing is looked up here:
    this runs inside compiled blocks, once per layer and micro-step)."""
    from torch.nn.attention import current_flash_attention_impl
    from torch.nn.attention.varlen import varlen_attn

    B, L, _, H = q_BLNH.shape
    q_QNH, k_QNH, v_QNH = (t.reshape(B * L, -1, t.shape[-1]) for t in (q_BLNH, k_BLNH, v_BLNH))
    kw = varlen_kwargs(enable_gqa, current_flash_attention_impl() or "FA2")
    out_QNH = varlen_attn(q_QNH, k_QNH, v_QNH, cu_seqlens_S1, cu_seqlens_S1, max_len, max_len, scale=scale, **kw)
    return out_QNH.view(B, L, -1, v_BLNH.shape[-1])


def flash_forward(*args, **kwargs):
    """``aten._flash_attention_forward`` (a module attribute, so a CPU test can stand a reference in for it)."""
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def flash_kvcache_attention(q_BLNH: torch.Tensor, k_BTNH: torch.Tensor, v_BTNH: torch.Tensor, first_B: torch.Tensor,
                            end: int, *, scale: float | None) -> torch.Tensor:
    """Queries at cache positions ``[end - L, end)`` of every row attend causally to that row's keys
    ``[first_B, end)``, read in place from the full cache buffer (``[B, T, N_kv, H]``, contiguous).

    Varlen FlashAttention with ``cu_seqlens_k[b] = b*T + first_B[b]`` (where row b's keys start) and
    ``seqused_k = end - first_B`` (how many), causal aligned bottom-right (FA2 >= 2.1), so query i of row b sees
    keys up to cache position ``end - L + i``; left-padding queries see no key and return 0 (never read).
    ``end`` is a host int, ``first_B`` lives on the device: no host sync. Inference only (no backward)."""
    B, L, N, H = q_BLNH.shape
    T = k_BTNH.shape[1]
    q_QNH = q_BLNH.reshape(B * L, N, H)
    k_XNH, v_XNH = k_BTNH.view(B * T, *k_BTNH.shape[2:]), v_BTNH.view(B * T, *v_BTNH.shape[2:])
    rows = torch.arange(B + 1, device=q_BLNH.device, dtype=torch.int32)
    cu_q = rows * L
    cu_k = rows * T
    cu_k[:B] += first_B.to(torch.int32)
    used_B = (end - first_B).to(torch.int32)
    out = flash_forward(q_QNH, k_XNH, v_XNH, cu_q, cu_k, L, end, 0.0, True, False, scale=scale, seqused_k=used_B)
    return out[0].view(B, L, N, v_BTNH.shape[-1])


def _sdpa_backend(q, k, v, mask, is_causal: bool, enable_gqa: bool, efficient: bool = True) -> str:
    """The first backend SDPA's own checks accept, in torch's order (cuDNN, flash, efficient unless excluded)."""
    params = torch.backends.cuda.SDPAParams(q, k, v, mask, 0.0, is_causal, enable_gqa)
    if torch.backends.cuda.can_use_cudnn_attention(params):
        return "cudnn"
    if torch.backends.cuda.can_use_flash_attention(params):
        return "flash"
    if efficient and torch.backends.cuda.can_use_efficient_attention(params):
        return "efficient"
    return "math"


def describe_attention_kernels(device: torch.device, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
                               n_heads: int = 32, n_kv_heads: int = 4) -> dict:
    """What runs on ``device`` for Qwen3-30B-A3B's heads (32 query, 4 KV, head_dim 128) by default: the choice,
    and on CUDA each kernel run once on a small input (``ran_*``: ok or the error's first line), and SDPA's own
    backend pick for the padded path and for the masked decode fallback (``can_use_*_attention``)."""
    cap = capability(device)
    out: dict = {"device": str(device), "capability": f"sm{cap[0]}{cap[1]}" if cap else None,
                 "torch": torch.__version__, "fa3_installed": module_installed(FA3_MODULE),
                 **asdict(choose_kernels(device, dtype, head_dim)),
                 "problem": attention_problem(device, dtype, head_dim, pack_sequences=True)}
    if cap is None:
        return out
    activate_varlen_impl(device)  # as the model build does
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=device, dtype=dtype, generator=g)  # noqa: E731
    B, L, T = 2, 64, 96
    q, k, v = rnd(1, 2 * L, n_heads, head_dim), rnd(1, 2 * L, n_kv_heads, head_dim), rnd(1, 2 * L, n_kv_heads, head_dim)
    cu = torch.tensor([0, L, 2 * L], device=device, dtype=torch.int32)
    out["ran_packed"] = _try(lambda: varlen_attention(*(t.requires_grad_() for t in (q, k, v)), cu, L, scale=None,
                                                      enable_gqa=True).sum().backward())
    kc, vc = rnd(B, T, n_kv_heads, head_dim), rnd(B, T, n_kv_heads, head_dim)
    first = torch.tensor([0, 5], device=device)
    out["ran_decode"] = _try(lambda: flash_kvcache_attention(rnd(B, 1, n_heads, head_dim), kc, vc, first, 40,
                                                             scale=None))
    qd = rnd(B, n_heads, L, head_dim)
    kd, vd = rnd(B, n_kv_heads, L, head_dim), rnd(B, n_kv_heads, L, head_dim)
    out["sdpa_padded"] = _sdpa_backend(qd, kd, vd, None, True, True, efficient=False)  # torchtitan's list
    mask = torch.ones(B, 1, 1, T, device=device, dtype=torch.bool)
    out["sdpa_masked_decode"] = _sdpa_backend(qd[:, :, :1], kc.transpose(1, 2), vc.transpose(1, 2), mask, False, True)
    out["flash_impl_active"] = torch.nn.attention.current_flash_attention_impl() or "FA2"
    return out


def _try(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # reported, not raised: the GPU check lists what does not run
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


def job_attention_problem(cfg, head_dim: int, device: torch.device) -> str | None:
    """``attention_problem`` for a job config (RL packs its rows; activations in ``mixed_precision_param``):
    the pre-flight (``config/check.py``, on the launching node's GPU) and every rank's model build ask it."""
    return attention_problem(device, getattr(torch, cfg.training.mixed_precision_param), head_dim,
                             cfg.rl.enable and cfg.training.pack_sequences)


def local_cuda_device() -> torch.device | None:
    """This process's GPU (``LOCAL_RANK``), None without CUDA: what the pre-flight checks before torchrun."""
    import os

    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1))
