"""Token log-probs and entropy from logits, a chunk of tokens at a time.

``log_softmax`` over the whole ``[N, V]`` logits in fp32 holds a ``[N, V]`` fp32 copy
(and autograd keeps it for backward): at N = 16k tokens and Qwen3's V = 151,936 that is
9.7 GB per copy. Here the forward reads ``chunk`` rows at a time and saves nothing but
the logits it was given (and the entropy, 4 bytes per token); the backward recomputes one
chunk's ``log_softmax`` (one more pass over V, as activation checkpointing) and writes its
gradient rows in place with log_softmax's own backward kernel, so log-probs and their
gradients are bitwise those of the unchunked computation. Extra memory: O(chunk x V) fp32 in both
passes (1024 x 151,936 x 4 B = 0.62 GB at the default), plus the ``[N, V]`` gradient of the
logits that autograd needs anyway (in the logits' dtype). Rows are independent, so a
chunk's values are those of the full tensor; no host syncs.

``lm_head_logprobs`` goes one step further for the RL loss: the model's ``lm_head`` itself returns the
log-probs and entropy, computing each chunk's logits from the final hidden states and its weight
(``_LMHeadLogprobEntropy``), so no ``[N, V]`` tensor exists in forward or backward. Held for backward:
the hidden states (``[N, D]``, which the lm_head holds anyway) and nothing else; in backward each chunk's
logits are recomputed (one more ``[chunk, D] x [D, V]`` GEMM per chunk, as activation checkpointing).

Legend: N tokens, V vocabulary, D model width, B sequences, L positions.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

DEFAULT_CHUNK = 1024


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """``(log softmax(z)[target], entropy(softmax(z)))`` per row with ``z = logits / scale``."""

    @staticmethod
    def forward(ctx, logits_NV, targets_N, scale: float, chunk: int, want_entropy: bool):
        N = logits_NV.shape[0]
        logp_N = logits_NV.new_empty(N, dtype=torch.float32)
        ent_N = logits_NV.new_zeros(N, dtype=torch.float32)
        for a in range(0, N, chunk):
            z = logits_NV[a : a + chunk].float() / scale
            ls = torch.log_softmax(z, dim=-1)
            logp_N[a : a + chunk] = ls.gather(-1, targets_N[a : a + chunk, None]).squeeze(-1)
            if want_entropy:
                ent_N[a : a + chunk] = -(ls.exp() * ls).sum(-1)
        ctx.save_for_backward(logits_NV, targets_N, ent_N)
        ctx.scale, ctx.chunk = scale, chunk
        ctx.set_materialize_grads(False)  # an unused output (the entropy metric) costs no backward pass
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, g_logp_N, g_ent_N):
        logits_NV, targets_N, ent_N = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        if g_logp_N is None and g_ent_N is None:
            return torch.zeros_like(logits_NV), None, None, None, None
        grad_NV = torch.empty_like(logits_NV)
        for a in range(0, logits_NV.shape[0], chunk):
            b = slice(a, a + chunk)
            ls = torch.log_softmax(logits_NV[b].float() / scale, dim=-1)
            if g_logp_N is not None:  # gather's then log_softmax's own backward: the unchunked gradient, bitwise
                g = torch.zeros_like(ls).scatter_add_(-1, targets_N[b, None], g_logp_N[b, None])
                g = torch.ops.aten._log_softmax_backward_data(g, ls, -1, torch.float32)
            else:
                g = torch.zeros_like(ls)
            if g_ent_N is not None:  # d H / dz = -p (log p + H)
                g -= ls.exp() * (ls + ent_N[b, None]) * g_ent_N[b, None]
            grad_NV[b] = (g / scale).to(grad_NV.dtype)
        return grad_NV, None, None, None, None


def token_logprobs_entropy(
    logits_BLV: torch.Tensor,
    targets_BL: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk: int = DEFAULT_CHUNK,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log pi_T(target), H(pi_T))`` at every position, fp32, differentiable, computed ``chunk``
    tokens at a time; ``pi_T = softmax(logits / T)`` (T = 0, greedy, counts as 1). Targets < 0
    (padding) read token 0. ``entropy=False`` returns zeros for H (saves one pass over V)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    scale = temperature if temperature > 0 else 1.0
    V = logits_BLV.shape[-1]
    logp_N, ent_N = _ChunkedLogprobEntropy.apply(
        logits_BLV.reshape(-1, V), targets_BL.reshape(-1).clamp_min(0), float(scale), int(chunk), entropy
    )
    return logp_N.view(targets_BL.shape), ent_N.view(targets_BL.shape)


def token_logprobs(
    logits_BLV: torch.Tensor, targets_BL: torch.Tensor, temperature: float = 1.0, *, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """log pi_T(target) at every position, in fp32, for the policy at sampling temperature T
    (``softmax(logits / T)``, as verl; T = 0, greedy, counts as 1)."""
    return token_logprobs_entropy(logits_BLV, targets_BL, temperature, chunk=chunk, entropy=False)[0]


class _LMHeadLogprobEntropy(torch.autograd.Function):
    """``_ChunkedLogprobEntropy`` of ``logits = h @ w.T``, the logits built a chunk at a time in both passes.

    The gradient of a chunk's logits is cast to the hidden states' dtype, as the unfused path's ``.float()``
    does, before the two GEMMs of the linear's backward; the weight's gradient is summed over chunks in its
    own dtype by ``addmm_`` (no ``[V, D]`` temporary; in bf16 one rounding per chunk instead of one in all).
    Transient memory at Qwen3-30B-A3B (V = 151,936, D = 2048, bf16, chunk 1024): about 2 GB of ``[chunk, V]``
    fp32 buffers, in backward only; nothing ``[N, V]``."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, targets_N, scale: float, chunk: int, want_entropy: bool):
        N = h_ND.shape[0]
        logp_N = h_ND.new_empty(N, dtype=torch.float32)
        ent_N = h_ND.new_zeros(N, dtype=torch.float32)
        for a in range(0, N, chunk):
            ls = torch.log_softmax(F.linear(h_ND[a : a + chunk], w_VD).float() / scale, dim=-1)
            logp_N[a : a + chunk] = ls.gather(-1, targets_N[a : a + chunk, None]).squeeze(-1)
            if want_entropy:
                ent_N[a : a + chunk] = -(ls.exp() * ls).sum(-1)
        ctx.save_for_backward(h_ND, w_VD, targets_N, ent_N)
        ctx.scale, ctx.chunk = scale, chunk
        ctx.set_materialize_grads(False)
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, g_logp_N, g_ent_N):
        h_ND, w_VD, targets_N, ent_N = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        if g_logp_N is None and g_ent_N is None:  # zeros, not None: FSDP's post-backward hook still runs
            return torch.zeros_like(h_ND), torch.zeros_like(w_VD), None, None, None, None
        g_h_ND = torch.empty_like(h_ND)
        g_w_VD = torch.zeros_like(w_VD)
        for a in range(0, h_ND.shape[0], chunk):
            b = slice(a, a + chunk)
            ls = torch.log_softmax(F.linear(h_ND[b], w_VD).float() / scale, dim=-1)
            if g_logp_N is not None:
                g = torch.zeros_like(ls).scatter_add_(-1, targets_N[b, None], g_logp_N[b, None])
                g = torch.ops.aten._log_softmax_backward_data(g, ls, -1, torch.float32)
            else:
                g = torch.zeros_like(ls)
            if g_ent_N is not None:
                g -= ls.exp() * (ls + ent_N[b, None]) * g_ent_N[b, None]
            g = (g / scale).to(h_ND.dtype)  # the gradient of the chunk's logits, in their dtype
            g_h_ND[b] = g @ w_VD
            g_w_VD.addmm_(g.t(), h_ND[b])
        return g_h_ND, g_w_VD, None, None, None, None


