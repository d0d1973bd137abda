"""The vLLM source: a live engine generates each step's rollouts from the policy's current weights.

Per RL step (every rank calls ``next_batch``; the collective parts are marked):

1. **weight sync** (collective): every rank writes its own slices of the policy
   into an HF folder (``export``: DCP's HF writer, experts in logical order),
   alternating between two folders so the engine never reads one being
   rewritten; then rank 0 has the engine ``reload_weights`` from it (or restarts
   a launched engine on it) and resets its prefix cache (cached blocks carry the
   old weights' KV and routes). The first step launches the engine on the first
   folder instead. With ``weight_sync = "nccl"`` (GPU) only that first launch
   uses a folder (a user-run engine: none); then trainer rank 0 and the other
   ranks of its node join the engine's NCCL transfer group and every sync sends
   the HF-named tensors in buckets, each gathered to rank 0 only
   (``engines/weight_buckets.py``; a launched engine that dies mid-sync is
   restarted on a fresh export).
2. **probe** (collective): rank 0 asks the engine for the prompt log-probs and
   routes of a fixed probe sequence, every rank computes the trainer's on the
   same tokens with those routes replayed; a gap above ``probe_tolerance`` is
   an error (the engine is not serving these weights).
3. **generate**: each data-parallel rank sends its own prompts (``samples_per_prompt``
   samples per request, ``concurrency`` requests in flight), token ids in and
   out, with sampling log-probs and routed experts; every completion passes
   ``validate_sample`` (the file importer's checks) and the rows become a
   ``RolloutBatch`` exactly as in embedded mode.

With ``[rl] max_staleness = 1`` (asynchronous RL) step N's start does 1 and 2 with the weights of step N,
then starts the generation of step N+1's rows on a background thread of every rank (HTTP only, no collective:
the engine works while the trainer trains step N) and returns step N's rows, generated during step N-1 with
step N-1's weights. ``poll`` (collective) collects step N+1's rows when the trainer asks (after step N's update
stage), with the same error agreement and engine restart as a synchronous generation (a restarted engine is
launched on the folder being served: the weights that rollout was meant to come from), so the trainer can
plan step N+1 before it starts. Every batch carries the ``weights_version`` (the step whose starting weights
generated it); one older than ``max_staleness`` is refused or regenerated (``[rl] stale_rollouts``). A checkpoint
saved between steps holds the next step's collected rows (``save_in_flight``), so a resume trains on exactly them.

Cost at R = 64 ranks (DP 64), Qwen3-30B-A3B: each rank's HTTP traffic is its
own rows only (its token ids out; back, per token 48 layers x 8 ids = 384 B of
uint8 routes + one log-prob), so no rank gathers the batch and the engine sees
64 clients x ``concurrency`` requests; the weight folder is 61 GB in bf16
(each rank writes ~1/64 of it) read once per step by the engine; two host
syncs per step (the two barriers around the reload), none per micro-step.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ...distributed import collectives
from ..dump import dump_rows, write_dump
from ..engines.vllm_fused_load import EXTENSION
from ..engines.vllm_server import EngineError, LaunchSpec
from ..fleet.client import FleetClient
from ..fleet.engine import ENGINE_KINDS, Engine, wait_all
from ..fleet.layout import engine_layout
from ..sample import ModelSpec, RolloutError, RolloutSample, validate_sample
from .base import RolloutBatch, rollout_of_samples, score

logger = logging.getLogger("titan_foremoe")


def source_address(rank: int, configured: str, engine_url: str) -> str:
    """The address a sender group's source hosts its rendezvous on: ``nccl_address`` (rank 0's host) on rank 0's
    node; on another node, this host's address on the route to the engine (a connected UDP socket's own end:
    nothing is sent), so the engine's workers can reach it."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) or 1
    if rank < per_node:
        return configured
    import socket
    from urllib.parse import urlparse

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((urlparse(engine_url).hostname or "127.0.0.1", 9))
        return s.getsockname()[0]


def _on_rank0(rank: int, fn):
    """``fn()`` on rank 0, its result (or its error, raised on every rank) broadcast: no rank waits forever."""
    got = None
    if rank == 0:
        try:
            got = ("ok", fn())
        except (EngineError, RolloutError, OSError) as e:
            got = ("error", f"{type(e).__name__}: {e}")
    kind, value = collectives.broadcast_object(got, src=0)  # also: no rank goes on before rank 0 is done
    if kind == "error":
        raise EngineError(value)
    return value


