"""The ``exact`` balancer in the real runtime: MoonEP-style exact quotas, planned on the device in every layer.

Per MoE layer and forward (``ExactPlacement.dispatch_tokens``): this rank's expert counts are all-gathered over
the EP group as a device tensor (no host read), ``planner/exact.plan_exact`` plans the layer on the device, and
every rank computes exactly its quota of the group's token-expert rows (the group's pairs divided as evenly
as integers allow: host-known from the sources' pair counts, the batch shapes, so every shape below is static and
nothing waits for the device). Duplicates are confined to the NVLink domain: the EP group must lie in one node
(``ExactRuntime`` refuses otherwise; the simulator plans EP groups across nodes node by node).

Transport (torch collectives, so it runs on gloo and NCCL alike; the sizes are the quotas and the batch shapes):
the group's tokens, scores and expert ids are all-gathered, each rank picks its quota rows by device indices
(``planner/exact.rank_rows``); the owned experts are all-gathered after the plan, on the critical path as a
reactive design must, and the rank computes over all E experts' groups (empty ones cost nothing); outputs are
scored and reduce-scattered back to their tokens. Autograd of the all-gathers reduce-scatters the gradients:
token gradients to their sources, duplicated experts' weight gradients to their owners. MoonEP instead writes
tokens straight into peers' slots and pulls only the duplicates over NVLink (symmetric memory): the simulator
charges that (``simulator/timing.py``, the exact row), which is cheaper than this transport.

Cost per layer per micro-step per rank (Qwen3-30B-A3B: E = 128, top-8, D = 2048, 9.4 MB per bf16 expert, EP = 8
in one node, T tokens per rank): counts all-gather 8 KiB; plan O(E log E + E R) on the device (~15 kernels);
tokens all-gather R T D x 2 B (= the all-to-all's T K D x 2 B at R = K = 8), the same again for the combine's
reduce-scatter; experts all-gather (R - 1) K = 112 experts, 1.05 GB (MoonEP's transport: at most K = 16
duplicates, 150 MB); host syncs 0. Memory: the group's tokens (R T D) and the layer's E experts while it runs.

Legend: E experts, R ranks of the EP group, K = E / R owned, T tokens of a rank (padded: Tm, the group's most),
P = R Tm k pair positions, Q this rank's quota, D model dim, L MoE layers, M micro-steps.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torchtitan_patches.torch_compat import (  # 2.13's names, or 2.11's *_tensor* ones
    all_gather_single,
    all_gather_single_autograd,
    reduce_scatter_single_autograd,
)

from ..distributed import agreement
from ..distributed import device as dev
from .active import ActivePlacement
from .reactive import OnlinePlan
from .runtime import MicroStepReport, PlacementRuntime
from ..planner.exact import host_quota_R, plan_exact, rank_rows, replicas_R


@dataclass
class ExactCombine:
    """What the combine needs of the dispatch: the rows' tokens in the gathered batch and their scores."""

    token_Q: torch.Tensor
    score_Q: torch.Tensor
    padded_tokens: int  # Tm
    tokens: int  # this rank's T


class ExactReport(MicroStepReport):
    """``MicroStepReport`` whose duplicates per layer stay on the device until the step's metrics read them."""

    def __init__(self, rows_L, replicas_dev_L, timers, stats):
        self._replicas_dev_L = replicas_dev_L
        super().__init__(rows_L, rows_L, [], timers, stats)

    @property
    def replicas_L(self) -> list[int]:
        return dev.to_host(self._replicas_dev_L).tolist()  # read with the step's metrics, not in the layer

    @replicas_L.setter
    def replicas_L(self, _value) -> None:
        pass


