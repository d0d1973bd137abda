"""The synchronous stages planned one micro-step at a time: the recompute's micro-step 0 before it starts, the rest
in the planner's worker while it runs; the update's micro-steps all in the worker after them, each optimizer
step's first one planned fresh (``plan_lazily(first_in_worker=True, micro_steps_per_step=)``), the runtime taking
micro-step m + 1 at m's entry.

Why: with ``[rl] max_staleness = 0`` the recompute stage starts right after its loads are known, so whatever is
planned before it is on the critical path: Python planning is ~10-45 ms per micro-step at EP 8 (Qwen3-30B-A3B
shape), M x that per RL step when the whole stage is planned first. foremoe plans micro-step by micro-step with
the previous one's slots as its only state (``plan_stage(resume_slots_LRC=)``), and compiles this rank's tables
with the previous micro-step's bank rows as theirs (``compile_micro_step(prev_rows_LC=)``). So micro-step 0 is
planned and compiled on the training thread (``plan_lazily``), micro-steps 1..M-1 are queued in the planner's
worker, before the update stage's plan, each continuing the last (``_plan_micro``: the chain's state stays in the
worker), and the runtime takes micro-step m's plan and tables at ``micro_step(m)``'s entry (``LazyStage.take``;
``PlacementRuntime._resolve``), where it checks them on the EP group and issues m's transfers. The assembled
plan is the whole stage's, array for array (``tests/test_lazy_recompute.py``, ``plan_stage`` as the oracle).

Cost: the training thread plans and compiles one micro-step instead of M (Qwen3-30B-A3B, M = 4: 58.9 -> 15.6 ms
at EP 8, 197.5 -> 53.9 ms at EP 64, ``benchmarks/bench_lazy_recompute.py``; at EP 8 35.5 -> 9.2 ms since the
planner's slot-time lookup, 3M-addition loop 0.15 s; EP 256 / 1024 not measured: the plan
grows with R); per micro-step m >= 1 it waits for the worker only by what m's plan exceeds micro-step m - 1 (host
time, no device sync) and runs one more agreement check (``PlacementRuntime.check_agreement``: one all-to-all of
R int64, one all-reduce of 6 int64). Memory: the whole stage's plan arrays, as before. The worker pickles
``loads_MLSE[m]`` in and (plan, tables) of one micro-step out in process mode (Qwen3-30B-A3B, R = 64: 3 MB of
``assign`` + ~0.3 MB of tables per micro-step).

Legend: M micro-steps, L layers, S source ranks, E experts, R ranks, C slots per rank.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from ..planner.balancers import plan_stage
from ..planner.owners import contiguous_owners, physical_rows_LE
from ..planner.types import TRANSFER_DTYPE, StagePlan
from .tables import RankTables, compile_micro_step, compile_stage

_CHAINS: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # the worker's: (slots, bank rows) a chain continues from
_NEXT_CHAIN = itertools.count()


@dataclass(frozen=True)
class MicroStepJob:
    """What every micro-step of a lazily planned stage is planned and compiled with (picklable)."""

    balancer: str
    topology: object
    config: object
    cost: object
    owner_ZLE: np.ndarray  # the owners of each of the stage's optimizer steps, decided before it
    initial_owner_LE: np.ndarray  # the owners in effect before it (where micro-step 0's replicas come from)
    rank: int
    host_intra: bool
    host_inter: bool
    micro_steps_per_step: int  # an optimizer step's micro-steps: each step's first is planned fresh (a boundary)


def _plan_micro(chain: str, m: int, job: MicroStepJob, loads_1LSE: np.ndarray, start, last: bool):
    """In the worker: micro-step m's plan (one micro-step, its transfers numbered 0) and this rank's tables,
    continuing the chain's previous micro-step (``start``: micro-step 0's (slots, bank rows), for m = 1). The first
    micro-step of an optimizer step is a boundary: planned fresh from the previous step's owners (replicas hold
    the old weights: its tables are stale), as ``plan_stage`` plans a whole stage; the stage's micro-step 0 has
    no previous one."""
    state = start if start is not None else _CHAINS.pop(chain, None)
    if state is None and m > 0:
        raise RuntimeError(f"micro-step {m - 1}'s plan failed before it, so micro-step {m} has nothing to continue")
    prev_slots_LRC, prev_rows_LC = state if state is not None else (None, None)
    z, boundary = m // job.micro_steps_per_step, m % job.micro_steps_per_step == 0
    owner_LE = job.owner_ZLE[z]
    before_LE = owner_LE if not boundary else job.owner_ZLE[z - 1] if z > 0 else job.initial_owner_LE
    plan = plan_stage(job.balancer, loads_1LSE, job.topology, job.config, job.cost, micro_steps_per_step=1,
                      initial_owner_LE=before_LE, owners_ZLE=owner_LE[None],
                      resume_slots_LRC=None if boundary else prev_slots_LRC)
    R = job.topology.num_ranks
    tables = compile_micro_step(
        plan.slots_MLRC[0], plan.assign_MLER[0], loads_1LSE[0], job.rank, job.topology.ranks_per_node,
        prev_slots_LRC=prev_slots_LRC, moves_T=plan.transfers_T, stale=boundary, host_intra=job.host_intra,
        host_inter=job.host_inter, row_LE=physical_rows_LE(plan.layout_owner_MLE[0], R), prev_rows_LC=prev_rows_LC)
    if not last:
        _CHAINS[chain] = (plan.slots_MLRC[0], tables.bank_row_LC)
    return plan, tables


def _plan_rest(chain: str, job: MicroStepJob, loads_1LSE: np.ndarray, first_state, last: bool):
    """In the worker: micro-step 0's layers from ``k`` on (``loads_1LSE`` holds only those; planning is per layer
    within a micro-step), this rank's tables of them, and the whole micro-step 0's (slots, bank rows) for the
    chain's micro-step 1 (``first_state``: those of layers < k)."""
    k = first_state[0].shape[0]
    plan = plan_stage(job.balancer, loads_1LSE, job.topology, job.config, job.cost, micro_steps_per_step=1,
                      initial_owner_LE=job.initial_owner_LE[k:], owners_ZLE=job.owner_ZLE[:1, k:])
    tables = compile_stage(plan, loads_1LSE, job.rank, host_intra=job.host_intra, host_inter=job.host_inter)[0]
    if not last:
        _CHAINS[chain] = (np.concatenate([first_state[0], plan.slots_MLRC[0]]),
                          np.concatenate([first_state[1], tables.bank_row_LC]))
    return plan, tables