@contextmanager
def lm_head_logprobs(model: torch.nn.Module, targets_BL: torch.Tensor, temperature: float = 1.0, *,
                     chunk: int = DEFAULT_CHUNK, entropy: bool = True):
    """Within it ``model(tokens)`` returns ``(log pi_T(target), H(pi_T))``, each ``[B, L]`` fp32, in place of
    the logits: the model's ``lm_head`` (torchtitan's decoder calls it on the final hidden states) computes
    them a chunk at a time. The module is still called, so FSDP2 unshards its weight for forward and
    backward and reduce-scatters its gradient as for the plain linear. Values equal
    ``token_logprobs_entropy(model(tokens), targets_BL, temperature)``; targets < 0 read token 0."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    head = model.lm_head
    if getattr(head, "bias", None) is not None:
        raise ValueError("lm_head_logprobs: the lm_head has a bias; Qwen3-MoE's has none")
    scale = float(temperature if temperature > 0 else 1.0)
    targets_N = targets_BL.reshape(-1).clamp_min(0)

    def forward(h_BLD: torch.Tensor):
        logp_N, ent_N = _LMHeadLogprobEntropy.apply(h_BLD.reshape(-1, h_BLD.shape[-1]), head.weight, targets_N,
                                                    scale, int(chunk), entropy)
        return logp_N.view(targets_BL.shape), ent_N.view(targets_BL.shape)

    head.forward = forward  # an instance attribute: nn.Module.__call__ (and FSDP's hooks) still run
    try:
        yield
    finally:
        del head.forward
