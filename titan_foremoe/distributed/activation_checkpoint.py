"""torchtitan's activation checkpointing, with the MoE seams replayed in the recompute.

torchtitan's ``FullAC`` / ``SelectiveAC`` wrap every transformer block in ``torch.utils.checkpoint`` (non-reentrant).
Their recompute runs in backward, after ``models.seams.routing`` has left: it would route live, over every
token, with no placement. ``SeamFullAC`` / ``SeamSelectiveAC`` are torchtitan's policies plus the
``context_fn`` of ``models.seams.RecomputeSeams``: the recompute sees the forward's mask, logged routes and
placement, and has no side effects of its own (see there). Only the original forward's autograd graph runs
backward (non-reentrant checkpointing), so replica gradients return to their owners once.

Cost of ``full`` at Qwen3-30B-A3B, R = 64 (EP 8), per micro-step per rank: one more forward of every block
in backward (~1/3 more FLOPs), including the dispatch and combine all-to-alls of every MoE layer (the rows
routed in the forward, again: about 2 x 8192 x 8 x 2048 x 2 B = 0.5 GiB sent per layer per micro-step at
seq_len 8192, K = 8), which is what torchtitan's own full AC does for MoE; no transfer, prefetch or plan is
re-issued, no host sync is added for ``static``/``foremoe`` (their layers have none). torchtitan's
dispatcher (``balancer = "off"``) reads its splits on the host in every forward: once more per layer in
the recompute. ``selective`` saves the all-to-all outputs (torchtitan's list), so it re-sends nothing.
Memory: each block keeps its input (``benchmarks/activation_bytes.py``).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper as ptd_checkpoint_wrapper,
)
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from ..config.job_config import ActivationCheckpoint
from ..models.seams import RecomputeSeams


def _wrap(module: nn.Module, config, inner_contexts=None) -> nn.Module:
    seams = RecomputeSeams(module)

    def context_fn():
        fwd, rec = seams.contexts()
        if inner_contexts is None:
            return fwd, rec
        inner_fwd, inner_rec = inner_contexts()
        return _both(fwd, inner_fwd), _both(rec, inner_rec)

    return ptd_checkpoint_wrapper(module, context_fn=context_fn, preserve_rng_state=config.preserve_rng_state,
                                  determinism_check=config.determinism_check, early_stop=False, debug=config.debug)


@contextmanager
def _both(outer, inner):
    with ExitStack() as stack:
        stack.enter_context(outer)
        stack.enter_context(inner)
        yield


class SeamFullAC(FullAC):
    """torchtitan's full AC, the recompute through the forward's seams."""

    @dataclass(kw_only=True, slots=True)
    class Config(FullAC.Config):
        pass

    def _wrap_block(self, module: nn.Module, *, base_fqn: str | None = None) -> nn.Module:
        return _wrap(module, self.config)


class SeamSelectiveAC(SelectiveAC):
    """torchtitan's per-op selective AC (its save list and policy), the recompute through the forward's seams."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def _wrap_block(self, module: nn.Module, *, base_fqn: str | None = None) -> nn.Module:
        torchtitan_wrapped = super()._wrap_block(module, base_fqn=base_fqn)  # only for its context_fn
        return _wrap(module, self.config, inner_contexts=torchtitan_wrapped.checkpoint_fn.keywords["context_fn"])


def ac_config(cfg: ActivationCheckpoint):
    """torchtitan's ``ac_config`` argument of ``parallelize_qwen3`` for ``[activation_checkpoint]`` (None: off)."""
    kw = dict(preserve_rng_state=cfg.preserve_rng_state, determinism_check=cfg.determinism_check)
    if cfg.mode == "none":
        return None
    if cfg.mode == "full":
        return SeamFullAC.Config(**kw)
    if cfg.mode == "selective":
        return SeamSelectiveAC.Config(**kw)
    raise ValueError(f"[activation_checkpoint] mode must be none, full or selective, got {cfg.mode!r}")


def inner_block(block: nn.Module) -> nn.Module:
    """The transformer block inside an activation checkpoint wrapper (itself when not wrapped)."""
    return block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
