"""The trainer takes a step's rows as soon as enough have finished (``[rl] take_first_finished = true``, with
``max_staleness = k`` > 0): a mixin of ``VLLMSource`` over ``InFlightQueue`` (``in_flight.py``).

With k steps in flight step N otherwise waits for all of step N's requests, its slowest response. Here every
started step's requests form one pool of prompt groups (a prompt's ``samples_per_prompt`` samples: GRPO needs
whole groups), each landing as soon as its samples are back (``fleet/client.py``), and step N takes:

- **which** (``select``, pure; brute-forced in tests/test_in_flight.py): among the finished groups not taken yet,
  a group whose weights are more than k steps older than N is dropped (counted in ``rollout/dropped_stale``;
  it can never become fresh); of the others the first G in (step, index) order, oldest step first, G the groups a
  step holds per rank (fixed per-rank batch: every rank takes G). Groups not taken stay in the pool for later
  steps.
- **when**: as soon as this rank's pool holds G such groups (each rank waits on its own pool, polling every 5 ms),
  then one collective round (``_assemble``): one all-reduce of [short, the pool's threads alive, ...] agrees
  whether every rank has enough (``poll(wait=False)`` returns None otherwise) and which generations have ended
  everywhere; those are finished collectively (a failed engine's requests re-dealt, ``FleetClient.finish``). A rank
  short after its own threads ended makes every rank finish the oldest generation in turn until it has enough.
  The trainer takes step N + 1 at ``poll(N + 1)`` after step N's update (or at step N + 1's start), so the
  pool then holds the steps up to N + k: k groups per rank for every one taken.
- **short** (only after drops, e.g. at the last steps): once every generation is finished and a rank still holds
  fewer than G fresh groups, the prompts of its most recently dropped groups are generated again from the
  engines recent enough for step N (one collective generation; every rank takes part).
- **metadata**: every row keeps its engine, served version and per-row version (``_build``); the taken rows are
  one ``InFlight`` of step N in (step, index) order, built once (dumped under step N).
- **checkpoint**: a save waits for every generation and writes the pool (every started step's groups with a
  taken mask) and the steps already taken but not trained; a resume trains those on exactly the saved rows, and
  takes the next ones from the saved pool, every group finished: by (step, index) order, as the saving run did
  whenever the pool held G fresh groups (it does for k >= 2: the save leaves k - 1 steps' groups in it).

Metrics: ``rollout/taken_from_later_steps`` (groups of a step after N trained at N, summed over ranks),
``rollout/wait_saved_s`` (for the last step whose own generation ended after it was taken: how much sooner it
was taken, the mean over ranks), ``rollout/wait_s`` (how long this rank blocked in the take).

Cost at R = 64 / 256 / 1024 ranks (Qwen3-30B-A3B, G = 2 prompts x 8 samples per rank, 4k-token responses): the
pool holds at most k + 1 steps' groups per rank (as k steps in flight do: ~25 MB of engine rows per step, the
taken ones built once, ~200 MB as int64 routes), < 1.3 GB at k = 4 whatever R. Host syncs per taken step: one
all-reduce of (k + 4) floats per collective round (one round when every rank has enough; a short rank adds one
per generation it waits for) and one of (k + 4) at the take (metrics, and which steps no rank holds a group of any
more: a step leaves every rank's queue at once), none per micro-step; the generations' own syncs (deal, failure flag, metrics) are
unchanged. The selection is a sort of the pool's (k + 1) G groups per rank: microseconds.

Legend: G groups per step per rank, k ``max_staleness``.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
import torch.distributed as dist

from ...distributed import collectives
from .base import RolloutBatch
from .in_flight import InFlight, StaleRollout, eligible_K

logger = logging.getLogger("titan_foremoe")

POLL_S = 0.005


def select(step: int, k: int, G: int, steps_P: np.ndarray, index_P: np.ndarray, finished_P: np.ndarray,
           versions_P: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """Step ``step``'s groups from a pool of P free ones (not taken nor dropped; each: its step, index, finished,
    weights version (the oldest of its samples)): (positions of the G taken in (step, index) order, or None when
    fewer than G are finished and fresh; positions dropped as stale now)."""
    ready = np.asarray(finished_P, bool)
    stale = ready & (step - np.asarray(versions_P) > k)
    fresh = np.flatnonzero(ready & ~stale)
    if len(fresh) < G:
        return None, np.flatnonzero(stale)
    order = np.lexsort((np.asarray(index_P)[fresh], np.asarray(steps_P)[fresh]))
    return fresh[order[:G]], np.flatnonzero(stale)


def _done(f: InFlight) -> list:
    """``f``'s groups as they stand: the finished ones, None while unanswered."""
    return list(f.groups) if f.groups is not None else list(f.dealt.groups) if f.dealt is not None else []


