"""The trainer's sequence layout in the simulator: the runtime's ``schedule_sequences``, packed or padded.

The rollout deals ``updates_per_rollout x global_batch`` responses as ``workload.py`` does (rank g * ep + s holds
``responses_per_microstep / ep`` rows per micro-step, in rollout order); the step's schedule
(``titan_foremoe.schedule``, the same function the trainer calls) then puts every sequence on a (rank, micro-step),
over all ranks at once (sequences cross EP groups), and each group's work is built from the cells it got:
expert loads from the real tokens (padding is never routed), dense and attention work from the positions the
runtime computes: packed, the real tokens and each sequence's causal pairs; padded (``pack=False``), every row of a
rank's micro-batch as long as its longest (``rows x longest`` positions, ``rows x longest (longest + 1) / 2`` pairs).

Legend: N sequences of the rollout, U optimizer steps, M micro-steps per optimizer step, R ranks (all groups),
G EP groups of S = ep ranks, X = U * M * R cells, L layers, E experts, T trace tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..planner.synthetic import MODEL_SHAPES, synthetic_loads, synthetic_tokens
from ..planner.trace import load_trace
from ..schedule import DenseCost, SequenceSchedule, schedule_sequences
from ..schedule.types import busiest_over_mean
from .workload import GroupWork, RLSchedule, _responses

LENGTHS_HELP = "lognormal:MEDIAN:SIGMA:CAP"


@dataclass(frozen=True)
class SequenceLayout:
    """How the trainer lays out its micro-steps: ``[rl] sequence_schedule`` and ``[training] pack_sequences``.

    ``lengths``: synthetic response lengths, (median, sigma, cap) of a log-normal (None: the synthetic model's
    per-source lengths, ``planner.synthetic``)."""

    policy: str = "balanced"
    pack: bool = True
    lengths: tuple[float, float, int] | None = None
    cost: DenseCost = field(default_factory=DenseCost)
    max_tokens: int | None = None  # [training] max_tokens_per_micro_step: micro-steps formed by this per-rank budget


def flops_cost(model) -> DenseCost:
    """``DenseCost`` in forward FLOPs of a ``models.ModelSpec``, over all layers: per position the dense work
    (projections, router, shared / dense MLPs, head) plus the routed experts' ``top_k x expert FLOPs`` per MoE
    layer, per causal pair the attention core: what the simulator charges.

    Why the experts: the planner levels expert work within an EP group, not across groups, so a group's expert
    work and all-to-all follow the tokens its ranks hold; levelling dense work alone leaves the groups' tokens apart
    and the busiest group sets every MoE layer's time."""
    L, D = model.moe_layers, model.dense_layers
    token = (L * (model.layer_dense_flops(True) + model.top_k * model.expert_flops_per_token())
             + D * model.layer_dense_flops(False) + model.head_flops())
    return DenseCost(token=token, pair=(L + D) * model.attn_pair_flops())


def parse_lengths(spec: str | None) -> tuple[float, float, int] | None:
    """``lognormal:MEDIAN:SIGMA:CAP`` -> (median, sigma, cap); one clear line when malformed."""
    if spec is None:
        return None
    bad = ValueError(f"--response-lengths {spec!r}: expected {LENGTHS_HELP} with MEDIAN >= 1, SIGMA >= 0, "
                     f"integer CAP >= 1 (e.g. lognormal:1500:1.0:8192)")
    parts = spec.split(":")
    if len(parts) != 4 or parts[0] != "lognormal":
        raise bad
    try:
        median, sigma, cap = float(parts[1]), float(parts[2]), int(parts[3])
    except ValueError:
        raise bad from None
    if not (median >= 1 and sigma >= 0 and cap >= 1):
        raise bad
    return median, sigma, cap


def lognormal_lengths(n: int, median: float, sigma: float, cap: int, seed: int) -> np.ndarray:
    """n response lengths, log-normal around ``median``, capped at ``cap``, at least 1; seeded."""
    x = np.random.default_rng(seed).lognormal(np.log(median), sigma, n)
    return np.clip(np.rint(x), 1, cap).astype(np.int64)


