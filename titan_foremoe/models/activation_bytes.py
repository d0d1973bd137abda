"""Activation bytes one transformer block saves for backward, measured on a one-block model of the real width.

A model with the flavor's dimensions, one block and a 256-token vocabulary is built on CPU in the expert
compute dtype; one masked forward (all tokens real, routes replayed from the live router, as the RL update
runs) of ``tokens`` tokens runs with ``torch.autograd.graph.saved_tensors_hooks`` entered around the
block only, and every saved storage that is not a parameter is counted once. Two probe sizes give bytes
per token (the slope, so nothing fixed is scaled); SDPA is forced to its flash kernel, as on the GPU
(O(tokens) saved: output and log-sum-exp). Without activation checkpointing
(``[activation_checkpoint] mode = "none"``) every block holds this from its forward to its backward. The
expert part assumes an even load (each token's k rows on the rank that runs them).

With ``mode = "full"`` a block holds only its input (``[tokens, D]`` in the compute dtype); during its
backward it recomputes its forward, so one block's activations (the ``none`` figure) are alive at a time on
top. ``selective`` (torchtitan's per-op policy) holds the outputs its policy saves. ``held_per_token``
measures what a mode really holds: the bytes of every tensor the forward created that is still alive at the
end of the blocks' forward (``torch.distributed._tools.mem_tracker.MemTracker``, storages tracked by
weak reference, so it sees what checkpointing keeps outside autograd's saved tensors), for 1 and 2
blocks; the difference is one block. ``--check`` compares that with the model (``held_model_per_token``).

``scripts/dry_run.py`` uses these per-token figures; ``benchmarks/activation_bytes.py`` prints them:

    python benchmarks/activation_bytes.py --flavor qwen3_30b_a3b --check
"""

from __future__ import annotations

import dataclasses

import torch


def block_bytes(args, tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Saved-for-backward bytes of block 0 for one sequence of ``tokens`` tokens (parameters excluded)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from titan_foremoe.models.build import build_model_config
    from titan_foremoe.models.seams import routing

    small = dataclasses.replace(args, n_layers=1, vocab_size=256, max_seq_len=max(tokens, 16))
    cfg = build_model_config(small, expert_dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.to(dtype).train()
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params:
            seen[s._cdata] = s.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    block = model.layers["0"] if isinstance(model.layers, torch.nn.ModuleDict) else model.layers[0]
    block.register_forward_pre_hook(lambda *_: hooks.__enter__())
    block.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    inputs = torch.randint(0, 256, (1, tokens))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), routing(model, token_mask_BL=torch.ones(1, tokens, dtype=torch.bool)):
        model(inputs)
    return sum(seen.values())


def bytes_per_token(args, dtype: torch.dtype = torch.bfloat16, probes: tuple[int, int] = (64, 128)) -> float:
    """Slope of ``block_bytes`` between two probe sizes: one block's activation bytes per token."""
    a, b = (block_bytes(args, t, dtype) for t in probes)
    return (b - a) / (probes[1] - probes[0])


def held_model_per_token(args, mode: str, per_token_none: float, dtype: torch.dtype = torch.bfloat16,
                         per_token_selective: float | None = None) -> tuple[float, float]:
    """(bytes per token per block held from forward to backward, bytes per token alive once on top: the
    block being recomputed in backward) for an AC ``mode``; ``per_token_none`` from ``bytes_per_token``."""
    if mode == "none":
        return per_token_none, 0.0
    if mode == "full":  # the checkpoint keeps the block's input; its backward recomputes one block at a time
        return args.dim * torch.empty(0, dtype=dtype).element_size(), per_token_none
    if per_token_selective is None:
        raise ValueError("selective AC: pass the measured per_token_selective (held_per_token)")
    return per_token_selective, per_token_none


def held_bytes(args, tokens: int, mode: str, n_layers: int, dtype: torch.dtype = torch.bfloat16,
               backward: bool = False) -> int:
    """Bytes alive at the end of the blocks' forward that the forward created (a masked forward with the
    routes replayed, as the RL update runs), on an ``n_layers`` model of the real width under AC ``mode``.
    ``backward``: instead, the peak of activations, temporaries and gradients over the forward and a backward
    of ``logsumexp`` of the logits (the whole step's peak, outputs and gradients included)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from titan_foremoe.config.job_config import ActivationCheckpoint
    from titan_foremoe.distributed.activation_checkpoint import ac_config
    from titan_foremoe.models.build import build_model_config
    from titan_foremoe.models.seams import routing

    small = dataclasses.replace(args, n_layers=n_layers, vocab_size=256, max_seq_len=max(tokens, 16))
    cfg = build_model_config(small, expert_dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    with torch.device("meta"):
        model = cfg.build()
    ac = ac_config(ActivationCheckpoint(mode=mode))
    if ac is not None:
        ac.build().apply(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.to(dtype).train()
    inputs = torch.randint(0, 256, (1, tokens))
    mask = torch.ones(1, tokens, dtype=torch.bool)
    held: list[int] = []
    tracker = MemTracker()
    tracker.track_external(model)

    def at_norm(*_):  # the blocks' forward is done: what is alive now waits for backward (or is the output)
        snap = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
        held.append(sum(v for k, v in snap.items() if str(k).endswith(("ACT", "TEMP"))))

    model.norm.register_forward_pre_hook(at_norm)
    with tracker, sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        with routing(model, token_mask_BL=mask):
            out = model(inputs)
        if backward:  # outside ``routing``, as the RL trainer runs it
            out.float().logsumexp(-1).sum().backward()
            snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
            return sum(v for k, v in snap.items() if str(k).endswith(("ACT", "TEMP", "GRAD")))
    return held[0]


def held_per_token(args, mode: str, dtype: torch.dtype = torch.bfloat16, tokens: int = 128) -> float:
    """One block's held bytes per token under AC ``mode``: ``held_bytes`` of 2 blocks minus 1 block."""
    return (held_bytes(args, tokens, mode, 2, dtype) - held_bytes(args, tokens, mode, 1, dtype)) / tokens