@dataclass
class ExactPlacement(ActivePlacement):
    """One layer of one micro-step: plans at the dispatch and computes exactly its quota."""

    runtime: "ExactRuntime | None" = None
    micro: int = 0
    _group: object = None
    _experts: int = 0

    def check_loads(self, num_tokens_per_expert_E: torch.Tensor) -> None:
        """Planned from these very counts: nothing to check."""

    def dispatch_tokens(self, x_TD, scores_TK, ids_TK, counts_E, group):
        """Count all-gather, device plan, this rank's quota rows: (rows, rows per expert, combine metadata)."""
        rt = self.runtime
        T, k = ids_TK.shape
        E = counts_E.shape[0]
        tokens_S, R, r = rt.tokens_MS[self.micro], rt.R, rt.rank
        if T != tokens_S[r] or E % R:
            raise RuntimeError(f"layer {self.layer}: {T} tokens of {E} experts here; the stage was started for "
                               f"{tokens_S[r]} tokens on this rank of {R}")
        Tm = int(tokens_S.max())
        quota = int(host_quota_R(int(tokens_S.sum()) * k, R)[r])
        t0 = time.perf_counter()
        loads_SE = all_gather_single(counts_E.detach().to(torch.int64), 0, group).view(R, E)
        t1 = time.perf_counter()
        load_E = loads_SE.sum(0)
        assign_ER = plan_exact(load_E, R, R)
        if not self.recompute:
            rt.replicas_ML[self.micro, self.layer] = replicas_R(assign_ER)[r]
            rt.add_plan_ms((time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3)
        pad = Tm - T
        x_PD = all_gather_single_autograd(torch.nn.functional.pad(x_TD, (0, 0, 0, pad)), 0, group)
        s_P = all_gather_single_autograd(torch.nn.functional.pad(scores_TK, (0, 0, 0, pad)), 0, group).reshape(-1)
        ids = torch.nn.functional.pad(ids_TK.to(torch.int64), (0, 0, 0, pad), value=E)  # pads sort last
        e_P = all_gather_single(ids, 0, group).reshape(-1)
        sorted_P = torch.argsort(e_P, stable=True)  # by expert, then source, token, top-k slot
        pair_Q = sorted_P[rank_rows(assign_ER, r, quota, load_E)]
        token_Q = pair_Q // k
        self._group, self._experts = group, E
        self.record_received(quota)
        return x_PD[token_Q], assign_ER[:, r], ExactCombine(token_Q, s_P[pair_Q], Tm, T)

    def slot_weights(self, owned: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """All E experts of the layer, gathered after the plan (their gradients reduce-scattered to the owners)."""
        if self._group is None:
            raise RuntimeError(f"layer {self.layer}: experts ran before the exact plan (no dispatch)")
        return tuple(all_gather_single_autograd(w.to(dtype), 0, self._group) for w in owned)

    def combine_tokens(self, out_QD: torch.Tensor, meta: ExactCombine, x_TD: torch.Tensor) -> torch.Tensor:
        """Score the rows, add them into the group's padded tokens, reduce-scatter each source its own."""
        from torchtitan.ops.scatter_add import deterministic_scatter_add

        scored = (out_QD.to(torch.float32) * meta.score_Q.reshape(-1, 1)).to(out_QD.dtype)
        D = x_TD.shape[-1]
        buf = x_TD.new_zeros(self.runtime.R * meta.padded_tokens, D)
        buf = deterministic_scatter_add(buf, meta.token_Q.reshape(-1, 1).expand(-1, D), scored.to(buf.dtype))
        return reduce_scatter_single_autograd(buf, "sum", 0, self._group)[:meta.tokens]


class ExactRuntime(PlacementRuntime):
    """``PlacementRuntime``'s interface for the trainer; every layer plans itself on the device."""

    def __init__(self, *args, ranks_per_node: int, **kwargs):
        super().__init__(*args, **kwargs)
        if self.R > ranks_per_node:
            raise ValueError(f"[balance] balancer 'exact' duplicates experts inside one NVLink domain: the EP "
                             f"group of {self.R} ranks spans nodes of {ranks_per_node}")
        self.tokens_MS = np.zeros((0, self.R), dtype=np.int64)
        self.replicas_ML: torch.Tensor | None = None
        self._plan_ms = self._gather_ms = 0.0

    def compile(self, plan, loads_MLSE):
        raise RuntimeError("the exact runtime plans on the device in every layer: it compiles no stage")

    def start_stage(self, plan, loads_MLSE: np.ndarray, tables=None, name: str = "stage", tokens_M=None) -> None:
        """Only the sources' pair counts of ``loads_MLSE`` are used (the batch shapes: quotas and padding);
        ``plan`` and ``tables`` are ignored."""
        self.loads_MLSE = np.asarray(loads_MLSE)
        pairs_MLS = self.loads_MLSE.sum(-1)
        top_k = self.layers[0].router.top_k
        if (pairs_MLS != pairs_MLS[:, :1]).any() or (pairs_MLS % top_k).any():
            raise ValueError(f"{name} stage: a source's pairs differ between layers or are not whole tokens of top-{top_k}")
        self.tokens_MS = pairs_MLS[:, 0] // top_k
        # together, before any layer's collective: a rank that raised alone would leave the others in an all-gather
        problem = self._batch_problem(tokens_M) or "none"
        agreement.check_same(f"{name} stage (exact)", {"the loads' tokens": self.tokens_MS,
                                                       "a micro-batch off the loads": problem}, self.engine.group)
        if problem != "none":
            raise agreement.DisagreementError(f"{name} stage (exact): {problem}")
        M = len(self.tokens_MS)
        self.plan = OnlinePlan("exact", np.zeros(M), np.zeros(M))
        self.replicas_ML = torch.zeros(M, len(self.layers), dtype=torch.int64, device=self.device)
        self._new_route_flags(M)

    def prefetch(self, m: int) -> None:
        """Nothing moves ahead: every layer gathers its experts after its own plan."""

    def add_plan_ms(self, plan_ms: float, gather_ms: float) -> None:
        self._plan_ms += plan_ms
        self._gather_ms += gather_ms

    @contextmanager
    def micro_step(self, m: int):
        self._plan_ms = self._gather_ms = 0.0
        try:
            with self.installed([ExactPlacement(self.engine, layer, None, 0, runtime=self, micro=m)
                                 for layer in range(len(self.layers))]):
                yield
        finally:
            if self.plan is not None and m < len(self.plan.plan_ms_M):
                self.plan.plan_ms_M[m], self.plan.gather_ms_M[m] = self._plan_ms, self._gather_ms

    def report(self, m: int) -> MicroStepReport:
        return ExactReport([ap.received_rows for ap in self._active], self.replicas_ML[m],
                           [ap.expert_timer for ap in self._active], self.engine.take_stats())

    def end_stage(self, failed: bool = False) -> None:
        self.plan = None
        self.replicas_ML = None
        self.route_bad_ML = None