class StaleRollout(ValueError):
    """A rollout generated by weights older than ``[rl] max_staleness`` allows."""


def staleness_problem(step: int, version: int, max_staleness: int) -> str | None:
    """Why the rows of ``step``, generated by the weights at the start of step ``version``, may not be
    trained on (None: they may)."""
    if version > step:
        return f"step {step}'s rollout claims weights of a later step ({version}): not from this run"
    if step - version > max_staleness:
        return (f"step {step}'s rollout was generated by the weights of step {version}, {step - version} steps "
                f"old; [rl] max_staleness is {max_staleness}")
    return None


def weights_label_problem(completion, version: int) -> str | None:
    """vLLM 0.32+ label each choice's tokens with the weights that sampled them (the NCCL path's
    ``weight_version``): any label but ``version``'s is a rollout of other weights (None: none, or only it)."""
    labels = {v for v, _, _ in getattr(completion, "weight_versions", None) or ()}
    if labels - {str(version)}:
        return f"sampled by the weights labelled {sorted(labels)}, expected those of step {version}"
    return None


@dataclass
class InFlight:
    """One step's rows: requested on a background thread (HTTP only), collected by ``poll``, built once."""

    step: int
    version: int  # the step whose starting weights the engine serves for these rows
    examples: list
    prompts: list
    requests: list[dict]
    thread: threading.Thread | None = None
    groups: list | None = None
    generate_s: float = 0.0  # the background generation's wall time
    wait_s: float = 0.0  # how long the trainer blocked on it
    batch: RolloutBatch | None = None
    extra: dict = field(default_factory=dict)

    dealt: object = None  # the fleet's ``Dealt`` while in flight
    engine_g: object = None  # [g] the engine that served each request

    def run(self, fleet) -> None:
        """This rank's requests sent (HTTP only; failures are agreed and re-dealt at ``poll``)."""
        t0 = time.perf_counter()
        fleet.send(self.dealt)
        self.generate_s = time.perf_counter() - t0


