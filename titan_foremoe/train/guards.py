"""Guards: a non-finite loss or gradient norm never reaches the weights; ranks never train on different jobs.

The non-finite check runs before every optimizer step. Both quantities are global (all-reduced loss, total grad
norm over all ranks), so every rank takes the same decision without another collective.

``job_identity`` is what every rank must hold identically at start-up (``distributed.agreement.check_same``):
the resolved config key by key and the code (each source file of the package and of ``torchtitan_patches``,
torch's and torchtitan's versions). Cost: reading ~100 small files and one 16-byte all-reduce.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path


class NonFiniteError(RuntimeError):
    """Raised (``[training] nonfinite = "stop"``) before the optimizer step; no checkpoint holds the poisoned state."""


def non_finite(step: int, **quantities: float) -> str | None:
    """One line naming the step and every non-finite quantity, or None when all are finite."""
    bad = [f"{name} = {value}" for name, value in quantities.items() if not math.isfinite(value)]
    if not bad:
        return None
    return f"step {step}: non-finite {', '.join(bad)}"


def non_finite_tensors(named) -> list[str]:
    """Names of the tensors (this rank's shards) holding a NaN or inf; one host sync for all of them.

    The HF weight check at the pre-flight reads safetensors headers only, so one NaN in an expert's weights
    surfaced at the first sampling step as torch's ``probability tensor contains ... nan``."""
    import torch

    names, flags = [], []
    for name, p in named:
        t = p.to_local() if hasattr(p, "to_local") else p
        if t.numel():
            names.append(name)
            flags.append(~torch.isfinite(t.detach()).all())
    if not flags:
        return []
    return [n for n, bad in zip(names, torch.stack(flags).tolist()) if bad]


def job_identity(cfg) -> dict[str, object]:
    """``{"[section] key": value}`` for every config key, then ``{"code <file>": bytes}`` and library versions."""
    import torch
    import torchtitan

    items: dict[str, object] = {}
    for section, values in dataclasses.asdict(cfg).items():
        for key, value in values.items():
            items[f"[{section}] {key}"] = value
    root = Path(__file__).resolve().parents[2]
    for package in ("titan_foremoe", "torchtitan_patches"):
        for path in sorted((root / package).rglob("*.py")):
            items[f"code {path.relative_to(root).as_posix()}"] = path.read_bytes()
    items["version torch"] = torch.__version__
    items["version torchtitan"] = getattr(torchtitan, "__version__", "?")
    return items
