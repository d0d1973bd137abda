"""Replica banks: two buffers of B expert rows per MoE layer, used by alternating micro-steps.

Banks hold only this rank's non-owned slots (B = spare slots for ``foremoe`` and ``static``; EPLB plans,
which may put non-owned experts in any slot, get B = their largest count), in the expert compute dtype
(bf16 on GPU): Qwen3-30B-A3B with 2 spare slots is 2 banks x 2 rows x 3 x 768 x 2048 x 2 B = 37.7 MB per
layer, 1.81 GB per rank for 48 layers.

Each bank is ONE packed ``[B, 3*F*D]`` tensor, a row being an expert's w1 | w3 | w2 as the transfer lanes
send it; w1/w2/w3 are strided views of it (``unpack_rows``: no copy). w1 then w3: a row's first ``2*F*D``
elements are its w1 and w3 stacked, so the banks' w1 and w3 views are also ONE ``[B, 2F, D]`` view
(``models/slot_swiglu.w13_view``): the fused SwiGLU's spare part reads it with one GEMM instead of two, and
its gradient comes from one. A contiguous run of bank rows is a valid all-to-all output: the tables number a
micro-step's bank rows in arrival order (direct receives, then host-lane rows, then kept replicas,
``placement/tables.py``) and the direct lane's all-to-all writes straight into ``packed[:n_direct]``: the
receive buffer IS the bank, no second copy of any row (the order within a row changes nothing there).
Legend: B bank rows, F expert hidden size, D model dim.
"""

from __future__ import annotations

import numpy as np
import torch


def pack_rows(w1, w2, w3) -> torch.Tensor:
    """Pack experts ``[n, F, D] x 3`` (w1, w2, w3) into rows ``[n, 3*F*D]`` laid out w1 | w3 | w2."""
    return torch.cat([w1.flatten(1), w3.flatten(1), w2.flatten(1)], dim=1)


def packed_view(w1, w2, w3) -> torch.Tensor | None:
    """The ``[n, 3*F*D]`` rows that ``w1 | w3 | w2`` already are, as a view, when they lie so in one storage
    (each row's w3 right after its w1, its w2 right after its w3, inner dims contiguous: ``unpack_rows`` of one
    tensor, or the fused SwiGLU's one-row bank gradient, ``models/slot_swiglu.py``), else None."""
    n = w1.shape[0]
    if n == 0:
        return None
    sizes = [int(np.prod(w.shape[1:])) for w in (w1, w3, w2)]
    row_len = sum(sizes)
    if (w2.shape[0] != n or w3.shape[0] != n or len({(w.dtype, w.device) for w in (w1, w2, w3)}) != 1
            or len({w.untyped_storage().data_ptr() for w in (w1, w2, w3)}) != 1):
        return None
    for w, start in zip((w1, w3, w2), np.cumsum([0, *sizes[:2]])):
        inner = w.shape[1:].numel() == 1 or w[0].is_contiguous()
        if not inner or w.storage_offset() != w1.storage_offset() + start or (n > 1 and w.stride(0) != row_len):
            return None
    return w1.as_strided((n, row_len), (row_len, 1))


def grad_rows(w1, w2, w3, send_row_T: np.ndarray, index) -> torch.Tensor:
    """The bank rows ``send_row_T`` of gradients ``w1, w2, w3`` packed ``[T, 3*F*D]`` for the return: no copy
    when they are already packed rows (``packed_view``) sent whole and in order (one bank row: the default),
    else one ``cat`` and, unless every row goes in order, one ``index_select`` (``index()``: ``send_row_T`` on
    the device)."""
    rows = packed_view(w1, w2, w3)
    if rows is None:
        rows = pack_rows(w1, w2, w3)
    if np.array_equal(send_row_T, np.arange(rows.shape[0])):
        return rows
    return rows.index_select(0, index())


def unpack_rows(rows: torch.Tensor, shapes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views (w1, w2, w3) ``[n, F, D] x 3`` of packed rows ``[n, 3*F*D]`` laid out w1 | w3 | w2 (strided in the
    row dim, no copy); ``shapes``: w1's, w2's, w3's per-expert shapes."""
    n = rows.shape[0]
    sizes = [int(np.prod(shapes[i])) for i in (0, 2, 1)]
    a, c, b = rows.split(sizes, dim=1)
    return a.view(n, *shapes[0]), b.view(n, *shapes[1]), c.view(n, *shapes[2])


class LayerBanks:
    """The two banks of one layer plus the transfer in flight into one of them.

    ``packed[b]``: bank b's storage ``[B, row_len]``; ``banks[b]``: its (w1, w2, w3) views.
    """

    def __init__(self, expert_shapes, rows: int, dtype: torch.dtype, device: torch.device):
        self.shapes = expert_shapes  # per-expert shapes of w1, w2, w3
        self.rows, self.dtype, self.device = rows, dtype, device
        self.packed = [torch.zeros(rows, self.row_len, dtype=dtype, device=device) for _ in range(2)]
        self.banks = [unpack_rows(p, self.shapes) for p in self.packed]
        self.pending = None
        self.version = [-1, -1]  # weights version each bank's copies were taken at

    @property
    def row_len(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.packed)

    def grow(self, rows: int) -> None:
        """Make room for ``rows`` rows per bank (between stages only: contents are kept)."""
        if rows <= self.rows:
            return
        if self.pending is not None:
            raise RuntimeError("banks grown while a transfer writes into them")
        for i, p in enumerate(self.packed):
            new = torch.zeros(rows, self.row_len, dtype=p.dtype, device=p.device)
            new[: self.rows].copy_(p)
            self.packed[i] = new
            self.banks[i] = unpack_rows(new, self.shapes)
        self.rows = rows
