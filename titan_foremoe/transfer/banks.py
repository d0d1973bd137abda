"""Replica banks: two buffers of B expert rows per MoE layer, used by alternating micro-steps.

Banks hold only this rank's non-owned slots (B = spare slots for ``foremoe`` and ``static``; EPLB plans,
which may put non-owned experts in any slot, get B = their largest count), in the expert compute dtype
(bf16 on GPU): Qwen3-30B-A3B with 2 spare slots is 2 banks x 2 rows x 3 x 768 x 2048 x 2 B = 37.7 MB per
layer, 1.81 GB per rank for 48 layers.
Legend: B bank rows, F expert hidden size, D model dim.
"""

from __future__ import annotations

import numpy as np
import torch


def pack_rows(w1, w2, w3) -> torch.Tensor:
    """Pack experts ``[n, F, D] x 3`` into rows ``[n, 3*F*D]``."""
    return torch.cat([w1.flatten(1), w2.flatten(1), w3.flatten(1)], dim=1)


def unpack_rows(rows: torch.Tensor, shapes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = rows.shape[0]
    sizes = [int(np.prod(s)) for s in shapes]
    a, b, c = rows.split(sizes, dim=1)
    return a.reshape(n, *shapes[0]), b.reshape(n, *shapes[1]), c.reshape(n, *shapes[2])


class LayerBanks:
    """The two banks of one layer plus the transfer in flight into one of them."""

    def __init__(self, expert_shapes, rows: int, dtype: torch.dtype, device: torch.device):
        self.shapes = expert_shapes  # per-expert shapes of w1, w2, w3
        self.rows, self.dtype, self.device = rows, dtype, device
        self.banks = [[torch.zeros(rows, *s, dtype=dtype, device=device) for s in expert_shapes] for _ in range(2)]
        self.pending = None
        self.version = [-1, -1]  # weights version each bank's copies were taken at

    @property
    def row_len(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for bank in self.banks for b in bank)

    def grow(self, rows: int) -> None:
        """Make room for ``rows`` rows per bank (between stages only: contents are kept)."""
        if rows <= self.rows:
            return
        for bank in self.banks:
            for i, b in enumerate(bank):
                new = torch.zeros(rows, *b.shape[1:], dtype=b.dtype, device=b.device)
                new[: self.rows].copy_(b)
                bank[i] = new
        self.rows = rows
