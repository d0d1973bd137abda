"""Import routes produced by external rollout engines (vLLM, SGLang).

Those engines return, per sequence, ``routed_experts`` of shape
``[seq_len - 1, layers, top_k]`` with logical expert ids: one row per token
that was fed through the model. The last token of the sequence was sampled
but never fed back, so it has no row. That is the same convention as our
``RoutingLog`` (``T`` tokens, routes for positions ``0 .. T-2``), so the
import only records ``T = rows + 1`` and packs the arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .log import RoutingLog, RoutingLogError


def from_external(
    routed_experts: Sequence[np.ndarray | torch.Tensor],
    num_experts: int,
    seq_lens: Sequence[int] | None = None,
) -> RoutingLog:
    """``routed_experts[i]`` is ``[seq_len_i - 1, layers, top_k]``; ``seq_lens`` (if given) is checked."""
    routes, lengths = [], []
    for i, arr in enumerate(routed_experts):
        if isinstance(arr, torch.Tensor):
            t = arr
        else:  # widen in numpy: vLLM sends uint16 beyond 256 experts, and torch's uint16 has few ops
            a = np.asarray(arr)
            t = torch.from_numpy(a.astype(np.int64) if np.issubdtype(a.dtype, np.integer) else a)
        if t.dim() != 3:
            raise RoutingLogError(f"sequence {i}: routed_experts has shape {tuple(t.shape)}, "
                                  "expected [seq_len - 1, layers, top_k]")
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise RoutingLogError(f"sequence {i}: routed_experts dtype {t.dtype} is not an integer type")
        n_tokens = t.shape[0] + 1
        if seq_lens is not None and seq_lens[i] != n_tokens:
            raise RoutingLogError(
                f"sequence {i}: routed_experts has {t.shape[0]} rows, expected seq_len - 1 = {seq_lens[i] - 1}"
            )
        routes.append(t.to(torch.int64))
        lengths.append(n_tokens)
    if seq_lens is not None and len(seq_lens) != len(routes):
        raise RoutingLogError(f"sequence count: {len(routes)} routed_experts arrays, {len(seq_lens)} seq_lens")
    return RoutingLog.from_sequences(routes, lengths, num_experts)