class FirstFinishedPool:
    """Overrides ``InFlightQueue``'s take / poll / collect / save / load when ``take_first_finished`` (module
    docstring); every other case goes to the queue unchanged."""

    def _init_pool(self, on: bool) -> None:
        self.first_finished = on
        self.taken: dict[int, InFlight] = {}  # step -> its rows, taken from the pool, not trained yet
        self.sizes: dict[int, int] = {}  # step -> groups per rank it was started with (G)
        self.spare: list[tuple] = []  # (example, prompt) of dropped groups: generated again when short
        self.take_t: dict[int, float] = {}  # step -> when it was taken (``wait_saved_s``)
        self.wait_saved = 0.0
        self.pool_metrics: dict[int, dict] = {}  # step -> its take's metrics (every rank the same)
        self.taking: dict = {}  # the metrics of the step being taken (``async_metrics``)

    # -- the pool ---------------------------------------------------------------------------------
    def _pool(self) -> tuple[list[tuple[InFlight, int]], tuple]:
        """The free groups (not taken nor dropped) of every started step: (step's InFlight, index) each, and
        ``select``'s arrays of them (steps, index, finished, versions) plus the groups (None: running)."""
        pool = [(f, i) for f in self.queue.values() for i in range(len(f.prompts)) if not f.used[i]]
        now = {f.step: _done(f) for f in self.queue.values()}
        got = [now[f.step][i] for f, i in pool]
        versions = [min(getattr(c, "served_version", f.version) for c in g) if g is not None else f.version
                    for g, (f, _) in zip(got, pool)]
        return pool, (np.array([f.step for f, _ in pool], np.int64), np.array([i for _, i in pool], np.int64),
                      np.array([g is not None for g in got], bool), np.array(versions, np.int64), got)

    def _running(self) -> bool:
        """Whether a generation of the pool still runs on this rank's thread."""
        return any(f.thread is not None and f.thread.is_alive() for f in self.queue.values() if not f.done)

    def _groups(self, step: int) -> int:
        return self.sizes.get(step, max(self.sizes.values(), default=0))

    def _enough(self, step: int) -> bool:
        _, (s, i, fin, v, _) = self._pool()
        return select(step, self.max_staleness, self._groups(step), s, i, fin, v)[0] is not None

    def _assemble(self, step: int, wait: bool) -> InFlight | None:
        """Collective: step ``step``'s G groups taken from the pool (module docstring); None (``wait`` False)
        while some rank has not enough finished."""
        t0 = time.perf_counter()
        while True:
            while True:  # with ``wait``, per rank on its own pool: until enough, or none of its generations runs
                running = wait and self._running()  # read before the pool: an ended thread's groups are in it
                short = not self._enough(step)
                if not (short and running):
                    break
                time.sleep(POLL_S)
            live = [f for f in self.queue.values() if not f.done]
            mine = [float(short)] + [float(f.thread is not None and f.thread.is_alive()) for f in live]
            agreed = collectives.all_reduce(torch.tensor(mine, dtype=torch.float64)).tolist()
            for f, alive in zip(live, agreed[1:]):
                if alive == 0:  # ended on every rank: its failures agreed and re-dealt, its metrics
                    self._collect(f)
            if agreed[0] == 0:
                break
            if not wait:
                return None
            live = [f for f in self.queue.values() if not f.done]
            if not live:
                break  # every generation finished and some rank is still short: generated again below
            self._collect(live[0])  # a short rank's own threads ended: wait for the oldest everywhere
        return self._take_now(step, time.perf_counter() - t0)

    def _take_now(self, step: int, wait_s: float) -> InFlight:
        """Collective (one all-reduce; a generation when some rank is short): the selection applied, built."""
        G, k = self._groups(step), self.max_staleness
        pool, (s, i, fin, v, got) = self._pool()
        chosen, dropped = select(step, k, G, s, i, fin, v)
        for p in dropped:
            f, j = pool[p]
            f.used[j] = True
            self.dropped_stale += len(got[p])
            self.spare.append((f.examples[j], f.prompts[j]))
        if chosen is None:  # short: every fresh finished group, then dropped prompts generated again
            fresh = fin & (step - v <= k)
            chosen = np.array([p for p in np.lexsort((i, s)) if fresh[p]], np.int64)
        for p in chosen:
            pool[p][0].used[pool[p][1]] = True
        need, later = G - len(chosen), int((s[chosen] > step).sum())
        held = [float(not (q.done and q.used.all())) for q in self.queue.values()]  # a group still to take or run
        agreed = collectives.all_reduce(torch.tensor([float(need), float(later), self.wait_saved, *held],
                                                     dtype=torch.float64)).tolist()
        self.wait_saved = 0.0
        rows = [(pool[p][0].examples[pool[p][1]], pool[p][0].prompts[pool[p][1]], got[p]) for p in chosen]
        if agreed[0] > 0:
            rows += self._regenerate(step, need)
        f = InFlight(step, step - k, [r[0] for r in rows], [r[1] for r in rows], [], groups=[r[2] for r in rows],
                     wait_s=wait_s)
        self._build(f)
        self.take_t[step] = time.perf_counter()
        self.pool_metrics[step] = {"rollout/taken_from_later_steps": agreed[1],
                                   "rollout/wait_saved_s": agreed[2] / (dist.get_world_size()
                                                                        if collectives.active() else 1)}
        for st, left in zip(list(self.queue), agreed[3:]):  # the same steps on every rank: only when none holds one
            if left == 0:
                del self.queue[st]
        return f

    def _regenerate(self, step: int, need: int) -> list[tuple]:
        """Collective: this rank's ``need`` (>= 0) most recently dropped prompts generated again from the engines
        recent enough for ``step`` (one generation over the fleet); (example, prompt, group) each."""
        if need > len(self.spare):
            raise StaleRollout(f"step {step}: {need} of the {self._groups(step)} groups of data-parallel rank "
                               f"{self.dp_rank} missing and {len(self.spare)} dropped prompts to generate again")
        cut = len(self.spare) - need
        todo, self.spare = self.spare[cut:], self.spare[:cut]
        versions_K = np.array([e.version if e.alive else -1 for e in self.engines])
        ok_K = eligible_K(step, versions_K, self.max_staleness)
        if not ok_K.any():
            raise StaleRollout(f"step {step}: groups to generate again and no engine serves weights within "
                               f"[rl] max_staleness = {self.max_staleness} (versions {versions_K.tolist()})")
        fleet = self._fleet()
        dealt = fleet.deal(self._requests(step, [p for _, p in todo]), self.expected_response, ok_K)
        fleet.send(dealt)
        return [(ex, p, g) for (ex, p), g in zip(todo, self._finish(dealt))]

    # -- the queue's hooks ----------------------------------------------------------------------
    def _start(self, step, ok_K=None, version=None) -> None:
        super()._start(step, ok_K, version)
        f = self.queue[step]
        f.used = np.zeros(len(f.prompts), bool)
        self.sizes[step] = len(f.prompts)

    def _collect(self, f: InFlight) -> RolloutBatch | None:
        if not self.first_finished:
            return super()._collect(f)
        if not f.done:  # a generation of the pool: finished (collective), never built by itself
            self._join_rows(f)
            f.done = True
            if f.step in self.take_t and f.ended_at > self.take_t[f.step]:
                self.wait_saved = f.ended_at - self.take_t.pop(f.step)
        return None

    def take(self, step: int) -> InFlight | None:
        if not self.first_finished:
            return super().take(step)
        if step not in self.taken and self.queue:
            self.taken[step] = self._assemble(step, wait=True)
        f = self.taken.pop(step, None)
        self.taking = self.pool_metrics.pop(step, {"rollout/taken_from_later_steps": 0.0,
                                                   "rollout/wait_saved_s": 0.0})
        return self._check_stale(step, f) if f is not None else None

    def async_metrics(self) -> dict[str, float]:
        return {**super().async_metrics(), **(self.taking if self.first_finished else {})}

    def poll(self, step: int, wait: bool = True) -> RolloutBatch | None:
        if not self.first_finished:
            return super().poll(step, wait)
        if step not in self.taken:
            if not self.queue:
                return None
            f = self._assemble(step, wait)
            if f is None:
                return None
            self.taken[step] = f
        return self.taken[step].batch

    # -- checkpoint ---------------------------------------------------------------------------
    def save_in_flight(self, folder: str) -> None:
        if not self.first_finished:
            return super().save_in_flight(folder)
        for f in list(self.queue.values()):
            self._collect(f)
        if not self.queue and not self.taken:
            return
        one = lambda f: {"step": f.step, "version": f.version, "examples": f.examples, "prompts": f.prompts,  # noqa: E731
                         "groups": f.groups, "generate_s": f.generate_s, "used": f.used}
        self._write_in_flight(folder, {
            "first_finished": True, "steps": [one(f) for f in self.queue.values()],
            "taken": [one(f) for f in self.taken.values()], "sizes": self.sizes, "spare": self.spare,
            "started": self.started, "metrics": self.pool_metrics, "expected_response": self.expected_response})

    def load_in_flight(self, folder: str, step: int) -> bool:
        if not self.first_finished:
            return super().load_in_flight(folder, step)
        path, d = self._read_in_flight(folder, first_finished=True)
        if d is None:
            return False
        if d["taken"] and d["taken"][0]["step"] != step:
            raise StaleRollout(f"{path}: holds step {d['taken'][0]['step']}'s rows, resuming at step {step}")
        self.expected_response, self.sizes, self.spare = d["expected_response"], d["sizes"], d["spare"]
        self.started, self.pool_metrics = d["started"], d["metrics"]
        for s in d["steps"]:
            f = InFlight(s["step"], s["version"], s["examples"], s["prompts"], [], groups=s["groups"],
                         generate_s=s["generate_s"], used=np.asarray(s["used"], bool), done=True)
            self.queue[f.step] = f
        for s in d["taken"]:
            f = InFlight(s["step"], s["version"], s["examples"], s["prompts"], [], groups=s["groups"])
            self._build(f)
            self.taken[f.step] = f
        return True
