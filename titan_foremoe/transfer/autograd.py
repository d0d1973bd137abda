"""Bank rows as a differentiable function of the owners' shards."""

from __future__ import annotations

import torch


class ReplicaWeights(torch.autograd.Function):
    """Forward reads the bank; backward sends each bank row's gradient to its owner.

    Synchronous (``engine.return_gradients``: the owners' sums are the owned tensors' gradients) unless the
    engine has a ``grad_sink``: then the return is issued asynchronously and the owners' sums are added to
    the sink's parameter gradients later (``engine.finish_gradients``), so no gradient flows here; the fused
    SwiGLU may have issued that return already, from its backward, as soon as it had the bank's gradient
    (``InPlaceSplit.bank_grads_ready``).
    """

    @staticmethod
    def forward(ctx, engine, layer, grad_exchange, o1, o2, o3, b1, b2, b3):
        ctx.engine, ctx.layer, ctx.exchange = engine, layer, grad_exchange
        ctx.owned = (o1.shape, o2.shape, o3.shape, o1.dtype)
        ctx.bank = (b1.shape, b2.shape, b3.shape, b1.dtype, b1.device)
        ctx.set_materialize_grads(False)  # a layer whose spare slots ran no rows gives no bank gradient: no zeros
        return b1.view_as(b1), b2.view_as(b2), b3.view_as(b3)

    @staticmethod
    def backward(ctx, g1, g2, g3):
        *shapes, dtype, device = ctx.bank
        # nothing to send (no bank row of this rank ran tokens): 0-row gradients, so the return packs no bank
        rows = 0 if all(g is None for g in (g1, g2, g3)) and not len(ctx.exchange.send_row_T) else None
        grads = tuple(g if g is not None else torch.zeros(s if rows is None else (rows, *s[1:]), dtype=dtype,
                                                          device=device)
                      for g, s in zip((g1, g2, g3), shapes))
        *owned_shapes, owned_dtype = ctx.owned
        if ctx.engine.grad_sink is not None:
            if not ctx.engine.returned_early(ctx.layer):  # the fused SwiGLU may have issued it already
                ctx.engine.return_gradients_async(ctx.layer, ctx.exchange, grads, owned_shapes[0][0])
            return (None,) * 9
        owned = ctx.engine.return_gradients(ctx.layer, ctx.exchange, grads, owned_shapes, owned_dtype)
        return (None, None, None, *owned, None, None, None)