def join_layers(a: RankTables, b: RankTables) -> RankTables:
    """One micro-step's tables of layers [0, k) and [k, L) as one (each layer's tables are its own)."""
    return RankTables(a.rank, [*a.layers, *b.layers], max(a.num_bank_rows, b.num_bank_rows),
                      np.concatenate([a.replicas_L, b.replicas_L]),
                      np.concatenate([a.planned_rows_L, b.planned_rows_L]),
                      np.concatenate([a.bank_row_LC, b.bank_row_LC]))


class LazyStage:
    """A stage planned micro-step by micro-step in the planner's worker, taken by the runtime at each entry.

    ``plan``: the whole stage's ``StagePlan`` (owners from the start), micro-step m's rows filled by ``take(m)``,
    micro-step 0's layers from ``k`` on by ``take_rest()``; ``first``: micro-step 0's tables of layers < k, planned
    on the training thread (None: micro-step 0 is in the worker too, ``take(0)``); ``rest``: future of (plan,
    tables) of micro-step 0's layers >= k (None: k = L); ``pending[m]``: of micro-step m."""

    def __init__(self, plan: StagePlan, first: RankTables | None, pending: dict[int, Future],
                 rest: Future | None = None):
        self.plan, self.first, self.pending, self.rest = plan, first, pending, rest
        self.k = len(first.layers) if first is not None else 0

    def take_rest(self) -> tuple[RankTables | None, str | None]:
        """(micro-step 0's tables of all layers, None), its layers >= k written into ``plan``; (None, the
        worker's error as one line). Waits for the worker (host only)."""
        try:
            part, tables = self.rest.result()
        except Exception as e:  # noqa: BLE001 - any failure of the worker becomes the stage's one clear error
            return None, (f"micro-step 0's layers {self.k}.. failed to plan in the planner's worker: "
                          f"{type(e).__name__}: {e}")
        p, k = self.plan, self.k
        p.slots_MLRC[0, k:], p.assign_MLER[0, k:] = part.slots_MLRC[0], part.assign_MLER[0]
        p.plan_ms_M[0] += part.plan_ms_M[0]
        tr = part.transfers_T.copy()
        tr["layer"] += k
        p.transfers_T = np.concatenate([p.transfers_T, tr])
        return join_layers(self.first, tables), None

    def take(self, m: int) -> tuple[RankTables | None, str | None]:
        """(micro-step m's tables, None) with its rows written into ``plan``; (None, the worker's error as one
        line) if its planning failed. Waits for the worker (host only)."""
        try:
            part, tables = self.pending[m].result()
        except Exception as e:  # noqa: BLE001 - any failure of the worker becomes the stage's one clear error
            return None, f"micro-step {m}'s plan failed in the planner's worker: {type(e).__name__}: {e}"
        p = self.plan
        if m == 0 and self.first is None:  # micro-step 0 planned in the worker: the plan's facts are its
            p.info = {**part.info, "micro_steps_per_step": p.info["micro_steps_per_step"]}
        p.slots_MLRC[m], p.assign_MLER[m], p.owner_MLE[m] = part.slots_MLRC[0], part.assign_MLER[0], part.owner_MLE[0]
        p.plan_ms_M[m] = part.plan_ms_M[0]
        tr = part.transfers_T.copy()
        tr["micro_step"] = m
        p.transfers_T = np.concatenate([p.transfers_T, tr])
        return tables, None