class VLLMSource:
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
        self.pending: InFlight | None = None  # the next step's rows (async), or a checkpoint's
        self.version = -1  # the step whose starting weights the engine serves, or is being given (-1: none yet)
        self.fused = bool(getattr(self.eng, "fused_expert_load", False)) and self.streams
        """Stacked experts into vLLM's fused parameters (``engines/vllm_fused_load.py``); never SGLang's."""

    # -- the fleet -----------------------------------------------------------------------
    def _fleet(self) -> FleetClient:
        """The engines (``rollouts/fleet``): made once, the same layout on every rank from the config."""
        if self.fleet is None:
            e = self.eng
            world = dist.get_world_size() if dist.is_initialized() else 1
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or world
            self.layout = engine_layout(trainer_gpus=world, gpus_per_node=per_node, engines=e.engines,
                                        gpus_per_engine=e.gpus_per_engine, colocated=e.colocated,
                                        urls=list(e.urls) or ([e.url] if e.url else []))
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
            worker_extension=EXTENSION if self.fused else "",
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

    def _owned(self, fn) -> list[str]:
        """Collective: ``fn(engine)`` on every engine this rank owns, concurrently, outcomes agreed
        (``_agree``); an engine ``fn`` fails on is dead. Raises every error in one line when none is alive."""
        mine: dict[int, tuple[str, str]] = {}

        def run(engine):
            try:
                mine[engine.index] = ("ok", fn(engine))
            except (EngineError, RolloutError, OSError) as err:
                mine[engine.index] = ("error", f"{self.engine_name} engine {engine.index}: {err}")
                raise EngineError(str(err)) from None

        wait_all([lambda x=x: run(x) for x in self.engines if self._owner(x.index)], "engine")
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
    def sync_weights(self) -> None:
        """Collective: the engine serves the policy's current weights (launched on them the first time)."""
        t0 = time.perf_counter()
        if self.streams and (self.syncs > 0 or self.eng.url):
            return self._sync_ipc(t0) if self.eng.weight_sync == "ipc" else self._sync_nccl(t0)
        folder = self.folder = os.path.join(self.weights_dir, f"policy_{self.syncs % 2}")
        self.export(folder)  # every rank its own slices; ends with a barrier
        t1 = time.perf_counter()
        self._owned(lambda engine: self._refresh(engine, folder))  # every engine reloads the same folder
        self.syncs += 1
        self.timings.update({"rollout/weight_export_s": t1 - t0, "rollout/weight_load_s": time.perf_counter() - t1})

    def senders(self) -> int:
        """Sender groups the engine takes: vLLM's transfer group broadcasts from its rank 0 only, one group per
        server (``init_weight_transfer_engine``), so one (``engines/vllm_weights.py``)."""
        return 1

    def _sync_nccl(self, t0: float) -> None:
        """Collective: the policy in buckets to the engine (``engines/weight_buckets.py``): each sender group's
        source gathers its buckets (every rank's slice crossing nodes once, to its rail on the source's node) and
        broadcasts them, the other ranks of its group relay them; the first sync joins the transfer groups. Every
        rank's error is raised on every rank, in one line."""
        from ..engines.sync_cost import sender_groups
        from ..engines.vllm_weights import RailGroups
        from ..engines.weight_buckets import sync_buckets

        world = dist.get_world_size() if dist.is_initialized() else 1
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) or 1
        groups = sender_groups(world, per_node, self.senders())
        if not self.joined:  # the first sync: the sources and their relays join the engine's transfer groups
            if self.rails is None:  # every rank, once (a refilled engine keeps them)
                self.rails = (RailGroups.make(world, per_node) if world > 1 else None) or False
            self._raise_all(self._join(groups))
            self.joined = True
        stream = self._bucket_stream([g[0] for g in groups])
        err = sync_buckets(stream, self.rank, self.sender, self.relay, weight_version=str(self.version))
        self._streamed(err, t0)

    def _streamed(self, err: str | None, t0: float) -> None:
        """Collective, after a streamed sync: refill a dead engine or raise every rank's error; every rank on the
        engine's (possibly new) URL."""
        if not self._refilled(err):
            self._raise_all(err)
        url = collectives.broadcast_object(self.client.url if self.rank == 0 else None, src=0)
        if self.client is None or self.client.url != url:
            self._connect(url)
        self.syncs += 1
        self.timings.update({"rollout/weight_export_s": 0.0, "rollout/weight_load_s": time.perf_counter() - t0})

    @property
    def streams(self) -> bool:
        """The weights stream to the engine (NCCL / IPC), no folder after the launch."""
        return self.eng.weight_sync in (self.stream_sync, "ipc")

    def _sync_ipc(self, t0: float) -> None:
        """Collective: the policy in buckets to a colocated engine by IPC handles (``engines/ipc_weights.py``):
        rank 0 gathers each bucket (every slice crossing nodes once) and broadcasts it over its node, every rank
        of the node hands rank 0 a handle of its copy, rank 0 posts them; the first sync sends the init info.
        Every rank's error is raised on every rank, in one line."""
        from ..engines.ipc_weights import IPCNode, IPCSender, sync_ipc
        from ..engines.vllm_weights import RailGroups

        world = dist.get_world_size() if dist.is_initialized() else 1
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) or 1
        if self.rails is None:  # every rank, once (a refilled engine keeps them)
            self.rails = (RailGroups.make(world, per_node) if world > 1 else None) or False
        if self.ipc is None:  # every rank, once: node groups of the IPC sync's own (its node broadcasts run on
            from ...distributed import groups  # sync_buckets' send thread beside the gathers, which use the rails'
            # node groups and the world: two threads never share a group)

            node = groups.subgroups([list(range(k, min(k + per_node, world))) for k in range(0, world, per_node)]) \
                if world > 1 else None
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            self.ipc = IPCNode(node, self.rank, device=device) if self.rank < min(per_node, world) else False
        if not self.joined:  # the first sync, or a refilled engine: rank 0 sends the init info
            err = None
            if self.rank == 0:
                try:
                    if self.client is None:
                        self._connect(self.eng.url)
                    client = self.client
                    self._install_fused()
                    self.ipc.poster = IPCSender(lambda path, body: client.post(path, body, retry=False))
                    self.ipc.poster.init()
                except Exception as e:  # noqa: BLE001 - raised on every rank
                    err = f"{type(e).__name__}: {e}"
            self._raise_all(err)
            self.joined = True
        stream = self._bucket_stream(0)
        self._streamed(sync_ipc(stream, self.rank, self.ipc or None, weight_version=str(self.version)), t0)

    def _bucket_stream(self, src: int | list[int]):
        """This sync's pass in buckets (``engines/weight_buckets.py``), from each sender group's source ``src``; with
        ``fused`` each layer's experts as two stacked tensors (the engine's extension is installed when it joins;
        vLLM's NCCL and IPC consumers take a tensor past the bucket size whole)."""
        from ..engines.weight_buckets import BucketStream

        weights = self.weights()
        weights.fused = self.fused
        return BucketStream(weights, self.eng.weight_sync_bucket_mb << 20, src=src, rails=self.rails or None)

    def _install_fused(self) -> None:
        """A source, as an engine (first, restarted or refilled) joins: our stacked-expert loader installed in its
        workers before any stacked tensor reaches them (one line if the engine lacks the extension)."""
        if self.fused:
            from ..engines.vllm_fused_load import install

            install(self.client.post, self.client.url)

    def _refilled(self, err: str | None) -> bool:
        """Collective, after a bucketed sync: False if it failed and the engine cannot be refilled (the caller
        raises every rank's error). A launched engine that died mid-sync (within ``max_restarts``) is started again
        on a fresh export of the policy (every rank writes its slices): it then serves these weights, and the next
        sync joins its new transfer group. True when the sync succeeded or the engine was refilled."""
        try:
            if not collectives.any_true(err is not None):
                return True
        except Exception:  # noqa: BLE001 - a rank is gone: no agreement, each rank raises its own line
            return False
        dead = _on_rank0(self.rank, lambda: self.server is not None and not self.server.alive()
                         and self.restarts < self.eng.max_restarts)
        if not dead:
            return False
        folder = self.folder = os.path.join(self.weights_dir, f"policy_{self.syncs % 2}")
        self.export(folder)  # every rank its own slices; ends with a barrier

        def relaunch():
            self.engines[0].restarts += 1
            logger.warning("%s engine died during the weight sync (%s): restarting it on %s (%d of %d restarts)",
                           self.engine_name, err, folder, self.restarts, self.eng.max_restarts)
            return self.server.start(folder)

        url = _on_rank0(self.rank, relaunch)
        self._connect(url)
        self.sender, self.relay, self.joined = None, None, False  # the fresh engine has no transfer group yet
        return True

    def _raise_all(self, err: str | None) -> None:
        """Collective: every rank's error (``rank r: ...``), joined in one line, raised on every rank."""
        mine = None if err is None else f"rank {self.rank}: {err}"
        try:
            errors = [e for e in collectives.all_gather_objects(mine) if e]
        except Exception as e:  # noqa: BLE001 - a rank is gone: this rank's own line
            errors = [mine or f"rank {self.rank}: {type(e).__name__} agreeing on the sync (a trainer rank gone?)"]
        if errors:
            raise EngineError(f"{self.engine_name} weight sync failed: " + "; ".join(errors))

    def _join(self, groups: list[list[int]]) -> str | None:
        """The sender groups join the engine's transfer groups: each source makes its sender and rendezvous, its
        relays join at group ranks 1.. (each rank its own process: concurrently; the engine joins one group at a
        time). One all-gather of the sources' rendezvous, once."""
        from ..engines.weight_buckets import Relay

        mine = next((k for k, g in enumerate(groups) if self.rank in g), None)
        is_src = mine is not None and groups[mine][0] == self.rank
        info, err = None, None
        if is_src:
            try:
                if self.client is None:
                    self._connect(self.eng.url)
                self._install_fused()
                self.sender = self._new_sender(len(groups[mine]) - 1, mine)
                info = dict(self.sender.init_info)
            except Exception as e:  # noqa: BLE001 - raised on every rank by the caller
                err = f"{type(e).__name__}: {e}"
        infos = collectives.all_gather_objects(info) if dist.is_initialized() else [info]
        if mine is None or infos[groups[mine][0]] is None:
            return err
        try:
            if is_src:
                self.sender.init()
            else:
                info = infos[groups[mine][0]]
                self.relay = Relay(self.relay_group(info, groups[mine].index(self.rank)), mine)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None

    @staticmethod
    def relay_group(info: dict, rank: int):
        from ..engines.vllm_weights import vllm_relay_group

        return vllm_relay_group(info, rank)

    def _new_sender(self, relays: int = 0, index: int = 0):
        """A source: vLLM's packed NCCL sender (one group: ``index`` 0), posting through the client with one attempt
        per call (the engine may still be inside NCCL)."""
        from ..engines.vllm_server import free_port
        from ..engines.vllm_weights import PackedNCCLSender

        client = self.client
        return PackedNCCLSender(lambda path, body: client.post(path, body, retry=False),
                                master_address=source_address(self.rank, self.eng.nccl_address, client.url),
                                master_port=free_port(),
                                engine_workers=self.eng.gpus_per_engine,
                                bucket_bytes=self.eng.weight_sync_bucket_mb << 20, relays=relays)

    # -- 2. probe ------------------------------------------------------------------------------
    def probe(self, token_ids: list[int]) -> float:
        """Collective: max |engine - trainer| log-prob over ``token_ids``, over every alive engine (rank 0 asks
        them all at once; every rank runs one forward, with the first engine's routes). An engine that fails the
        request is dead (``_agree``); one that answers with other log-probs stops the job."""
        def ask():
            alive = [e for e in self.engines if e.alive]
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
        pending = self._take_pending(step)
        if pending is None:
            examples, prompts = self.prompts.prompts(step)
        else:
            examples, prompts = pending.examples, pending.prompts
            why = staleness_problem(step, pending.version, self.max_staleness)
            if why is not None and self.stale_rollouts == "error":
                raise StaleRollout(f"{why} ([rl] stale_rollouts = 'regenerate' generates it again from the current "
                                   "weights)")
            if why is not None:
                logger.warning("%s: generating it again from the current weights", why)
                pending = None
        self.version = step  # what the sync gives the engine (the NCCL path labels its weights with it)
        self.sync_weights()
        t0 = time.perf_counter()
        gap = self.probe(prompts[0])  # rank 0's first prompt (sent to every rank): the probe of this step
        t1 = time.perf_counter()
        if pending is None:  # the synchronous path: this step's rows from this step's weights
            pending = InFlight(step, step, examples, prompts, self._requests(step, prompts))
            pending.dealt = self._fleet().deal(pending.requests, self.expected_response)
            self.fleet.send(pending.dealt)
            self._finish(pending)
            pending.generate_s = time.perf_counter() - t1
            pending.wait_s = pending.generate_s
            self._build(pending)
        if self.max_staleness > 0 and step + 1 < self.last_step:  # generated while this step trains
            self._start(step + 1)
        self.timings.update({"rollout/probe_s": t1 - t0, "rollout/probe_gap": gap,
                             "rollout/engine_restarts": float(self.restarts),
                             "rollout/engine_starts": float(sum(e.server.starts for e in self.engines
                                                                if e.server is not None)),
                             **pending.extra})
        return pending.batch

    # -- asynchronous generation -------------------------------------------------------
    def _start(self, step: int) -> None:
        """Step ``step``'s rows requested on a background thread from the weights being served now."""
        examples, prompts = self.prompts.prompts(step)
        f = InFlight(step, self.version, examples, prompts, self._requests(step, prompts))
        f.dealt = self._fleet().deal(f.requests, self.expected_response)  # collective: here, not on the thread
        f.thread = threading.Thread(target=f.run, args=(self.fleet,), name=f"vllm-rollout-{step}", daemon=True)
        f.thread.start()
        self.pending = f

    def poll(self, step: int, wait: bool = True) -> RolloutBatch | None:
        """Collective: step ``step``'s rows once every rank has them (``wait``: blocks until then; else None
        while any rank's are still being generated), collected (a failed rank's requests recovered as in
        ``_generate``) and built; None when none were started for that step."""
        f = self.pending
        if f is None or f.step != step:
            return None
        if f.batch is None and not wait and collectives.any_true(f.thread.is_alive()):
            return None
        return self._collect(f)

    def _collect(self, f: InFlight) -> RolloutBatch:
        """Collective: ``f``'s rows, waited for, recovered and built (once)."""
        if f.batch is None:
            t0 = time.perf_counter()
            f.thread.join()
            f.wait_s = time.perf_counter() - t0
            self._finish(f)
            self._build(f)
        return f.batch

    def _finish(self, f: InFlight) -> None:
        """Collective: ``f``'s requests all answered over the fleet (failures agreed, re-dealt: ``fleet/client.py``),
        each with its engine; the per-engine metrics and the next step's expected response length."""
        f.groups, f.engine_g = self.fleet.finish(f.dealt, self._on_failure)
        f.dealt = None
        metrics = self.fleet.metrics()
        samples = sum(e.counters.samples for e in self.engines)
        if samples:  # the same on every rank (summed over ranks): the next deal's estimate
            self.expected_response = sum(e.counters.tokens for e in self.engines) / samples
        f.extra.update(metrics)

    def _take_pending(self, step: int) -> InFlight | None:
        """Collective: the rows held for ``step`` (collected now if still in flight), no longer held; or None."""
        f, self.pending = self.pending, None
        if f is None:
            return None
        if f.step != step:
            raise RuntimeError(f"the {self.engine_name} source holds step {f.step}'s rollout at step {step}")
        self._collect(f)
        return f

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
        rewards, exact = score(self.reward_fn, self.task, rows, completions, math_exact=self.math_exact,
                               format_reward=rl.format_reward)
        if rl.dump_rollouts:
            self._dump(step, rollout, rows, completions, rewards, samples, f.version, served)
        f.extra = {"rollout/generate_s": f.generate_s, "rollout/wait_s": f.wait_s,
                   "rollout/staleness": float(step - f.version), "rollout/weights_version": float(f.version)}
        f.batch = RolloutBatch(rollout, rewards, exact)
        return f.batch

    # -- checkpoint: the next step's rows -------------------------------------------------
    def save_in_flight(self, folder: str) -> None:
        """This rank's collected rows of the next step into a checkpoint's ``folder`` (``poll`` first)."""
        f = self.pending
        if f is None:
            return
        if f.batch is None:
            raise RuntimeError(f"step {f.step}'s rollout is still being generated: poll it before a checkpoint")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.dp_rank:04d}.pkl")
        with open(path + ".tmp", "wb") as out:
            pickle.dump({"step": f.step, "version": f.version, "examples": f.examples, "prompts": f.prompts,
                         "groups": f.groups, "generate_s": f.generate_s}, out)
        os.replace(path + ".tmp", path)

    def load_in_flight(self, folder: str, step: int) -> bool:
        """Collective: the rows a checkpoint saved for ``step`` (the step it resumes at), rebuilt; False when it
        holds none (a synchronous run's checkpoint): the step is generated as usual."""
        path = os.path.join(folder, f"rank{self.dp_rank:04d}.pkl")
        have = collectives.all_gather_objects(os.path.isfile(path))
        if not any(have):
            return False
        if not all(have):
            raise StaleRollout(f"{folder}: in-flight rollouts of some ranks only (ranks {have}): a checkpoint of "
                               "another data-parallel size? Resume with the same parallelism")
        with open(path, "rb") as src:
            d = pickle.load(src)
        if d["step"] != step:
            raise StaleRollout(f"{path}: holds step {d['step']}'s rollout, resuming at step {step}")
        self.pending = InFlight(d["step"], d["version"], d["examples"], d["prompts"], [], groups=d["groups"],
                                generate_s=d["generate_s"])
        self._build(self.pending)
        return True

    def _dump(self, step, rollout, rows, completions, rewards, samples, version: int, served=()) -> None:
        """The step's rows (as embedded mode dumps them, named by the step that trains on them, with the
        ``weights_version`` that generated them, the ``engine`` that served each and the version that engine
        said it served) plus the engines' own routes, per rank."""
        folder = os.path.join(self.cfg.job.dump_folder, "rollouts")
        records = dump_rows(step, self.dp_rank, rollout, rows, completions, rewards)
        for r, (k, v) in zip(records, served or [(-1, -1)] * len(records)):
            r["weights_version"], r["engine"], r["engine_weights_version"] = version, k, v
        write_dump(folder, step, records)
        os.makedirs(folder, exist_ok=True)
        np.savez(os.path.join(folder, f"engine_routes_{step:05d}_rank{self.dp_rank:04d}.npz"),
                 routes_NXK=np.concatenate([s.routes_RXK for s in samples]),
                 routed_N=np.array([len(s.routes_RXK) for s in samples]),
                 logprobs_NT=rollout.logprobs_BT.numpy(), weights_version=np.int64(version),
                 engine_N=np.array([k for k, _ in served] or [-1] * len(samples), np.int64))

    def state_dict(self) -> dict:
        return {}  # prompts and sampling seeds are functions of (seed, step, rank)

    def load_state_dict(self, state: dict) -> None:
        pass
