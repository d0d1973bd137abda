"""Expert-load heatmap: one image per step, layers down, experts across.

Written with TensorBoard's ``add_image`` on torchtitan's TensorBoard logger.
A small built-in colour ramp (dark blue -> teal -> yellow) keeps the image
readable without matplotlib.
"""

from __future__ import annotations

import torch

_RAMP = torch.tensor([[0.07, 0.04, 0.33], [0.13, 0.56, 0.55], [0.99, 0.91, 0.14]])


def load_heatmap(loads_LE: torch.Tensor, cell: int = 8) -> torch.Tensor:
    """``[3, L*cell, E*cell]`` float image in [0, 1]; each row normalized to its layer's max."""
    loads = loads_LE.double()
    norm = loads / loads.max(dim=1, keepdim=True).values.clamp_min(1)
    x = norm.clamp(0, 1) * (len(_RAMP) - 1)
    lo = x.floor().long().clamp(max=len(_RAMP) - 2)
    frac = (x - lo)[..., None]
    rgb_LE3 = (_RAMP[lo].double() * (1 - frac) + _RAMP[lo + 1].double() * frac).float()
    img = rgb_LE3.repeat_interleave(cell, 0).repeat_interleave(cell, 1)
    return img.permute(2, 0, 1).contiguous()


def log_heatmap(metric_logger, tag: str, loads_LE: torch.Tensor, step: int) -> None:
    if getattr(metric_logger, "writer", None) is None:
        return
    add_image = getattr(metric_logger, "add_image", metric_logger.writer.add_image)  # GuardedLogger's: reported once
    add_image(tag, load_heatmap(loads_LE), step)
