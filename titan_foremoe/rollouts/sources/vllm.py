"""The vLLM source: a fleet of live engines (``rollouts/fleet``) generates each step's rollouts from the policy's
current weights. One engine (``url``, or ``engines = 1``) is the one-engine fleet.

Per RL step (every rank calls ``next_batch``; the collective parts are marked):

1. **weight sync** (collective): every rank writes its own slices of the policy into an HF folder (``export``:
   DCP's HF writer, experts in logical order), alternating between two folders so no engine reads one being
   rewritten; then each engine's owner (``layout.launcher_rank``) has it reload the folder (or restarts a
   launched engine on it, or restarts one found dead: its refill) and reset its prefix cache, all engines at
   once, the outcomes agreed in one all-gather (an engine that fails is out of the deal until it answers again).
   The first step launches the engines on the first folder instead. With ``weight_sync = "nccl"`` (GPU) only
   that first launch uses a folder; then the transfer group (rank 0 and its node's ranks as relays; a fleet, ONE
   group of every alive engine's workers, ``layout.one_group``) joins it and every sync sends the HF-named tensors in
   buckets (``sources/streamed.py``, ``engines/weight_buckets.py``; one launched engine that dies mid-sync is
   restarted on a fresh export).
2. **probe** (collective): rank 0 asks every alive engine for the prompt log-probs and routes of a fixed probe
   sequence, every rank computes the trainer's once on the same tokens with the first engine's routes replayed;
   any engine's gap above ``probe_tolerance`` is an error (it is not serving these weights).
3. **generate** (collective): the step's requests (one per prompt, ``samples_per_prompt`` samples) are dealt over
   the alive engines by estimated tokens (``fleet/client.py``: one all-gather), each rank sends its own, token ids
   in and out with sampling log-probs and routed experts, and a failed engine's unanswered requests are re-dealt
   to the survivors (one flag all-reduce per round); every completion, tagged with its engine and that engine's
   weights, passes ``validate_sample`` (the file importer's checks) and the rows become a ``RolloutBatch``
   exactly as in embedded mode.

With ``[rl] max_staleness = k`` > 0 (asynchronous RL, ``sources/in_flight.py``) step N's start takes step N's
rows (generated in the background since an earlier step's start), reloads the engines no rank has a request on
(busy ones keep generating on their older weights and are reloaded at a later step start), probes the reloaded
ones, and starts the generation of the steps up to N + k, each dealt only over the engines whose weights are at
most k steps older than it. ``poll`` (collective) collects a step's rows when the trainer asks (after step N's
update stage, for step N+1), with the same error agreement and engine restart as a synchronous generation, so
the trainer plans step N+1 before it starts. Every row carries the weights version of the engine that served it;
a step with a row older than ``max_staleness`` is refused or regenerated (``[rl] stale_rollouts``); with
``take_first_finished`` a step trains the first finished groups of every started step (``first_finished.py``). A checkpoint
saved between steps waits for and holds every started step's rows (``save_in_flight``): a resume is exact.

Cost at R = 64 ranks (DP 64), Qwen3-30B-A3B: each rank's HTTP traffic is its
own rows only (its token ids out; back, per token 48 layers x 8 ids = 384 B of
uint8 routes + one log-prob), so no rank gathers the batch and the engine sees
64 clients x ``concurrency`` requests; the weight folder is 61 GB in bf16
(each rank writes ~1/64 of it) read once per step by each engine; per step three host syncs of the reload
(the export's barrier, the owners' outcome all-gather, the probe's broadcast) and three of the fleet client
(the deal's all-gather, the failure flag, the metrics' two all-reduces), none per micro-step.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import numpy as np
import torch.distributed as dist

from ...distributed import collectives
from ..dump import dump_rows, write_dump
from ..engines.vllm_fused_load import EXTENSION
from ..engines.vllm_server import EngineError, LaunchSpec
from ..fleet.sleep import SleepProtocol
from ..fleet.client import FleetClient
from ..fleet.engine import ENGINE_KINDS, Engine, wait_all
from ..fleet.layout import fleet_of
from ..partial import Carry
from ..sample import ModelSpec, RolloutError, RolloutSample, validate_sample
from .base import RolloutBatch, rollout_of_samples, score
from .first_finished import FirstFinishedPool
from .in_flight import InFlight, InFlightQueue, StaleRollout, staleness_problem, token_staleness
from .partial_step import generate_partial, load_carry, save_carry
from .streamed import StreamedSync, _on_rank0, source_address

__all__ = ["InFlight", "StaleRollout", "VLLMSource", "source_address", "staleness_problem", "weights_label_problem"]

logger = logging.getLogger("titan_foremoe")


def weights_label_problem(completion, version: int) -> str | None:
    """vLLM 0.32+ label each choice's tokens with the weights that sampled them (the NCCL path's
    ``weight_version``): any label but ``version``'s is a rollout of other weights (None: none, or only it)."""
    labels = {v for v, _, _ in getattr(completion, "weight_versions", None) or ()}
    if labels - {str(version)}:
        return f"sampled by the weights labelled {sorted(labels)}, expected those of step {version}"
    return None


