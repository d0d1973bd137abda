"""Execute a stage plan: per micro-step placements on every MoE layer, transfers one micro-step ahead.

Usage for a stage of M micro-steps::

    tables = runtime.compile(plan, loads_MLSE) # this rank's tables (planner thread: StagePlanner.submit(then=))
    runtime.start_stage(plan, loads_MLSE, tables)  # issues micro-step 0's transfers
    for m in range(M):
        with runtime.micro_step(m):
            out = model(...)                   # dispatch follows the plan; layer l waits for its replicas
            runtime.prefetch(m + 1)            # no-op for layers already issued in m's forward (below)
            loss.backward()                    # replica gradients go back to their owners
    runtime.end_stage()

A lazily planned stage (``lazy.py``: the synchronous recompute, foremoe) passes ``start_stage(stage.plan, loads,
stage)``: micro-step m >= 1 is taken at ``micro_step(m)``'s entry (``_resolve``: wait for the planner's worker,
check on the EP group, upload, issue m's transfers, which then travel inside m), never earlier on any rank. A
stage planned in the worker while an earlier one ran (the synchronous update) takes micro-step 0 at its start and
m + 1 at m's entry, so m + 1's transfers leave from m's layers as in a stage planned whole.

When does micro-step m+1's transfer for layer l leave? From inside layer l's forward in micro-step m, right
after the layer has its own replicas (``_Placement.slot_weights``): that is where FSDP has the layer's
experts unsharded, so the owned rows are read for free. Reading them between micro-steps instead
(``prefetch``) costs an all-gather over ``efsdp`` when FSDP shards experts there (``efsdp > 1``): the
whole EP-local expert set, ~6.3 GB inter-node per micro-step per rank for Qwen3-30B-A3B at 64 GPUs, i.e.
FSDP's own forward gather a second time. So ``prefetch`` issues only layers whose owned experts are
readable without a gather (``efsdp = 1``, or FSDP off); the others are *deferred* to the layer's own
forward in micro-step m, issued and waited on at once. Never across an optimizer step: a micro-step
whose tables are ``stale`` (the first of an optimizer step) must carry the new weights, so m's forward
never issues it; the trainer's ``prefetch`` after the step issues it (``efsdp = 1``) or defers it. Cost
of deferral, per optimizer step (not per micro-step): the first micro-step's transfers are exposed, each
layer's at most ``spare`` rows received (2 x 18.9 MB bf16 rows for Qwen3-30B-A3B with 2 spare slots:
~0.4 ms per layer at 50 GB/s, ~18 ms per optimizer step), instead of 6.3 GB gathered per micro-step.
Host staging (CPU-assisted lane) follows the same rule: a layer's own experts are staged at its first
issue after an optimizer step that sends on that lane, from the rows that issue reads; the lane's exchange
runs only in layers where some rank of the group uses it (``LayerTransfers.host_any``).

Gradient return: issued asynchronously in each layer's backward (``ReplicaWeights``); the owners' sums are
added into the unsharded parameter gradients, i.e. the full EP-local experts' gradients that FSDP
reduce-scatters over ``efsdp``, on the engine's landing stream as soon as the owner's own gradient of the layer
is accumulated (``transfer/landing.py``), and the compute stream waits for that landing when backward reaches
the layer's transformer block input (``_GradGate``, a forward pre-hook on the block, so its backward runs
before FSDP's post-backward reduce-scatter of that block, which FSDP registers on the same inputs first). The
window is the rest of the layer's backward (the dispatch's all-to-all, the router, norms, the block's
attention); waiting only before the optimizer step would need the returned rows reduce-scattered again over
``efsdp`` (a second collective), not done.

Owners: a plan may move experts to new owners at an optimizer step (``owner_policy = "balanced"``). The
runtime's ``ExpertLayout`` (``relayout.py``) holds the map in effect; the first micro-step of a step whose
plan has other owners re-lays the experts out (weights and optimizer state) before any transfer is read
from them, unless the trainer started that move earlier (``layout.start``, overlapped with the recompute).

Every balancer (``static``, ``eplb_history``, ``eplb_oracle``, ``foremoe``)
runs through this one path; they differ only in the plan.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..distributed import agreement, collectives
from ..distributed import device as dev
from ..distributed.ep import ep_local, is_ep_local
from ..distributed.uploads import upload
from ..models.seams import moe_layers
from ..planner.types import StagePlan
from ..transfer.engine import TransferEngine
from ..transfer.stats import TransferStats
from ..transfer.timing import ExposedTimer
from .active import ActivePlacement
from .lazy import LazyStage
from .relayout import ExpertLayout
from .tables import LayerTables, RankTables, compile_stage, dispatch_arrays, stage_splits


@dataclass
class MicroStepReport:
    """What the runtime measured in one micro-step (this rank's view, all layers).

    ``measured_rows_L``: rows the dispatcher's all-to-all delivered (the received tensors' sizes);
    ``expert_ms_L``: expert compute time (forwards), from events around the experts: reading it waits for
    them, so the trainer reads it once per optimizer step, never between micro-steps.
    """

    measured_rows_L: list[int]
    planned_rows_L: list[int]
    replicas_L: list[int]
    expert_timers_L: list[ExposedTimer] = field(default_factory=list)
    transfers: TransferStats = field(default_factory=TransferStats)

    @cached_property
    def expert_ms_L(self) -> list[float]:
        return [t.take(drain=True) * 1e3 for t in self.expert_timers_L]


class PlacementRuntime:
    """Runs stage plans on one EP group: ``group`` is the EP process group, ``rank``/``num_ranks`` this
    rank's index in it and its size, ``node_of_rank_R`` the node of each EP rank."""

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup | None, rank: int, num_ranks: int,
                 node_of_rank_R: np.ndarray, path: str = "direct", cost=None,
                 host_group: dist.ProcessGroup | None = None, weights_dtype: torch.dtype | None = None,
                 layout: ExpertLayout | None = None, grad_group: dist.ProcessGroup | None = None,
                 window: int = 0):
        self.layers = moe_layers(model)
        self.layout = layout  # None: experts stay in the contiguous layout (plans must keep them there)
        self.rank, self.R = rank, num_ranks
        self.weights_dtype = weights_dtype  # FSDP's compute dtype: replicas are copies of what owners compute with
        self.window = window  # layers with transfers in flight at once (0: no bound)
        self.node_of_rank_R = node_of_rank_R
        self.engine = TransferEngine(group, rank, num_ranks, node_of_rank_R, path, cost, host_group, grad_group)
        self.engine.grad_sink = self._owned_params
        parents = {id(child): mod for mod in model.modules() for child in mod.children()}
        for layer, moe in enumerate(self.layers):  # the returned gradients land before FSDP reduce-scatters them
            block = parents.get(id(moe))
            if block is not None:
                block.register_forward_pre_hook(self._gate_hook(layer), with_kwargs=True)
        self._staged: set[int] = set()  # layers whose own experts are staged in host memory (this weights version)
        self._issued: set[tuple[int, int]] = set()  # (micro-step, layer) whose transfers are issued
        self.deferred = 0  # (micro-step, layer) transfers issued in the layer's forward and waited at once
        self.plan: StagePlan | None = None
        self.tables: list[RankTables | None] = []  # None: a lazily planned micro-step not taken yet (lazy.py)
        self._lazy: LazyStage | None = None
        self._lazy_ahead = False  # micro-step m + 1 taken at m's entry (lazy.py: a stage planned in the worker)
        self._stage_name = "stage"
        self.lazy_taken: dict[str, int] = {}  # per stage name: micro-steps whose plan and tables came from the
        # planner's worker (lazy.py)
        self._bank_rows = 0
        self._active: list[ActivePlacement] = []
        self._bank_base = 0
        self.route_bad_ML: torch.Tensor | None = None  # device flags: routes differed from the plan's loads

    @property
    def device(self) -> torch.device:
        return self.layers[0].routed_experts.inner_experts.w1_EFD.device

    def upload_tables(self, tables: list[LayerTables]) -> None:
        """Every device index the layers' dispatch and transfers read, for these tables, in ONE pinned
        non-blocking copy ahead of use (``distributed/uploads.py``): the layers then run without uploads or
        syncs. ~0.3 MiB per micro-step at Qwen3-30B-A3B, R = 64 (the tables' own size)."""
        K = self.layers[0].routed_experts.inner_experts.w1_EFD.shape[0] // self.R
        arrays = {}
        for lt in tables:
            arrays.update(self.engine.index_arrays(lt.transfers, lt.slot_source_C, K, lt.split))
            arrays.update(dispatch_arrays(lt.dispatch))
        keys = list(arrays)
        on_device = upload({str(i): arrays[k] for i, k in enumerate(keys)}, self.device)
        self.engine.stage_indices.update({k: on_device[str(i)] for i, k in enumerate(keys)})

    def _new_route_flags(self, M: int) -> None:
        self.route_bad_ML = torch.zeros(M, len(self.layers), dtype=torch.bool, device=self.device)

    def _check_route_flags(self) -> None:
        """The one read of the stage's route check (a sync per stage, not per layer): raise naming the first
        (micro-step, layer) whose routes differed from the loads the plan was made for."""
        flags, self.route_bad_ML = self.route_bad_ML, None
        if flags is None:
            return
        bad = np.argwhere(dev.to_host(flags).numpy())  # the stage's one read of its route checks
        # together: a rank that raised alone would leave the others waiting in their next collective
        n = collectives.all_reduce(torch.tensor([len(bad)], dtype=torch.int64))  # every rank of the job
        if len(bad):
            m, layer = bad[0]
            raise RuntimeError(f"layer {layer}, micro-step {m}: the routes differ from the loads the plan was made "
                               f"for ({len(bad)} (micro-step, layer) pairs of the stage do)")
        if int(n[0]):
            raise RuntimeError(f"another rank found routes that differ from the loads the plan was "
                               f"made for ({int(n[0])} (micro-step, layer) pairs; its error names them)")

    # -- plan bookkeeping ----------------------------------------------------------
    def compile(self, plan: StagePlan, loads_MLSE: np.ndarray) -> list[RankTables]:
        """This rank's tables for every micro-step of ``plan`` (pure; safe in the planner thread)."""
        intra, inter = self.engine.host_lanes()
        return compile_stage(plan, loads_MLSE, self.rank, host_intra=intra, host_inter=inter)

    def start_stage(self, plan: StagePlan, loads_MLSE: np.ndarray,
                    tables: list[RankTables] | LazyStage | None = None, name: str = "stage",
                    tokens_M: np.ndarray | None = None) -> None:
        """``tokens_M``: this rank's real tokens per micro-step (host-known): a micro-batch the plan was not made
        for is refused on every rank of the group here, before any layer's all-to-all could size its splits by
        the plan and hang or index out of range. ``tables``: a ``LazyStage`` (``lazy.py``, with ``plan`` its
        ``plan``): micro-steps 1.. are taken at their ``micro_step`` (``_resolve``)."""
        if plan.info.get("executable") is False:
            raise ValueError(f"balancer {plan.balancer!r} is a bound, not an executable placement")
        M, L = plan.assign_MLER.shape[:2]
        if loads_MLSE.shape[:2] != (M, L) or L != len(self.layers):
            raise ValueError(f"plan {plan.assign_MLER.shape} and loads {loads_MLSE.shape} / {len(self.layers)} layers disagree")
        if plan.topology.num_ranks != self.R:
            raise ValueError(f"plan is for {plan.topology.num_ranks} EP ranks, this EP group has {self.R}")
        E = plan.assign_MLER.shape[2]
        if self.layout is None and not np.array_equal(
                plan.layout_owner_MLE, np.broadcast_to(np.arange(E) // (E // self.R), plan.owner_MLE.shape)):
            raise ValueError("this runtime has no expert layout to re-lay out: plan with owner_policy='contiguous'")
        self.plan, self.loads_MLSE = plan, np.asarray(loads_MLSE)
        self._lazy, self._stage_name = tables if isinstance(tables, LazyStage) else None, name
        problem = self._batch_problem(tokens_M)
        self._lazy_ahead = False
        if self._lazy is not None:
            if self._lazy.plan is not plan:
                raise ValueError("a lazily planned stage runs on its own plan (LazyStage.plan)")
            if self._lazy.rest is not None:  # planning is vectorized over layers: see lazy.plan_lazily
                raise ValueError("this runtime takes a lazily planned stage's micro-step 0 whole (first_layers=None)")
            first = self._lazy.first
            if first is None:  # planned in the worker while an earlier stage ran (the update): m + 1 taken at m
                self._lazy_ahead = True
                first, failed = self._lazy.take(0)
                problem = problem or failed
                self.lazy_taken[name] = self.lazy_taken.get(name, 0) + (first is not None)
            self.tables = [first] + [None] * (M - 1)
        else:
            self.tables = tables if tables is not None else self.compile(plan, self.loads_MLSE)
        if len(self.tables) != M or any(t is not None and t.rank != self.rank for t in self.tables):
            raise ValueError(f"tables for {len(self.tables)} micro-steps / another rank; the plan has {M}")
        ready = [m for m, t in enumerate(self.tables) if t is not None]
        self.check_agreement(name, problem, ready)
        # banks hold the spare slots (more only for plans that put non-owned experts in owned slots: EPLB); a lazily
        # planned micro-step must fit them (``_resolve`` refuses it on every rank otherwise): sized now, for all
        spare = plan.slots_MLRC.shape[3] - plan.assign_MLER.shape[2] // self.R
        self._bank_rows = max(spare, *(self.tables[m].num_bank_rows for m in ready))
        self._issued = set()
        self.engine.stage_indices = {}
        self.upload_tables([lt for m in ready for lt in self.tables[m].layers])
        self._new_route_flags(M)
        for layer in range(len(self.layers)):  # allocated now: transfers may be deferred to the forward
            e = self.layers[layer].routed_experts.inner_experts
            self.engine.banks(layer, (e.w1_EFD, e.w2_EDF, e.w3_EFD), self._bank_rows, self._dtype(layer))
        self.prefetch(0)

    def _batch_problem(self, tokens_M: np.ndarray | None) -> str | None:
        """What is wrong with this rank's micro-batches for the plan (host data only), or None: each layer's
        token-expert pairs from this rank must number its real tokens times top-k."""
        if tokens_M is None:
            return None
        tokens_M = np.asarray(tokens_M, dtype=np.int64)
        pairs_ML = self.loads_MLSE[:, :, self.rank, :].sum(-1)
        if len(tokens_M) != len(pairs_ML):
            return f"{len(tokens_M)} micro-batches for a plan of {len(pairs_ML)} micro-steps"
        top_k = self.layers[0].router.top_k
        bad = np.argwhere(pairs_ML != tokens_M[:, None] * top_k)
        if len(bad):
            m, layer = bad[0]
            return (f"micro-step {m} layer {layer}: the micro-batch has {tokens_M[m]} tokens ({tokens_M[m] * top_k} "
                    f"token-expert pairs), the plan was made for {pairs_ML[m, layer]} pairs from this rank")
        return None

    def check_agreement(self, name: str, local_problem: str | None = None,
                        micro_steps: list[int] | None = None) -> None:
        """Every rank of the EP group holds this plan and its loads, and each send count equals its receiver's
        expectation (else NCCL hangs or delivers wrong rows): ``agreement.check_splits`` over ``micro_steps``
        (default all), once per stage, and once per lazily planned micro-step at its entry (``_resolve``).

        On the EP group's gloo half (the prefetch twin group: ``cuda:nccl,cpu:gloo``), host tensors only: no
        host-device sync. Cost per call and rank: hashing (Qwen3-30B-A3B, R = 64, 16 micro-steps: ~0.1 s of one
        core for the 96 MiB of ``assign_MLER`` and ``loads_MLSE``, ``benchmarks/bench_agreement.py``; one
        micro-step: 1/16 of it), one all-to-all of R int64 and one all-reduce of 6 int64, latency-bound: 1.1 ms
        per call on 2 gloo ranks of this 2-core machine (loopback; ``/tmp``-only script timing the two
        collectives); at scale an estimate, not measured: gloo's all-to-all posts R - 1 messages of 8 B at once
        (~5-10 us each of CPU), its ring all-reduce takes 2 (R - 1) hops of ~25 us on TCP, so ~3 ms at R = 64,
        ~13 ms at R = 256, ~50 ms at R = 1024 (EP groups are 8-64 ranks: R = 8, ~0.5 ms). A lazily planned stage
        pays it M times instead of once, on the host while the device still runs the previous micro-step."""
        what = f"{name} stage ({self.plan.balancer})"
        if self.engine.group is None or self.R == 1:
            if local_problem is not None:
                raise agreement.DisagreementError(f"{what}: {local_problem}")
            return
        ms = list(range(len(self.tables))) if micro_steps is None else list(micro_steps)
        M, L = self.plan.assign_MLER.shape[:2]
        send_MLKR = np.zeros((M, L, len(agreement.SPLIT_KINDS), self.R), dtype=np.int64)
        recv_MLKR = np.zeros_like(send_MLKR)
        if local_problem is None:  # a rank with a problem may hold no tables: the problem is raised first
            send_MLKR[ms], recv_MLKR[ms] = stage_splits([self.tables[m] for m in ms], self.R)
        agreement.check_splits(what, send_MLKR, recv_MLKR, self.engine.group,
                               plan_digests(self.plan, self.loads_MLSE, ms), local_problem)

    def _resolve(self, m: int, issue: bool = True) -> None:
        """Micro-step m of a lazily planned stage, at its entry (the same point on every rank): take its plan and
        tables from the worker, check them on the EP group (a failed plan, or one needing more bank rows than the
        stage's banks, ends the stage on every rank with one error), upload them, issue m's transfers (they
        travel inside m, layer by layer in order, instead of behind m - 1). ``issue=False``: taken one
        micro-step ahead (a stage planned in the worker while an earlier one ran): its transfers leave as a whole
        stage's do, from inside m - 1's layers and the trainer's ``prefetch``."""
        tables, problem = self._lazy.take(m)
        if tables is not None and tables.num_bank_rows > self._bank_rows:
            problem = (f"micro-step {m} needs {tables.num_bank_rows} bank rows, the stage's banks hold "
                       f"{self._bank_rows} (a lazily planned micro-step must fit the spare slots)")
        if problem is None:
            self.tables[m] = tables
            self.lazy_taken[self._stage_name] = self.lazy_taken.get(self._stage_name, 0) + 1
        self.check_agreement(self._stage_name, problem, [m])
        self.upload_tables(tables.layers)
        if issue:
            self.prefetch(m)

    def weights_changed(self) -> None:
        """Call after an optimizer step: replicas and host copies (CPU-assisted path) are stale."""
        self._staged = set()
        self.engine.weights_changed()

    def _bank(self, m: int) -> int:
        return (self._bank_base + m) % 2

    def _owned_if_free(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """This EP rank's experts of ``layer`` if readable without a collective (FSDP does not shard them over
        ``efsdp`` now), else None: the caller defers to the layer's forward, where FSDP has them unsharded."""
        e = self.layers[layer].routed_experts.inner_experts
        weights = (e.w1_EFD, e.w2_EDF, e.w3_EFD)
        if not all(is_ep_local(w) for w in weights):
            return None
        return tuple(ep_local(w.detach(), self.weights_dtype) for w in weights)

    def _issue(self, m: int, layer: int, owned: tuple[torch.Tensor, ...]) -> None:
        """Issue (micro-step m, layer)'s transfers from ``owned`` (this EP rank's full experts, unsharded); with a
        window, first land (m, layer - window) in its bank, so at most ``window`` layers' buffers are alive."""
        if self.window and (m, layer - self.window) in self._issued:
            self.engine.wait(layer - self.window)
        self._send(layer, owned, self.tables[m].layers[layer].transfers, self._bank(m), self._bank_rows)
        self._issued.add((m, layer))

    def _send(self, layer: int, owned: tuple[torch.Tensor, ...], transfers, bank: int, rows: int) -> None:
        """Start one layer's replica transfers into ``bank`` from ``owned``, staging this rank's own experts
        for the host lane first if this optimizer step has not yet (once per step, O(own experts))."""
        dtype = self._dtype(layer)
        with torch.no_grad():
            owned = tuple(w.detach() for w in owned)
            if self.weights_dtype is not None:
                owned = tuple(w.to(self.weights_dtype) for w in owned)
            if len(transfers.host.send_peer_T) and layer not in self._staged:  # only an owner that sends on it
                self.engine.refresh_host_copies(layer, owned, dtype)
                self._staged.add(layer)
            self.engine.prefetch(layer, owned, transfers, bank, rows, dtype)

    def _in_forward(self, m: int, layer: int, owned: tuple[torch.Tensor, ...], after_use: bool) -> None:
        """Called from layer's forward in micro-step m (experts unsharded): before its first use, issue m's
        transfer if it was deferred; after, issue m+1's unless m+1 begins a new optimizer step."""
        if self.plan is None:
            return
        if not after_use:
            if (m, layer) not in self._issued:
                self._issue(m, layer, owned)
                self.deferred += 1
            return
        n = m + 1  # a lazily planned n is not taken before its own entry, on any rank: never issued from here
        if n < len(self.tables) and self.tables[n] is not None and (n, layer) not in self._issued \
                and not self.tables[n].layers[layer].transfers.stale:
            self._issue(n, layer, owned)

    def _owned_params(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The layer's expert parameters as the module holds them now (FSDP's unsharded ones in backward)."""
        e = self.layers[layer].routed_experts.inner_experts
        return e.w1_EFD, e.w2_EDF, e.w3_EFD

    def _gate_hook(self, layer: int):
        def hook(module, args, kwargs):
            if self.plan is None or not torch.is_grad_enabled():
                return None
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    return (*args[:i], _GradGate.apply(self.engine, layer, a), *args[i + 1:]), kwargs
            return None
        return hook

    def finish_gradients(self) -> None:
        """Complete gradient returns still in flight (no block hook caught them); refused under FSDP, whose
        reduce-scatter has already run."""
        for layer in self.engine.gradients_in_flight:
            if any(isinstance(p, DTensor) for p in self._owned_params(layer)):
                raise RuntimeError(f"layer {layer}: replica gradients returned after FSDP's reduce-scatter")
            self.engine.finish_gradients(layer)

    def _dtype(self, layer: int) -> torch.dtype:
        return self.layers[layer].routed_experts.inner_experts.compute_dtype

    # -- transfers ------------------------------------------------------------------
    def _ensure_layout(self, m: int) -> None:
        """Micro-step m runs on the owners it was planned with: re-lay out first if they differ."""
        if self.layout is None or m >= len(self.tables):
            return
        need = self.plan.layout_owner_MLE[m]
        pending = self.layout.pending_owner_LE
        if not np.array_equal(need, self.layout.owner_LE) or pending is not None and np.array_equal(need, pending):
            if any(mm >= m for mm, _ in self._issued):
                raise RuntimeError(f"micro-step {m}: transfers issued before the re-layout they depend on")
            before = self.layout.owner_LE
            self.layout.move_to(need)
            if not np.array_equal(before, self.layout.owner_LE):
                self.weights_changed()  # host copies of this rank's experts are of the old rows

    def prefetch(self, m: int) -> None:
        """Issue micro-step m's replica transfers into its bank, for the layers not issued yet whose owned
        experts are readable without a gather; the rest are deferred to their forward. No-op past the stage, and
        for a lazily planned micro-step not taken yet (``_resolve`` issues it at its entry)."""
        if self.plan is None or m >= len(self.tables) or self.tables[m] is None:
            return
        self._ensure_layout(m)
        for layer in range(len(self.layers)):
            if (m, layer) in self._issued:
                continue
            owned = self._owned_if_free(layer)
            if owned is not None:
                self._issue(m, layer, owned)

    @contextmanager
    def micro_step(self, m: int):
        """Within the block every MoE layer dispatches and computes by micro-step m's plan."""
        if self.tables[m] is None:
            self._resolve(m)
        if self._lazy_ahead and m + 1 < len(self.tables) and self.tables[m + 1] is None:
            self._resolve(m + 1, issue=False)  # m's layers issue m + 1's transfers, as in a stage planned whole
        self._ensure_layout(m)
        with self.installed([
            _Placement(self.engine, layer, self.tables[m].layers[layer], self._bank(m), runtime=self, micro=m,
                       route_bad=None if self.route_bad_ML is None else self.route_bad_ML[m, layer])
            for layer in range(len(self.layers))
        ]):
            yield

    @contextmanager
    def installed(self, placements: list[ActivePlacement]):
        """Each MoE layer dispatches and computes through its placement within the block; gradient returns
        still in flight are finished at its end."""
        self._active = placements
        for moe, ap in zip(self.layers, placements):
            moe.routed_experts.token_dispatcher.placement = ap
            moe.routed_experts.inner_experts.placement = ap
        try:
            yield
            self.finish_gradients()
        finally:
            self.engine.drop_landing_watches()
            for moe in self.layers:
                moe.routed_experts.token_dispatcher.placement = None
                moe.routed_experts.inner_experts.placement = None

    def report(self, m: int) -> MicroStepReport:
        """Rows each layer's dispatcher delivered to this rank in the last ``micro_step(m)``, vs the plan."""
        t = self.tables[m]
        stats = self.engine.take_stats()  # spans whose events completed (the rest: a later report)
        return MicroStepReport(
            [ap.received_rows for ap in self._active], t.planned_rows_L.tolist(), t.replicas_L.tolist(),
            [ap.expert_timer for ap in self._active], stats,
        )

    def end_stage(self, failed: bool = False) -> None:
        """Land what is in flight, drop the stage and read its route checks (together with every rank).
        ``failed`` (an exception is unwinding the stage): drop it without waits or collectives, which the other
        ranks, elsewhere in their stage, would never match (a hang instead of this rank's error)."""
        if not failed:
            for layer in range(len(self.layers)):
                self.engine.wait(layer)
        self.engine.drop_landing_watches()
        if self.plan is not None:
            self._bank_base = (self._bank_base + len(self.tables)) % 2
        self.plan = None
        self.tables = []
        self._lazy = None  # micro-steps still planning finish in the worker; their results are dropped
        self._lazy_ahead = False
        self._issued = set()
        self.engine.stage_indices = {}
        if failed:
            self.route_bad_ML = None
            return
        self._check_route_flags()


def plan_digests(plan: StagePlan, loads_MLSE: np.ndarray, micro_steps: list[int] | None = None) -> dict[str, object]:
    """What every rank of an EP group must hold identically for a stage (or its ``micro_steps``), one key per
    (array, micro-step, layer) (a linear digest: one vectorized pass over each array) and per micro-step's
    transfers."""
    M, L = plan.assign_MLER.shape[:2]
    ms = list(range(M)) if micro_steps is None else list(micro_steps)
    items: dict[str, object] = {}
    for array, a in (("slots", plan.slots_MLRC), ("assignment", plan.assign_MLER), ("owners", plan.owner_MLE),
                     ("loads", loads_MLSE)):
        rows = a if len(ms) == M else np.asarray(a)[ms]
        items.update({f"{array} of micro-step {ms[i // L]} layer {i % L}": int(d)
                      for i, d in enumerate(agreement.row_digests(rows, len(ms) * L))})
    tr = plan.transfers_T
    items.update({f"transfers of micro-step {m}": tr[tr["micro_step"] == m] for m in ms})
    items["balancer"] = plan.balancer
    return items


class _GradGate(torch.autograd.Function):
    """Identity on a block's input; its backward completes the layer's gradient return (before FSDP's)."""

    @staticmethod
    def forward(ctx, engine, layer, x):
        ctx.engine, ctx.layer = engine, layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.engine.finish_gradients(ctx.layer)
        return None, None, g


@dataclass
class _Placement(ActivePlacement):
    """``ActivePlacement`` that lets the runtime issue transfers from inside the layer's forward."""

    runtime: PlacementRuntime | None = None
    micro: int = 0

    def slot_weights(self, owned: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        if self.recompute:  # activation checkpointing: the forward issued this layer's transfers
            return super().slot_weights(owned, dtype)
        self.runtime._in_forward(self.micro, self.layer, owned, after_use=False)
        out = super().slot_weights(owned, dtype)
        self.runtime._in_forward(self.micro, self.layer, owned, after_use=True)
        return out