def plan_lazily(planner, balancer: str, loads_MLSE: np.ndarray, topology, config, cost, rank: int,
                host_intra: bool, host_inter: bool, initial_owner_LE=None, owners_ZLE=None,
                first_layers: int | None = None, micro_steps_per_step: int | None = None,
                first_in_worker: bool = False) -> LazyStage:
    """Plan and compile micro-step 0's first ``first_layers`` layers here (the training thread; default all), queue
    its other layers, then micro-steps 1..M-1, in ``planner`` (``StagePlanner``); with ``first_in_worker`` queue
    micro-step 0 whole too (a stage planned while an earlier one runs: the update). The runtime takes micro-step 0
    whole: its layers are planned and compiled vectorized, so a part costs far more than its share (Qwen3-30B-A3B,
    EP 8: 1 / 6 / 12 / 24 / 48 of 48 layers 3.7 / 5.1 / 10.3 / 11.5 / 15.1 ms, ``benchmarks/bench_lazy_recompute.py
    --first-layers k``): ~5 ms per step saved at EP 8 for taking the rest at a layer's dispatch (the two parts are
    exact, ``tests/test_lazy_recompute.py``; a runtime taking the rest at layer k's dispatch seam: commit 763732c,
    reverted). ``micro_steps_per_step`` (default M: one optimizer step, the recompute): each step's first
    micro-step is planned fresh from the step before's owners; ``owners_ZLE``: each step's owners (default
    contiguous; balanced owners are decided over every EP group before the stage: a plan that decides them from
    the stage's own loads cannot be split)."""
    M, L, _, E = loads_MLSE.shape
    mps = M if micro_steps_per_step is None else int(micro_steps_per_step)
    if mps < 1 or M % mps:
        raise ValueError(f"{M} micro-steps do not split into optimizer steps of {mps}")
    Z = M // mps
    if owners_ZLE is None and getattr(config, "owner_policy", "contiguous") == "balanced":
        raise ValueError("a lazily planned stage needs its owners decided before it (owners_ZLE)")
    owner_ZLE = (np.asarray(owners_ZLE) if owners_ZLE is not None
                 else np.repeat(contiguous_owners(L, E, topology.num_ranks)[None], Z, axis=0))
    if len(owner_ZLE) < Z:
        raise ValueError(f"owners for {len(owner_ZLE)} optimizer steps, the stage has {Z}")
    owner_ZLE = owner_ZLE[:Z]
    now_LE = (np.asarray(initial_owner_LE) if initial_owner_LE is not None
              else contiguous_owners(L, E, topology.num_ranks))
    job = MicroStepJob(balancer, topology, config, cost, owner_ZLE, now_LE, rank, host_intra, host_inter, mps)
    chain = f"{os.getpid()}-{next(_NEXT_CHAIN)}"
    owner_MLE = np.repeat(owner_ZLE, mps, axis=0)
    if first_in_worker:
        C = E // topology.num_ranks + config.resolve_spare(E, topology.num_ranks)
        plan = StagePlan(balancer, np.full((M, L, topology.num_ranks, C), -1, dtype=np.int64),
                         np.zeros((M, L, E, topology.num_ranks), dtype=np.int64), owner_MLE,
                         np.zeros(0, dtype=TRANSFER_DTYPE), np.zeros(M), topology, {"micro_steps_per_step": mps})
        pending = {m: planner.call(_plan_micro, chain, m, job, loads_MLSE[m : m + 1], None, m == M - 1)
                   for m in range(M)}
        return LazyStage(plan, None, pending)
    k = L if first_layers is None else min(max(int(first_layers), 1), L)
    first = plan_stage(balancer, loads_MLSE[:1, :k], topology, config, cost, micro_steps_per_step=1,
                       initial_owner_LE=now_LE[:k], owners_ZLE=owner_ZLE[:1, :k])
    tables = compile_stage(first, loads_MLSE[:1, :k], rank, host_intra=host_intra, host_inter=host_inter)[0]
    slots = np.full((M, L, *first.slots_MLRC.shape[2:]), -1, dtype=first.slots_MLRC.dtype)
    assign = np.zeros((M, L, *first.assign_MLER.shape[2:]), dtype=first.assign_MLER.dtype)
    slots[0, :k], assign[0, :k] = first.slots_MLRC[0], first.assign_MLER[0]
    plan_ms = np.zeros(M)
    plan_ms[0] = first.plan_ms_M[0]
    plan = StagePlan(first.balancer, slots, assign, owner_MLE, first.transfers_T.copy(),
                     plan_ms, first.topology, {**first.info, "micro_steps_per_step": mps})
    start = (first.slots_MLRC[0], tables.bank_row_LC)
    rest = planner.call(_plan_rest, chain, job, loads_MLSE[:1, k:], start, M == 1) if k < L else None
    pending = {m: planner.call(_plan_micro, chain, m, job, loads_MLSE[m : m + 1],
                               start if m == 1 and rest is None else None, m == M - 1) for m in range(1, M)}
    return LazyStage(plan, tables, pending, rest)
