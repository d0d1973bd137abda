"""Temperature and nucleus (top-p) sampling, with an explicit RNG for reproducibility."""

from __future__ import annotations

import torch


def sample(logits_BV: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """Token ids ``[B]``; temperature 0 is greedy."""
    if temperature == 0:
        return logits_BV.argmax(-1)
    probs_BV = torch.softmax(logits_BV.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs_BV.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs_BV = torch.zeros_like(probs_BV).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