def rollout_sources(groups: int, ep: int, sched: RLSchedule) -> tuple[np.ndarray, np.ndarray, int]:
    """(source rank, optimizer step) of every response in rollout order (u, g, m, s, row), rows per micro-step."""
    mps = sched.micro_steps_per_step(groups)
    B, U = sched.responses_per_microstep, sched.updates_per_rollout
    if B % ep:
        raise ValueError(f"responses per micro-step ({B}) must be a multiple of ep ({ep})")
    u, g, _, s, _ = np.unravel_index(np.arange(U * groups * mps * B), (U, groups, mps, ep, B // ep))
    return g * ep + s, u, B // ep


def schedule_rollout(tokens_N: np.ndarray, groups: int, ep: int, sched: RLSchedule, layout: SequenceLayout,
                     loads_NE: np.ndarray | None = None) -> SequenceSchedule:
    """The step's schedule over all ``groups * ep`` ranks, as the trainer computes it."""
    source_N, minibatch_N, rows = rollout_sources(groups, ep, sched)
    if layout.max_tokens is not None:
        kw = {"max_tokens": layout.max_tokens}
    elif layout.policy == "rollout_order":
        kw = {"rows_per_micro": rows}
    else:
        kw = {"micro_steps": sched.micro_steps_per_step(groups)}
    return schedule_sequences(tokens_N, minibatch_N, source_N, ranks=groups * ep, policy=layout.policy,
                              cost=layout.cost, loads_NE=loads_NE, ep=ep, **kw)


def _group_rows(a_X: np.ndarray, s: SequenceSchedule, g: int, ep: int) -> np.ndarray:
    """``[U * M, S]`` rows of the cells of group g's ranks."""
    return a_X.reshape(s.minibatches * s.micro_steps, s.ranks)[:, g * ep : (g + 1) * ep]


def _works(s: SequenceSchedule, tokens_N: np.ndarray, source_N: np.ndarray, pack: bool, ep: int, groups: int,
           loads_of) -> list[GroupWork]:
    """One ``GroupWork`` per EP group from its ranks' cells; ``loads_of(g, real_tokens_MS)`` gives its loads.
    ``response_lens``: the responses the group's engines generated (the rollout runs before the schedule)."""
    cw = s.cell_work(tokens_N, padded=not pack)
    work = []
    for g in range(groups):
        rows = {k: _group_rows(v, s, g, ep).copy() for k, v in cw.items()}
        work.append(GroupWork(loads_of(g, rows["real_tokens"]), rows["tokens"], rows["pairs"],
                              tokens_N[source_N // ep == g], rows["real_tokens"], rows["real_pairs"]))
    return work


def scheduled_trace_work(path: str, ep: int, groups: int, sched: RLSchedule, seed: int, layout: SequenceLayout,
                         num_experts: int | None = None) -> tuple[list[GroupWork], int, SequenceSchedule]:
    """``workload.trace_work``'s responses (same seeded draw), laid out by the trainer's schedule.

    With ``rollout_order`` and packing it equals ``trace_work`` exactly. Loads per group: O(group's T * L * k).
    """
    if layout.lengths is not None:
        raise ValueError("--response-lengths applies to --synthetic loads; a trace brings its own lengths")
    experts, offsets, E = load_trace(path, num_experts)
    if E % ep:
        E = -(-E // ep) * ep  # never-used experts pad E to divide over the EP ranks (as trace_work)
    n, L = len(offsets) - 1, experts.shape[1]
    resp_N = _responses(n, sched.updates_per_rollout * sched.global_batch, seed)
    lens = np.diff(offsets)
    tokens_N = lens[resp_N]
    # each response's expert signature (token-expert counts summed over layers) for the schedule's tie-break
    owner_T = np.repeat(np.arange(n), lens)
    sig_nE = sum(np.bincount((owner_T[:, None] * E + experts[:, l].astype(np.int64)).ravel(), minlength=n * E)
                 for l in range(L)).reshape(n, E)
    s = schedule_rollout(tokens_N, groups, ep, sched, layout, sig_nE[resp_N])
    source_N = rollout_sources(groups, ep, sched)[0]
    M = s.minibatches * s.micro_steps

    def loads_of(g: int, _real) -> np.ndarray:
        mine = np.flatnonzero(s.rank_N // ep == g)
        m_N, src_N = s.minibatch_N[mine] * s.micro_steps + s.micro_N[mine], s.rank_N[mine] % ep
        r, ln = resp_N[mine], lens[resp_N[mine]]
        tok = np.repeat(offsets[r] - np.cumsum(ln) + ln, ln) + np.arange(ln.sum())
        m, src = np.repeat(m_N, ln), np.repeat(src_N, ln)
        ex = experts[tok].astype(np.int64)  # [T, L, k]
        idx = ((m[:, None, None] * L + np.arange(L)[None, :, None]) * ep + src[:, None, None]) * E + ex
        return np.bincount(idx.ravel(), minlength=M * L * ep * E).reshape(M, L, ep, E)

    return _works(s, tokens_N, source_N, layout.pack, ep, groups, loads_of), E, s


def scheduled_synthetic_work(model: str, ep: int, groups: int, sched: RLSchedule, seed: int, layout: SequenceLayout,
                             skew: float = 0.8) -> tuple[list[GroupWork], int, SequenceSchedule]:
    """Synthetic loads laid out by the trainer's schedule. Lengths: the synthetic model's (each source's responses
    of a micro-step share one, as ``workload.synthetic_work``) or ``layout.lengths``' log-normal, one per response.

    A cell's routes are drawn from its (micro-step, source) popularity (``planner.synthetic``) for the tokens the
    schedule put there: synthetic routes carry no per-response identity. With ``rollout_order``, packing and the
    model's lengths it equals ``synthetic_work`` exactly.
    """
    shp = MODEL_SHAPES[model]
    mps, U = sched.micro_steps_per_step(groups), sched.updates_per_rollout
    source_N, _, per = rollout_sources(groups, ep, sched)
    if layout.lengths is None:
        n_GMS = np.stack([synthetic_tokens(model, U * mps, ep, per, seed + 1000 * g, skew) // per
                          for g in range(groups)])
        u, g, m, src, _ = np.unravel_index(np.arange(len(source_N)), (U, groups, mps, ep, per))
        tokens_N = n_GMS[g, u * mps + m, src]
    else:
        tokens_N = lognormal_lengths(len(source_N), *layout.lengths, seed=seed + 7919)
    s = schedule_rollout(tokens_N, groups, ep, sched, layout)
    M = s.minibatches * s.micro_steps  # the layout's micro-steps (a token budget sets its own)

    def loads_of(g: int, real_MS: np.ndarray) -> np.ndarray:
        return synthetic_loads(model, M, ep, per, seed + 1000 * g, skew, tokens_MS=real_MS.astype(np.int64))

    return _works(s, tokens_N, source_N, layout.pack, ep, groups, loads_of), shp.num_experts, s


def layout_metrics(work: list[GroupWork], level: bool = False) -> dict:
    """Cluster-wide, per micro-step: the busiest rank's computed tokens (pairs) over the mean rank's real ones,
    averaged over micro-steps with work, and the padded share of all computed positions. ``level``: the ideal's
    (every rank the mean): 1.0 and 0."""
    cat = {k: np.concatenate([getattr(w, k) if getattr(w, k) is not None else getattr(w, k.replace("real_", ""))
                              for w in work], axis=1)
           for k in ("tokens_MS", "pairs_MS", "real_tokens_MS", "real_pairs_MS")}
    out = {f"{name}_max_over_mean": 1.0 if level else busiest_over_mean(cat[comp], cat[real])
           for name, comp, real in (("tokens", "tokens_MS", "real_tokens_MS"), ("pairs", "pairs_MS", "real_pairs_MS"))}
    total = cat["tokens_MS"].sum()
    out["padding_fraction"] = 0.0 if level or total == 0 else float(1.0 - cat["real_tokens_MS"].sum() / total)
    return out


def levelled(work: list[GroupWork]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The ideal's dense inputs: per micro-step every rank of every group gets the cluster's mean real tokens and
    pairs (packed and levelled)."""
    real = [(w.real_tokens_MS if w.real_tokens_MS is not None else w.tokens_MS,
             w.real_pairs_MS if w.real_pairs_MS is not None else w.pairs_MS) for w in work]
    tok_M = np.concatenate([t for t, _ in real], axis=1).mean(axis=1, keepdims=True)
    pair_M = np.concatenate([p for _, p in real], axis=1).mean(axis=1, keepdims=True)
    return [(np.broadcast_to(tok_M, t.shape).copy(), np.broadcast_to(pair_M, p.shape).copy()) for t, p in real]