class VLLMSource(FirstFinishedPool, InFlightQueue, StreamedSync):
    """Rollouts from a vLLM engine that gets the policy's weights every step (module docstring).

    ``sources/sglang.py`` reuses the engine-independent steps with its own server, client and config section."""

    engine_name = "vLLM"
    section = "rollout_engine"
    stream_sync = "nccl"
    """The ``weight_sync`` value that streams the weights to the engine (no folder after the launch)."""
    engine_kind = "vllm"  # the fleet's engine variant (``fleet/engine.py``)

    def __init__(self, cfg, *, prompts, tokenizer, task, reward_fn, spec: ModelSpec, export: Callable[[str], None],
                 policy_logprobs: Callable[[np.ndarray, np.ndarray], np.ndarray], rank: int, dp_rank: int,
                 math_exact: bool = False, weights: Callable[[], object] | None = None):
        self.cfg, self.eng = cfg, getattr(cfg, self.section)
        self.prompts, self.tokenizer, self.task, self.reward_fn = prompts, tokenizer, task, reward_fn
        self.spec, self.export, self.policy_logprobs = spec, export, policy_logprobs
        self.weights = weights  # nccl: () -> HFWeightStream of the policy (metadata() and a collective pass)
        self.sender = None  # nccl, rank 0: the bucket sender once the transfer group is joined
        self.relay = None  # nccl, the other ranks of rank 0's node: their side of the transfer group
        self.joined = False
        self.rails = None  # nccl: the two-hop gather's groups, made at the first sync (False: one node, none)
        self.ipc = None  # ipc: this rank's ``IPCNode`` (rank 0's node), made at the first sync (False: other nodes)
        self.rank, self.dp_rank, self.math_exact = rank, dp_rank, math_exact
        self.weights_dir = self.eng.weights_dir or os.path.join(cfg.job.dump_folder, "engine_weights")
        self.fleet: FleetClient | None = None  # the engines, made at first use (``_fleet``)
        self.layout = None
        self.syncs = 0
        self.folder = ""
        self.timings: dict[str, float] = {}
        rl = cfg.rl
        self.max_staleness, self.stale_rollouts = rl.max_staleness, rl.stale_rollouts
        self.last_step = rl.sft_warmup_steps + cfg.training.steps  # no rows are generated for a step past it
        self.expected_response = float(rl.max_new_tokens)  # the deal's estimate; then the last step's mean
        self._init_queue()  # the started steps' rows (``in_flight.py``), or a checkpoint's
        self._init_pool(rl.take_first_finished)  # or a pool of their groups (``first_finished.py``)
        self.version = -1  # the step whose starting weights the engine serves, or is being given (-1: none yet)
        self.carry = Carry() if rl.rollout_token_budget > 0 else None  # partial rollouts' unfinished responses
        self.fused = bool(getattr(self.eng, "fused_expert_load", False)) and self.streams
        """Stacked experts into vLLM's fused parameters (``engines/vllm_fused_load.py``); never SGLang's."""
        self.sleep = SleepProtocol(getattr(self.eng, "sleep_level", 0), lambda: [  # SGLang: no sleep mode
            e.client for e in self.engines if e.slot.source_rank == self.rank and e.client is not None and e.alive])
        """Colocated: the engines asleep from the rollout's end to the next sync (``fleet/sleep.py``); each engine's
        source calls its own."""
        if self.eng.url or self.eng.urls:  # user-run engines are up (and awake) from the start
            self.sleep.fresh()

    # -- the fleet -----------------------------------------------------------------------
    def _fleet(self) -> FleetClient:
        """The engines (``rollouts/fleet``): made once, the same layout on every rank from the config."""
        if self.fleet is None:
            e = self.eng
            world = dist.get_world_size() if dist.is_initialized() else 1
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or world
            self.layout = fleet_of(e, world, per_node)
            kind = ENGINE_KINDS[self.engine_kind]
            self.fleet = FleetClient([kind(slot, e, self.spec) for slot in self.layout.engines])
        return self.fleet

    @property
    def engines(self) -> list[Engine]:
        return self._fleet().engines

    # one engine's source (the streamed syncs and their tests): engine 0's client, server and restarts
    client = property(lambda self: self.engines[0].client,
                      lambda self, c: setattr(self.engines[0], "client", c))
    server = property(lambda self: self.engines[0].server,
                      lambda self, s: setattr(self.engines[0], "server", s))
    restarts = property(lambda self: sum(e.restarts for e in self.engines))

    def _owner(self, k: int) -> bool:
        """This rank launches, restarts and reloads engine ``k``."""
        self._fleet()
        return self.layout.launcher_rank(k) == self.rank

    def _launch(self, folder: str, k: int = 0) -> str:
        """Engine ``k``'s owner: start (or restart) it on ``folder``; returns its URL."""
        e, engine = self.eng, self.engines[k]
        os.makedirs(self.weights_dir, exist_ok=True)
        log = "engine.log" if len(self.engines) == 1 else f"engine_{k}.log"
        engine.make_server(LaunchSpec(
            python=os.path.expanduser(e.python), model=folder, dtype=e.dtype, max_model_len=e.max_model_len,
            extra_args=tuple(e.extra_args), log_path=os.path.join(self.weights_dir, log),
            startup_timeout_s=e.startup_timeout_s,
            max_num_seqs=max(16, min(256, e.concurrency * self.cfg.rl.samples_per_prompt)),
            weight_transfer=e.weight_sync in ("nccl", "ipc"),  # vLLM's routes (no SGLang sync is called so)
            weight_transfer_backend="ipc" if e.weight_sync == "ipc" else "nccl",
            worker_extension=EXTENSION if self.fused else "", sleep_mode=getattr(e, "sleep_level", 0) > 0,
        ))
        return engine.launch(folder)

    def _connect(self, url: str, k: int = 0) -> None:
        self.engines[k].connect(url)

    def close(self) -> None:
        if self.fleet is not None:
            for engine in self.engines:
                engine.close()

    def _agree(self, mine: dict[int, tuple[str, str]]) -> list[str]:
        """Collective: every owner's outcome per engine (``("ok", url)`` or ``("error", line)``) on every rank:
        clients on the new URLs, failed engines dead (counted once). One all-gather; the error lines."""
        errors = []
        for outcome in collectives.all_gather_objects(mine):
            for k, (kind, value) in outcome.items():
                engine = self.engines[k]
                if kind == "ok":
                    if engine.client is None or engine.client.url != value:
                        engine.connect(value)
                    engine.alive, engine.version = True, self.version
                else:
                    errors.append(value)
                    engine.failures += engine.alive
                    engine.alive = False
        return errors

    def _owned(self, fn, only: list[int] | None = None) -> list[str]:
        """Collective: ``fn(engine)`` on every engine this rank owns, concurrently, outcomes agreed
        (``_agree``); an engine ``fn`` fails on is dead. Raises every error in one line when none is alive."""
        mine: dict[int, tuple[str, str]] = {}

        def run(engine):
            try:
                mine[engine.index] = ("ok", fn(engine))
            except (EngineError, RolloutError, OSError) as err:
                mine[engine.index] = ("error", f"{self.engine_name} engine {engine.index}: {err}")
                raise EngineError(str(err)) from None

        wait_all([lambda x=x: run(x) for x in self.engines
                  if self._owner(x.index) and (only is None or x.index in only)], "engine")
        errors = self._agree(mine)
        if errors and not self.fleet.alive_K.any():
            raise EngineError("; ".join(errors))
        if errors:
            logger.warning("engine fleet: %s; going on with engines %s", "; ".join(errors),
                           np.flatnonzero(self.fleet.alive_K).tolist())
        return errors

    def _on_failure(self, dead: list[int], errors: str) -> None:
        """Collective, after the fleet agreed ``dead``: their owners restart launched ones on the weights being
        served, in the background while others survive (they rejoin at the next sync, ``_refresh``), at once when
        none does (the step cannot go on otherwise). The streamed syncs cannot refill a fresh engine mid-step."""
        if self.streams:
            return
        if self.fleet.alive_K.any():
            for k in dead:
                engine = self.engines[k]
                if self._owner(k) and engine.restartable():
                    engine.restart_in_background(self.folder, errors)
            return

        def restart(engine):
            if engine.index not in dead or not engine.restartable():
                raise EngineError(errors)
            return engine.restart(self.folder, errors)

        self._owned(restart)

    def _refresh(self, engine: Engine, folder: str) -> str:
        """Owner, at a folder sync: engine ``k`` serves ``folder`` (launched the first time, restarted when
        ``weight_sync = "restart"`` or when it died, else reloaded in place); its URL."""
        engine.join_restart()
        if engine.client is None and engine.slot.launched:
            return self._launch(folder, engine.index)
        if engine.client is None:
            engine.connect(engine.slot.url)
        elif engine.server is not None and self.eng.weight_sync == "restart":
            return self._launch(folder, engine.index)
        if engine.server is not None and not engine.server.alive():
            if not engine.restartable():
                raise EngineError(f"{self.engine_name} engine {engine.index} at {engine.url} is dead and has no "
                                  f"restarts left ({engine.restarts} of {self.eng.max_restarts})")
            return engine.restart(folder, "found dead at the weight sync")
        try:
            engine.reload(folder, self.version)
        except EngineError as err:
            if not engine.restartable():
                raise
            return engine.restart(folder, str(err))
        return engine.url

    # -- 1. weight sync ------------------------------------------------------------------
    def sync_weights(self, only: list[int] | None = None) -> None:
        """Collective: the engines (``only`` these: the idle ones, ``in_flight.py``) serve the policy's current
        weights (launched on them the first time)."""
        t0 = time.perf_counter()
        if self.streams and (self.syncs > 0 or self.eng.url or self.eng.urls):
            return self._sync_ipc(t0) if self.eng.weight_sync == "ipc" else self._sync_nccl(t0)
        folder = self.folder = os.path.join(self.weights_dir, f"policy_{self.syncs % self.folders}")
        self.export(folder)  # every rank its own slices; ends with a barrier
        t1 = time.perf_counter()
        self._owned(lambda engine: self._refresh(engine, folder), only)  # every engine reloads the same folder
        self.sleep.fresh()  # launched, restarted or reloaded: awake (sleep runs only with ipc: here at launch)
        self.syncs += 1
        self.timings.update({"rollout/weight_export_s": t1 - t0, "rollout/weight_load_s": time.perf_counter() - t1})

    # -- 2. probe ------------------------------------------------------------------------------
    def probe(self, token_ids: list[int]) -> float:
        """Collective: max |engine - trainer| log-prob over ``token_ids``, over every alive engine (rank 0 asks
        them all at once; every rank runs one forward, with the first engine's routes). An engine that fails the
        request is dead (``_agree``); one that answers with other log-probs stops the job."""
        def ask():
            alive = [e for e in self.engines if e.alive and e.version == self.version]  # not those still busy
            got: dict[int, tuple] = {}

            def one(engine):
                try:
                    got[engine.index] = engine.probe(token_ids)
                except EngineError:
                    if not (self._owner(engine.index) and engine.restartable()):
                        raise
                    engine.restart(self.folder, "found dead at the probe")  # one engine: today's recovery
                    got[engine.index] = engine.probe(token_ids)
            errors = wait_all([lambda x=x: one(x) for x in alive], "probe")
            bad = {e.index: ("error", f"{self.engine_name} engine {e.index}: {err}")
                   for e, err in zip(alive, errors) if err}
            urls = {e.index: ("ok", e.url) for e in alive if e.index not in bad}
            return token_ids, got, {**urls, **bad}

        token_ids, got, outcome = _on_rank0(self.rank, ask)
        errors = self._agree(outcome)
        if not got:
            raise EngineError("; ".join(errors))
        first = min(got)
        ours = self.policy_logprobs(np.asarray(token_ids, np.int64), got[first][1][: len(token_ids) - 1])
        gaps = {k: float(np.abs(ours - lp).max()) for k, (lp, _) in got.items()}
        k, gap = max(gaps.items(), key=lambda kv: (not kv[1] <= self.eng.probe_tolerance, kv[1]))
        if not gap <= self.eng.probe_tolerance:
            raise EngineError(f"{self.engine_name} at {self.engines[k].url}: probe log-probs differ from the "
                              f"trainer's by {gap:.3g} (> [{self.section}] probe_tolerance "
                              f"{self.eng.probe_tolerance}) after weight sync {self.syncs}: the engine is not serving "
                              "the policy's weights")
        return gap

    # -- 3. generate ---------------------------------------------------------------------------
    def _requests(self, step: int, prompts: list) -> list[dict]:
        rl = self.cfg.rl
        spp = rl.samples_per_prompt
        return [dict(prompt_ids=p, n=spp, max_tokens=rl.max_new_tokens, temperature=rl.temperature,
                     top_p=rl.top_p, seed=(self.cfg.job.seed * 1_000_003 + step * 65_537 + self.dp_rank * 4099
                                           + i * spp) % 2**31)  # sample j: seed + j
                for i, p in enumerate(prompts)]

    def next_batch(self, step: int) -> RolloutBatch:
        f = self.take(step)  # collected (``in_flight.py``); None: none started; batch None: stale, regenerated
        if f is None:
            f = InFlight(step, step, *self.prompts.prompts(step), [])
        self.version = step  # what the sync gives the engine (the NCCL path labels its weights with it)
        only = self.engines_to_sync(drain=f.batch is None)  # the idle engines; all when this step generates
        self.sleep.around_sync(lambda: self.sync_weights(only))  # sleep on: wake weights, sync, wake KV cache
        t0 = time.perf_counter()
        gap = self.probe(f.prompts[0]) if only is None or only else float("nan")  # rank 0's first prompt
        t1 = time.perf_counter()
        if f.batch is None:  # the synchronous path: this step's rows from this step's weights
            f.version, f.requests = step, self._requests(step, f.prompts)
            if self.carry is not None:  # partial rollouts: the carry continues, only finished groups train
                generate_partial(self, f)
            else:
                f.groups = self._generate(f.requests)
                f.generate_s = f.wait_s = time.perf_counter() - t1
                self._build(f)
        self.start_ahead(step)  # up to max_staleness steps generated while this one trains
        self.timings.update({"rollout/probe_s": t1 - t0, "rollout/probe_gap": gap,
                             "rollout/engine_restarts": float(self.restarts),
                             "rollout/engine_starts": float(sum(e.server.starts for e in self.engines
                                                                if e.server is not None)),
                             **f.extra, **self.async_metrics()})
        self.sleep.begin_sleep()  # sleep on: the engine's memory is the trainer's until the next sync (waited in
        return f.batch  # ``settle``, after the trainer's host work of the step: its plans)

    @property
    def sleeps(self) -> bool:
        """Colocated engines put to sleep after every rollout (``[rollout_engine] sleep_level`` > 0)."""
        return self.sleep.on

    def settle(self) -> None:
        """Collective: the rollout's engine sleep waited and agreed (sleep on; a no-op otherwise), before the
        trainer's first GPU work of the step (``base.settle``)."""
        self.sleep.finish_sleep()

    def _generate(self, requests: list[dict]) -> list:
        """Collective: this rank's requests answered over the fleet (``fleet/client.py``), each completion tagged
        with its engine and that engine's weights."""
        dealt = self._fleet().deal(requests, self.expected_response)
        self.fleet.send(dealt)
        return self._finish(dealt)

    def _finish(self, dealt) -> list:
        """Collective: ``dealt``'s requests all answered (failures agreed and re-dealt); the per-engine metrics
        and the next deal's expected response length (the same on every rank: summed over ranks)."""
        groups, _ = self.fleet.finish(dealt, self._on_failure)
        samples = sum(e.counters.samples for e in self.engines)
        if samples:
            self.expected_response = sum(e.counters.tokens for e in self.engines) / samples
        self.timings.update(self.fleet.metrics())
        return groups

    def _build(self, f: InFlight) -> RolloutBatch:
        """``f``'s completions validated, scored (and dumped) as this rank's ``RolloutBatch``."""
        rl, step = self.cfg.rl, f.step
        spp = rl.samples_per_prompt
        samples, served = [], []
        for i, (p, group) in enumerate(zip(f.prompts, f.groups)):
            for j, c in enumerate(group):
                k = getattr(c, "engine", -1)
                url = self.engines[k].url if 0 <= k < len(self.engines) else "(engine)"
                served.append((k, getattr(c, "served_version", -1)))
                tokens = np.asarray([*p, *c.token_ids], np.int64)
                lp = np.full(len(tokens), np.nan, np.float32)
                if len(c.logprobs) != len(c.token_ids):
                    raise RolloutError(f"{self.engine_name} at {url} step {step} prompt {i} sample {j}", "logprobs",
                                       f"{len(c.logprobs)} for {len(c.token_ids)} generated tokens")
                lp[len(p):] = c.logprobs
                if self.streams and (why := weights_label_problem(c, f.version)):
                    raise RolloutError(f"{self.engine_name} at {url} step {step} prompt {i} sample {j}",
                                       "weight_versions", why)
                s = RolloutSample(tokens, len(p), c.routes_RXK, lp)
                validate_sample(s, self.spec, f"{self.engine_name} at {url} step {step} prompt {i} sample {j}")
                s.routes_RXK = s.routes_RXK.astype(np.int64)
                samples.append(s)
        rollout = rollout_of_samples(samples, pad_id=self.tokenizer.pad_id, eos_ids=self.tokenizer.eos_ids,
                                     num_experts=self.spec.num_experts)
        rows = [ex for ex in f.examples for _ in range(spp)]
        completions = [self.tokenizer.decode(rollout.completion(b)) for b in range(len(rows))]
        versions_B = np.array([v for _, v in served], np.int64)
        if len(versions_B) and versions_B.min() >= 0:
            f.version = int(versions_B.min())  # the oldest row's weights: the staleness the step is checked by
        else:  # no engine named its weights (a checkpoint of an older run): the step's bound for every row
            versions_B = np.full(len(served), f.version, np.int64)
        f.versions_B = versions_B
        rewards, exact = score(self.reward_fn, self.task, rows, completions, math_exact=self.math_exact,
                               format_reward=rl.format_reward)
        if rl.dump_rollouts:
            self._dump(step, rollout, rows, completions, rewards, samples, versions_B, served,
                       getattr(f, "token_versions", None))
        mean, worst = token_staleness(step, versions_B, (rollout.lengths_B - rollout.prompt_lens_B).numpy())
        f.extra = {"rollout/generate_s": f.generate_s, "rollout/wait_s": f.wait_s, "rollout/staleness": mean,
                   "rollout/staleness_max": worst, "rollout/weights_version": float(f.version)}
        f.batch = RolloutBatch(rollout, rewards, exact)
        return f.batch

    # -- checkpoint: the started steps' rows (``in_flight.py``) and the partial rollouts' carry ---------------
    def save_in_flight(self, folder: str) -> None:
        if self.carry is not None:
            save_carry(self.carry, folder, self.dp_rank)
        super().save_in_flight(folder)

    def load_in_flight(self, folder: str, step: int) -> bool:
        if self.carry is not None:
            load_carry(self.carry, folder, self.dp_rank)
        return super().load_in_flight(folder, step)

    def _dump(self, step, rollout, rows, completions, rewards, samples, versions_B, served=(),
              token_versions=None) -> None:
        """The step's rows (as embedded mode dumps them, named by the step that trains on them, with the
        ``weights_version`` that generated each, the ``engine`` that served each and the version that engine
        said it served) plus the engines' own routes, per rank."""
        folder = os.path.join(self.cfg.job.dump_folder, "rollouts")
        records = dump_rows(step, self.dp_rank, rollout, rows, completions, rewards)
        for r, version, (k, v) in zip(records, versions_B, served or [(-1, -1)] * len(records)):
            r["weights_version"], r["engine"], r["engine_weights_version"] = int(version), k, v
        for r, vs in zip(records, token_versions or ()):  # partial rollouts: each completion token's weights
            r["token_versions"] = vs
        write_dump(folder, step, records)
        os.makedirs(folder, exist_ok=True)
        np.savez(os.path.join(folder, f"engine_routes_{step:05d}_rank{self.dp_rank:04d}.npz"),
                 routes_NXK=np.concatenate([s.routes_RXK for s in samples]),
                 routed_N=np.array([len(s.routes_RXK) for s in samples]),
                 logprobs_NT=rollout.logprobs_BT.numpy(), weights_version=np.asarray(versions_B, np.int64),
                 engine_N=np.array([k for k, _ in served] or [-1] * len(samples), np.int64))

    def state_dict(self) -> dict:
        return {}  # prompts and sampling seeds are functions of (seed, step, rank)

    def load_state_dict(self, state: dict) -> None:
        pass
