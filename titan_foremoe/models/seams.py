"""Set the per-forward seams of every MoE layer at once: token mask, logged routes, replay, recording.

Also the two protocols through which the model sees run-time placement (``PlacementSeam``,
``DispatchTables``): the model imports nothing from ``placement`` or ``transfer``.

Routes travel as ``[B, L, layers, K]`` (batch, position, MoE layer, top-k),
the layout of the routing log; each layer's router gets its ``[B, L, K]`` slice.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import numpy as np
import torch

from .moe import MaskedMoE, RealTokens, ReplayRouter


def moe_layers(model: torch.nn.Module) -> list[MaskedMoE]:
    return [m for m in model.modules() if isinstance(m, MaskedMoE)]


def routers(model: torch.nn.Module) -> list[ReplayRouter]:
    return [m.router for m in moe_layers(model)]


@contextmanager
def routing(
    model: torch.nn.Module,
    *,
    token_mask_BL: torch.Tensor | None = None,
    token_index_V: torch.Tensor | None = None,
    logged_BLXK: torch.Tensor | None = None,
    replay: bool = True,
    record: bool = False,
    holes: bool = False,
    layers: list[MaskedMoE] | None = None,
):
    """Within the block, forwards use this mask and (if given) these logged routes.

    ``layers``: the model's ``moe_layers`` when the caller already has them (a rollout sets the seams once
    per decoded token; walking every module each time costs more than a tiny model's forward).
    ``token_index_V``: the mask's real tokens in the flattened ``[B * L]``, on the mask's device (computed on
    the host and uploaded with the batch: no sync); without it they are found once for all layers, by the
    first that needs them (one ``nonzero``, a sync on CUDA, per forward instead of boolean indexing in every
    layer; none in decode steps on the fixed-shape dispatch)."""
    layers = moe_layers(model) if layers is None else layers
    if token_mask_BL is not None and token_index_V is None:
        token_index_V = RealTokens(token_mask_BL)  # found once, by the first layer that needs it
    if logged_BLXK is not None and logged_BLXK.shape[2] != len(layers):
        raise ValueError(f"routes have {logged_BLXK.shape[2]} layers, the model has {len(layers)} MoE layers")
    try:
        for i, moe in enumerate(layers):
            moe.token_mask_BL = token_mask_BL
            moe.token_index_V = token_index_V
            moe.router.logged_expert_ids_BLK = None if logged_BLXK is None else logged_BLXK[:, :, i]
            if logged_BLXK is not None and not isinstance(moe.router.mismatch_count, torch.Tensor):
                # a tensor before the first replayed forward and for good after (take_mismatch zeroes it in
                # place): a compiled block guards on its type, and an int-then-tensor flip recompiled every block
                moe.router.mismatch_count = torch.zeros((), dtype=torch.int64, device=logged_BLXK.device)
            moe.router.replay = replay
            moe.router.record = record
            moe.router.holes = holes
        yield layers
    finally:
        for moe in layers:
            moe.token_mask_BL = None
            moe.token_index_V = None
            moe.router.logged_expert_ids_BLK = None
            moe.router.replay = True
            moe.router.record = False
            moe.router.holes = False


_MOE_SEAMS = ("token_mask_BL", "token_index_V", "fixed_dispatch")
_ROUTER_SEAMS = ("logged_expert_ids_BLK", "replay", "holes")


def _seams_of(moe: MaskedMoE) -> tuple:
    """The per-forward seams of one MoE layer as its forward sees them (references: nothing is copied)."""
    re = moe.routed_experts
    return (tuple(getattr(moe, a) for a in _MOE_SEAMS), tuple(getattr(moe.router, a) for a in _ROUTER_SEAMS),
            re.token_dispatcher.placement, re.inner_experts.placement)


def _set_seams(moe: MaskedMoE, seams: tuple, recomputing: bool) -> None:
    (moe_vals, router_vals, dispatcher_p, experts_p) = seams
    for a, v in zip(_MOE_SEAMS, moe_vals):
        setattr(moe, a, v)
    for a, v in zip(_ROUTER_SEAMS, router_vals):
        setattr(moe.router, a, v)
    moe.routed_experts.token_dispatcher.placement = dispatcher_p
    moe.routed_experts.inner_experts.placement = experts_p
    moe.recomputing = moe.router.recomputing = recomputing


class RecomputeSeams:
    """Activation checkpointing's two contexts (``torch.utils.checkpoint``'s ``context_fn``) for one block.

    The seams are set by context managers (``routing``, ``PlacementRuntime.micro_step``) around the forward;
    backward, and with it the checkpoint's recompute, runs after ``routing`` has left. The forward context
    keeps references to the block's seams as its forward saw them; the recompute context puts them back, so
    the recompute replays the same logged routes over the same real tokens through the same placement
    (tables, bank, slot indices), and marks the layers as recomputing: the routers count no mismatch and
    record nothing, the layers' loads are as the forward left them, and a placement answers with ``for_recompute()`` (no transfer
    issued or waited, no re-plan, no rows, timings or route flags counted twice). Afterwards the seams of the
    moment are restored. Cost: a tuple of references per MoE layer per forward, O(layers) attribute sets and
    one copy of the E load counters per MoE layer per recompute; no host sync.
    """

    def __init__(self, block: torch.nn.Module):
        self.layers = moe_layers(block)

    def contexts(self):
        """``(forward context, recompute context)`` of one checkpointed call (state of its own per call)."""
        saved: list[tuple] = []

        @contextmanager
        def forward():
            saved[:] = [_seams_of(moe) for moe in self.layers]
            yield

        @contextmanager
        def recompute():
            if len(saved) != len(self.layers):
                raise RuntimeError("activation checkpointing: a recompute without its forward")
            now = [_seams_of(moe) for moe in self.layers]
            # loads as the forward left them (torchtitan's unmasked MoE adds in every forward): put back after the
            # recompute; copied here, outside selective AC's dispatch mode, whose op log must match the forward's
            loads = [moe.tokens_per_expert_E.clone() for moe in self.layers]
            try:
                for moe, (moe_vals, router_vals, dp, ep) in zip(self.layers, saved):
                    rp = None if ep is None else getattr(ep, "for_recompute", lambda: ep)()
                    rd = rp if dp is ep else None if dp is None else getattr(dp, "for_recompute", lambda: dp)()
                    _set_seams(moe, (moe_vals, router_vals, rd, rp), recomputing=True)
                yield
            finally:
                for moe, seams, loads_E in zip(self.layers, now, loads):
                    _set_seams(moe, seams, recomputing=False)
                    with torch.no_grad():
                        moe.tokens_per_expert_E.copy_(loads_E)

        return forward(), recompute()


def recorded_routes(model: torch.nn.Module, layers: list[MaskedMoE] | None = None) -> torch.Tensor:
    """Routes used by the last forward, ``[B, L, layers, K]``."""
    layers = moe_layers(model) if layers is None else layers
    return torch.stack([m.router.recorded_expert_ids_BLK for m in layers], dim=2)


def take_mismatch(model: torch.nn.Module) -> tuple[int, int]:
    """(tokens whose live top-k differed from the log, tokens compared) since the last call: the routers'
    device counts summed on the device and read once (one sync per call, i.e. per stage, not per layer)."""
    mismatched, compared = 0, 0
    for r in routers(model):
        mismatched = mismatched + r.mismatch_count  # a new tensor: zeroing the count below leaves it alone
        compared += r.replayed_count
        if isinstance(r.mismatch_count, torch.Tensor):
            r.mismatch_count.zero_()
        r.replayed_count = 0
    return int(mismatched), compared


class DispatchTables(Protocol):
    """This rank's dispatch tables for one (micro-step, layer) (``placement.tables.LayerDispatch``).

    ``tokens_E``: this rank's token-expert pairs per expert the plan was made for; ``seg_end_Q``,
    ``seg_rank_Q``, ``seg_slot_Q``: its send segments in (expert, destination rank) order (cumulative pair
    count, destination rank and slot); ``recv_SC``: rows it receives from source s for slot c.
    """

    tokens_E: np.ndarray
    seg_end_Q: np.ndarray
    seg_rank_Q: np.ndarray
    seg_slot_Q: np.ndarray
    recv_SC: np.ndarray

    @property
    def num_slots(self) -> int: ...

    def input_splits(self) -> list[int]: ...

    def output_splits(self) -> list[int]: ...


class PlacementSeam(Protocol):
    """All a MoE layer knows of run-time placement (set on its dispatcher and experts while a plan runs).

    A placement may also have ``prepare(num_tokens_per_expert_E)``: the dispatcher calls it with this rank's
    counts before reading ``dispatch`` (the reactive baseline plans there, ``placement/reactive.py``).
    """

    layer: int
    dispatch: DispatchTables

    def slot_weights(self, owned: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple:
        """w1, w2, w3 over this rank's C slots (waits for the layer's transfers): ``SlotWeights``
        (``models/slot_gemm.py``, never materialized for backward) or ``[C, ...]`` tensors."""
        ...

    def index(self, name: str, device: torch.device) -> torch.Tensor:
        """Dispatch table ``name`` of ``dispatch`` (``recv_C``: ``recv_SC`` flattened) on the device, uploaded
        with the stage's tables ahead of use (no upload or sync in the layer)."""
        ...

    def check_loads(self, num_tokens_per_expert_E: torch.Tensor) -> None:
        """Check that the routes' counts equal ``dispatch.tokens_E`` (a device flag raised at the stage's end)."""
        ...

    def record_received(self, rows: int) -> None:
        """Rows the dispatcher's all-to-all actually delivered to this rank."""
        ...

    def time_experts(self, device: torch.device) -> AbstractContextManager:
        """Times the expert compute (CUDA events on GPU, ``perf_counter`` on CPU)."""
        ...
