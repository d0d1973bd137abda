"""Fixed-capacity, dropless expert dispatch for the rollout's decode steps: no host sync.

torchtitan's all-to-all dispatcher learns its splits from device counts (a sync per layer), and
``MaskedMoE`` selects real tokens by boolean indexing (more syncs). A decode step feeds one token per
row, so the worst case is small and known on the host: each rank's N = B_local x K token-expert pairs.
Here every source sends all N pair rows to every EP rank (even splits: ``all_to_all_single`` needs no
count exchange) with a fixed-size exchange of local expert ids; pairs not meant for a destination, and
pairs of masked (finished or padded) rows, carry the sentinel id ``e`` (zero-count routes). Receivers
sort by id and count with ``scatter_add`` on the device; sentinel rows sort past the grouped GEMM's last
offset, so they cost no expert compute, and their outputs are zeroed.

Cost per MoE layer per decoded token per rank (bf16, D = 2048, K = 8): S x N x D x 2 bytes each way
(dispatch and combine) plus S x N x 8 bytes of ids, vs about N x D x 2 for the exact dispatch. At
B_local = 32 / 64 / 256 (N = 256 / 512 / 2048): S = 8: 8 / 16 / 64 MB; S = 64: 64 / 128 / 512 MB (exact:
1 / 2 / 8 MB). It pays while the extra bytes cost less than the layer's syncs, i.e. on NVLink (EP 8) at
small B_local; ``fits`` makes that choice on the host from known sizes (``budget_bytes``), else the
exact path (torchtitan's dispatcher, with its syncs) runs.

Legend: B batch, L positions, D model dim, K top-k, T = B x L tokens, N = T x K pairs, S EP ranks,
R = S x N received rows, e local experts per rank.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed._functional_collectives import all_to_all_single

DEFAULT_BUDGET_BYTES = 32 << 20
"""Largest padded send buffer (S x N x D x element bytes) per layer for which the padded path is chosen."""


def _ep(moe) -> tuple[object, int]:
    mesh = moe.routed_experts.token_dispatcher.ep_mesh
    return mesh, 1 if mesh is None else mesh.size()


def fits(moe, tokens: int, dtype: torch.dtype, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> bool:
    """The padded path for ``tokens`` tokens on this layer (host-only: sizes are known, nothing is read)."""
    d = moe.routed_experts.token_dispatcher
    if getattr(d, "placement", None) is not None or getattr(moe.routed_experts.inner_experts, "placement", None):
        return False  # a placement plan runs: its own dispatch
    _, S = _ep(moe)
    D = moe.router.gate.weight.shape[-1]
    return S * tokens * moe.router.top_k * D * dtype.itemsize <= budget_bytes


def _local_experts(experts, x_RD: torch.Tensor, slot_R: torch.Tensor, e: int) -> torch.Tensor:
    """Expert outputs of rows whose slot is < ``e``; rows with the sentinel ``e`` get 0 (never computed)."""
    order_R = torch.argsort(slot_R, stable=True)
    counts = torch.zeros(e + 1, dtype=torch.int64, device=slot_R.device)
    counts.scatter_add_(0, slot_R, torch.ones_like(slot_R))
    y_sorted_RD = experts(x_RD[order_R], counts[:e])  # sentinel rows lie past the last offset: untouched
    y_RD = torch.empty_like(y_sorted_RD).index_copy_(0, order_R, y_sorted_RD)
    return torch.where((slot_R < e)[:, None], y_RD, torch.zeros((), dtype=y_RD.dtype, device=y_RD.device))


def fixed_capacity_experts(
    moe, x_BLD: torch.Tensor, scores_BLK: torch.Tensor, ids_BLK: torch.Tensor, mask_BL: torch.Tensor
) -> torch.Tensor:
    """Routed-expert output ``[B, L, D]`` of ``moe`` (masked rows: 0), with fixed shapes only."""
    B, L, D = x_BLD.shape
    K = ids_BLK.shape[-1]
    T, N = B * L, B * L * K
    dev = x_BLD.device
    ids_N = ids_BLK.reshape(N)
    rows_on = getattr(moe.routed_experts.token_dispatcher, "expert_rows_on", None)
    rows_E = rows_on(dev) if rows_on is not None else None
    if rows_E is not None:  # experts re-laid out across EP ranks: logical id -> weight row
        ids_N = rows_E[ids_N]
    valid_N = mask_BL.reshape(T, 1).expand(T, K).reshape(N)
    x_ND = x_BLD.reshape(T, 1, D).expand(T, K, D).reshape(N, D)
    mesh, S = _ep(moe)
    e = moe.router.num_experts // S
    dest_N, local_N = ids_N // e, ids_N % e
    experts = moe.routed_experts.inner_experts
    if S == 1:
        y_ND = _local_experts(experts, x_ND, torch.where(valid_N, local_N, e), e)
    else:
        mine_SN = valid_N[None] & (dest_N[None] == torch.arange(S, device=dev)[:, None])
        slot_SN = torch.where(mine_SN, local_N[None], e)
        slot_R = all_to_all_single(slot_SN.reshape(-1), None, None, mesh)
        x_RD = all_to_all_single(x_ND[None].expand(S, N, D).reshape(S * N, D), None, None, mesh)
        y_RD = _local_experts(experts, x_RD, slot_R, e)
        y_SND = all_to_all_single(y_RD, None, None, mesh).view(S, N, D)
        y_ND = y_SND[dest_N, torch.arange(N, device=dev)]
    # torchtitan's combine: scale in fp32, back to the activation dtype, sum a token's K outputs
    y_ND = (y_ND.float() * scores_BLK.reshape(N, 1)).to(y_ND.dtype)
    return y_ND.view(T, K, D).sum(1).view(B, L, D)


@contextmanager
def fixed_capacity(layers, tokens: int, dtype: torch.dtype, budget_bytes: int = DEFAULT_BUDGET_BYTES):
    """Within the block, masked forwards of ``layers`` use the padded dispatch where it ``fits``."""
    chosen = [m for m in layers if fits(m, tokens, dtype, budget_bytes)]
    try:
        for m in chosen:
            m.fixed_dispatch = fixed_capacity_experts
        yield chosen
    finally:
        for m in chosen:
            m.fixed_dispatch = None
