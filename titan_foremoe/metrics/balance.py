"""Expert-parallel load balance of one micro-step.

The straggler sets the pace of an EP all-to-all, so the figure that matters is
max rank load / mean rank load, per layer. Loads are token-expert assignments:
a token routed to k experts counts k times, once on each expert's rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from ..distributed import collectives
from ..models.seams import moe_layers


@torch.no_grad()
def take_tokens_per_expert(model: torch.nn.Module) -> torch.Tensor:
    """This rank's token counts per expert ``[layers, experts]`` since the last call; resets them."""
    counts = []
    for moe in moe_layers(model):
        buf = moe.tokens_per_expert_E
        local = buf.to_local() if hasattr(buf, "to_local") else buf
        counts.append(local.detach().clone().float())
        local.zero_()
    return torch.stack(counts)


def rank_loads(tokens_LE: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Loads ``[layers, ranks]`` under static placement (rank r owns a contiguous block)."""
    layers, experts = tokens_LE.shape
    return tokens_LE.view(layers, num_ranks, experts // num_ranks).sum(-1)


def max_over_mean(loads_LR: torch.Tensor) -> torch.Tensor:
    """Per-layer max/mean over ranks; 1.0 for a layer with no load."""
    mean = loads_LR.mean(-1)
    return torch.where(mean > 0, loads_LR.max(-1).values / mean.clamp_min(1e-12), torch.ones_like(mean))


def group_tokens_per_expert(tokens_LE: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum counts over the EP group: what the group's expert ranks actually process."""
    if group is not None and dist.is_initialized():
        tokens_LE = collectives.all_reduce(tokens_LE.clone(), group=group)
    return tokens_LE


def rank_load_metrics(loads_LR: torch.Tensor, prefix: str = "balance") -> dict[str, float]:
    """Max/mean over ranks (averaged, worst layer, per layer) and the busiest rank's load per layer."""
    ratio_L = max_over_mean(loads_LR)
    out = {
        f"{prefix}/max_over_mean": float(ratio_L.mean()),
        f"{prefix}/max_over_mean_worst_layer": float(ratio_L.max()),
    }
    for layer, r in enumerate(ratio_L.tolist()):
        out[f"{prefix}/layer_{layer}/max_over_mean"] = r
        out[f"{prefix}/layer_{layer}/max_rank_tokens"] = float(loads_LR[layer].max())
    return out


def micro_step_balance_metrics(
    tokens_LE: torch.Tensor, ep: int, *, per_expert: bool, prefix: str = "balance"
) -> dict[str, float]:
    """TensorBoard scalars for one micro-step's EP-group token counts under static placement."""
    out = rank_load_metrics(rank_loads(tokens_LE, ep), prefix)
    out[f"{prefix}/tokens"] = float(tokens_LE.sum())
    if per_expert:
        for layer in range(tokens_LE.shape[0]):
            for e, n in enumerate(tokens_LE[layer].tolist()):
                out[f"tokens_per_expert/layer_{layer}/expert_{e}"] = n
    return out
