"""MoE pieces that torchtitan's blocks lack for RL post-training.

* ``ReplayRouter``: torchtitan's top-k router with a seam for router replay.
  The gate probabilities are always computed (and differentiable); the top-k
  *indices* can be supplied from outside (the rollout's routing log), so the
  recompute and policy-update stages use exactly the rollout's experts.
  The router also records the indices it used, which is how the embedded
  rollout writes its routing log.
* ``MaskedMoE``: torchtitan's MoE layer with a token-mask seam. Padding (and
  finished rows while generating) is never dispatched to an expert and never
  counted as load, so it cannot pile onto one expert or skew the balance.
* ``DtypeGroupedExperts``: torchtitan's grouped experts hard-cast to bf16;
  here the compute dtype is a config field, so fp32 runs (equivalence tests,
  CPU) and bf16 runs (GPU) share one module.

Shape suffixes follow torchtitan: B batch, L sequence, D model dim, E experts,
K top-k, T tokens (B*L flattened), V real (unmasked) tokens, N token-expert pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import MoE, GroupedExperts, TokenChoiceTopKRouter

from .grouped_swiglu import grouped_swiglu, seam_call  # noqa: F401 (seam_call: used by dispatch.py too)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class ReplayRouter(TokenChoiceTopKRouter):
    """Top-k softmax/sigmoid router whose expert choice can be replayed.

    ``logged_expert_ids_BLK`` holds the routes of the routing log for this
    forward. With ``replay`` true they are the top-k indices used; either way
    ``mismatch_count`` accumulates (on the device: no host sync per layer) how
    many (unmasked) tokens' live top-k set differs from the logged one. Scores are always gathered from the live gate
    output, so gradients reach the gate exactly as in a normal forward. With
    ``record`` true the indices used are kept in ``recorded_expert_ids_BLK``.
    With ``holes`` true a logged row of ``-1`` (the engine sent no route) takes the live top-k of that
    token only, so it counts as matching in the mismatch count (two elementwise ops; off: the ops are not run).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.logged_expert_ids_BLK: torch.Tensor | None = None
        self.replay = True
        self.holes = False  # the logged routes may hold -1 rows (routed live)
        self.token_index_V: torch.Tensor | None = None  # set by MaskedMoE: the real tokens of the flat B*L
        self.record = False
        self.recorded_expert_ids_BLK: torch.Tensor | None = None
        self.mismatch_count: int | torch.Tensor = 0  # a device tensor from the first replay on (seams.routing)
        self.replayed_count = 0
        self.recomputing = False  # activation checkpointing's recompute: routes as logged, nothing counted again

    def forward(
        self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.num_expert_groups is not None or self._debug_force_load_balance:
            if self.logged_expert_ids_BLK is not None:
                raise ValueError("router replay does not support node-limited or forced routing")
            out = super().forward(x_BLD, expert_bias_E)
            if self.record:
                self.recorded_expert_ids_BLK = out[1].detach()
            return out

        scores_BLE = gate_fp32(self.gate, x_BLD)
        if self.score_func == "sigmoid":
            scores_BLE = torch.sigmoid(scores_BLE)
        else:
            scores_BLE = F.softmax(scores_BLE, dim=-1)
        with torch.no_grad():
            choice_BLE = scores_BLE if expert_bias_E is None else scores_BLE + expert_bias_E
            live_BLK = torch.topk(choice_BLE, k=self.top_k, dim=-1, sorted=False).indices

        logged_BLK = self.logged_expert_ids_BLK
        expert_ids_BLK = live_BLK
        if logged_BLK is not None:
            if tuple(logged_BLK.shape) != tuple(live_BLK.shape):
                raise ValueError(
                    f"logged expert ids have shape {tuple(logged_BLK.shape)}, "
                    f"router expects {tuple(live_BLK.shape)}"
                )
            logged_BLK = logged_BLK.to(device=scores_BLE.device, dtype=torch.int64)
            hole_BL1 = (logged_BLK < 0).any(-1, keepdim=True) if self.holes else None
            if hole_BL1 is not None:
                logged_BLK = torch.where(hole_BL1, live_BLK, logged_BLK)  # this token's live experts only
            if not self.recomputing:  # counted once, by the forward (not again in the checkpoint's recompute)
                with torch.no_grad():  # counted on the device (no sync); read once per stage (take_mismatch)
                    differs_BL = (live_BLK.sort(-1).values != logged_BLK.sort(-1).values).any(-1)
                    differs_T = differs_BL.reshape(-1)
                    if self.token_index_V is not None:
                        differs_T = differs_T.index_select(0, self.token_index_V)
                    self.mismatch_count = self.mismatch_count + differs_T.sum()
                    self.replayed_count += differs_T.numel()
            if self.replay:
                expert_ids_BLK = logged_BLK
        topk_scores_BLK = scores_BLE.gather(dim=-1, index=expert_ids_BLK)
        if self.route_norm:
            topk_scores_BLK = topk_scores_BLK / (topk_scores_BLK.sum(dim=-1, keepdim=True) + 1e-20)
        topk_scores_BLK = topk_scores_BLK * self.route_scale
        if self.record and not self.recomputing:
            self.recorded_expert_ids_BLK = expert_ids_BLK.detach()
        return topk_scores_BLK, expert_ids_BLK, scores_BLE


def gate_fp32(gate: torch.nn.Linear, x_BLD: torch.Tensor) -> torch.Tensor:
    """The router's logits in fp32, by one code path on every device: the bf16 FSDP2 parameters (mixed
    precision's ``param_dtype``) and activations are cast up explicitly, under no autocast (an outer bf16
    autocast would otherwise run the linear in bf16). Routes recorded by the rollout, replayed here and
    returned by vLLM then differ only by the fp32 GEMM's summation order. Gradients reach the bf16 weight
    through the casts."""
    bias = None if gate.bias is None else gate.bias.float()
    with torch.autocast(device_type=x_BLD.device.type, enabled=False):
        return F.linear(x_BLD.float(), gate.weight.float(), bias)


class RealTokens:
    """The real tokens of a mask, found on first use and then shared by every MoE layer of one forward.

    ``seams.routing`` hands one of these to all layers when the caller has no host-computed indices: the
    ``nonzero`` (a sync on CUDA) runs at most once per forward, and not at all when no layer needs it (decode
    steps on the fixed-shape dispatch)."""

    def __init__(self, mask_BL: torch.Tensor):
        self.mask_BL = mask_BL
        self.index_V: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.index_V is None:
            self.index_V = self.mask_BL.reshape(-1).nonzero().squeeze(1)
        return self.index_V

    @staticmethod
    def resolve(index, mask_BL: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Indices from a tensor, a ``RealTokens`` or (None) the mask itself."""
        if isinstance(index, RealTokens):  # found outside the graph: a compiled block never guards on whether
            return seam_call(index.get).to(device)  # an earlier layer found them (that flip recompiled every block)
        if index is None:  # a mask set without seams.routing: its real tokens now (a sync on CUDA)
            return mask_BL.to(device).reshape(-1).nonzero().squeeze(1)
        return index


class MaskedMoE(MoE):
    """MoE whose ``token_mask_BL`` (True = real token) keeps masked tokens out of the experts.

    The real tokens are gathered by ``token_index_V`` (set with the mask by ``seams.routing``, computed
    on the host and uploaded once per forward), so the layer has fixed shapes and no host sync.

    Masked positions get a zero routed-expert output (the shared expert, if
    any, still runs on them); only real tokens are dispatched and counted in
    ``tokens_per_expert_E``. With no mask this is torchtitan's MoE unchanged.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MoE.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.token_mask_BL: torch.Tensor | None = None
        self.token_index_V: torch.Tensor | RealTokens | None = None  # the mask's real tokens in the flat B*L
        # set by the rollout for decode steps (models/decode_dispatch.py): fixed shapes, no host sync
        self.fixed_dispatch = None
        self.recomputing = False  # activation checkpointing's recompute (``seams.recompute``): loads counted once

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        mask_BL = self.token_mask_BL
        if mask_BL is None:  # (torchtitan's MoE counts loads in a recompute too: ``seams.RecomputeSeams`` undoes it)
            return super().forward(x_BLD)
        if tuple(mask_BL.shape) != tuple(x_BLD.shape[:2]):
            raise ValueError(f"token mask has shape {tuple(mask_BL.shape)}, tokens are {tuple(x_BLD.shape[:2])}")
        # Decode steps of a rollout may dispatch with fixed shapes (``fixed_dispatch``): they need no indices.
        fixed = self.fixed_dispatch is not None and not self.training
        index_V = None if fixed else RealTokens.resolve(self.token_index_V, mask_BL, x_BLD.device)
        # Fixed-shape gathers by the real tokens' indices (known on the host): no boolean indexing, no sync.
        self.router.token_index_V = index_V
        try:
            topk_scores_BLK, expert_ids_BLK, _ = self.router(x_BLD, self.expert_bias_E)
        finally:
            self.router.token_index_V = None
        if fixed:
            out_BLD = self.fixed_dispatch(self, x_BLD, topk_scores_BLK, expert_ids_BLK, mask_BL)
            if self.shared_experts is not None:
                out_BLD = out_BLD + self.shared_experts(x_BLD)
            return out_BLD
        K = expert_ids_BLK.shape[-1]
        x_TD = x_BLD.reshape(-1, x_BLD.shape[-1])
        x_VD = x_TD.index_select(0, index_V)
        expert_ids_VK = expert_ids_BLK.reshape(-1, K).index_select(0, index_V)
        scores_VK = topk_scores_BLK.reshape(-1, K).index_select(0, index_V)
        ids_N = expert_ids_VK.reshape(-1)  # counts by scatter_add: bincount syncs on CUDA
        num_tokens_per_expert_E = torch.zeros(self.router.num_experts, dtype=torch.int64, device=ids_N.device
                                              ).scatter_add_(0, ids_N, torch.ones_like(ids_N))
        if self.training and not self.recomputing:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(num_tokens_per_expert_E.to(self.tokens_per_expert_E.dtype))
        out_1VD = self.routed_experts(x_VD[None], scores_VK[None], expert_ids_VK[None], num_tokens_per_expert_E)
        out_BLD = torch.zeros_like(x_TD).index_copy(0, index_V, out_1VD[0]).view_as(x_BLD)
        if self.shared_experts is not None:
            out_BLD = out_BLD + self.shared_experts(x_BLD)
        return out_BLD


class DtypeGroupedExperts(GroupedExperts):
    """Grouped SwiGLU experts on ``torch._grouped_mm`` with a chosen compute dtype."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"

    def __init__(self, config: Config):
        super().__init__(config)
        self.compute_dtype = _DTYPES[config.compute_dtype]
        self.placement = None  # a models.seams.PlacementSeam while a plan runs: compute over its C slots

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's owned experts (the EP shard) as plain tensors."""
        weights = (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in weights)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        weights = self.local_weights()
        p = self.placement
        if p is None:
            return grouped_swiglu(x_RD, *weights, num_tokens_per_expert_E, self.compute_dtype)
        # Slots = owned experts + replicas; waits for this layer's transfer (first use).
        weights = seam_call(p.slot_weights, weights, self.compute_dtype)
        timer = seam_call(p.time_experts, x_RD.device)  # entered and left eagerly: times the graph between
        seam_call(timer.__enter__)
        out_RD = grouped_swiglu(x_RD, *weights, num_tokens_per_expert_E, self.compute_dtype)
        seam_call(timer.__exit__, None, None, None)
        return out_RD
