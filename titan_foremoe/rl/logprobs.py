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

Legend: N tokens, V vocabulary.
"""

from __future__ import annotations

import torch

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
