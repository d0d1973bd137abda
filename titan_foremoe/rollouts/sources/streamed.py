"""The streamed weight syncs of a live engine (``weight_sync = "nccl"`` / SGLang's ``"distributed"``, ``"ipc"``):
the policy in buckets to the engine, no folder after its launch (``engines/weight_buckets.py``,
``engines/ipc_weights.py``).

A mixin of the live sources (``sources/vllm.py``), kept apart so the source is the step and the fleet, and each
sync design is one module: ``_sync_nccl`` (sender groups, each a source rank and its node's relays; the first sync
joins the engine's transfer groups), ``_sync_ipc`` (a colocated engine on rank 0's node, by CUDA IPC handles), and
``_refilled`` (an engine that died mid-sync restarted on a fresh export). One engine: its sender groups
(``sync_cost.sender_groups``; SGLang's several). A vLLM fleet (``nccl``, K > 1 engines): ONE transfer group
(``sync_cost``'s ``one_group``): engine 0's source (``layout.one_group``), its node's other ranks as relays, then
engine k's workers at rank offset ``1 + relays + k * g`` (vLLM's ``rank_offset`` / ``world_size``), every route
posted to every engine at once (``PackedNCCLSender`` with one post per engine); each bucket is gathered to the one
source and broadcast once for all engines. A dead engine breaks the group for all (NCCL cannot drop a rank): the
group is made again over the alive engines (new port, offsets recomputed) whenever the alive set differs from the
joined one (an engine agreed dead, or back), and a sync that fails with an engine found dead is retried at once on
the survivors' new group (``_regroup``): a failure costs one NCCL init of the new group (the engines' and the
trainer ranks' communicators, ~1-2 s at 64 GPUs: assumed, not measured here) and one more sync.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from ...distributed import collectives
from ..engines.errors import EngineError
from ..sample import RolloutError

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


class StreamedSync:
    """The streamed syncs of ``VLLMSource`` (module docstring); the source provides ``eng``, ``engines``,
    ``weights``, ``export`` and the fleet."""

    def senders(self) -> int:
        """Sender groups the engine takes: vLLM's transfer group broadcasts from its rank 0 only, one group per
        server (``init_weight_transfer_engine``), so one (``engines/vllm_weights.py``)."""
        return 1

    grouped: tuple[int, ...] | None = None
    """A fleet's engines in the joined transfer group (``_sync_nccl``)."""

    def _sync_nccl(self, t0: float, retry: bool = True) -> None:
        """Collective: the policy in buckets to the engine (``engines/weight_buckets.py``): each sender group's
        source gathers its buckets (every rank's slice crossing nodes once, to its rail on the source's node) and
        broadcasts them, the other ranks of its group relay them; the first sync joins the transfer groups. Every
        rank's error is raised on every rank, in one line."""
        from ..engines.sync_cost import sender_groups
        from ..engines.vllm_weights import RailGroups
        from ..engines.weight_buckets import sync_buckets

        world = dist.get_world_size() if dist.is_initialized() else 1
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) or 1
        alive = None  # one engine: its sender groups; a fleet: ONE group of the alive engines (module docstring)
        if len(self.engines) == 1:
            groups = sender_groups(world, per_node, self.senders())
        else:
            groups, alive = [self.layout.one_group()], tuple(e.index for e in self.engines if e.alive)
            if not alive:
                raise EngineError(f"{self.engine_name} weight sync: every engine of the fleet is dead")
            if self.joined and alive != self.grouped:  # an engine dead (or back): a new group of the alive ones
                self.sender, self.relay, self.joined = None, None, False
        if not self.joined:  # the first sync: the sources and their relays join the engine's transfer groups
            if self.rails is None:  # every rank, once (a refilled engine keeps them)
                self.rails = (RailGroups.make(world, per_node) if world > 1 else None) or False
            if alive is not None:  # a dead engine in the group would leave every member in its rendezvous
                alive = tuple(k for k in alive if k not in self._mark_dead(alive, "found dead before joining"))
                if not alive:
                    raise EngineError(f"{self.engine_name} weight sync: every engine of the fleet is dead")
            self._raise_all(self._join(groups, alive))
            self.joined, self.grouped = True, alive
        stream = self._bucket_stream([g[0] for g in groups])
        err = sync_buckets(stream, self.rank, self.sender, self.relay, weight_version=str(self.version))
        if alive is not None and self._regroup(err, alive) and retry:
            return self._sync_nccl(t0, retry=False)  # the survivors' new group, this sync's weights
        self._streamed(err, t0)

    def _regroup(self, err: str | None, alive: tuple[int, ...]) -> bool:
        """Collective, after a fleet's one-group sync: when it failed, rank 0 asks each engine of the group whether
        it is alive (a launched one's process, else ``/health``); the dead are marked (agreed) and the group is to
        be made again. True when the sync failed, some engine is dead and some survives (retry on the survivors)."""
        try:
            if not collectives.any_true(err is not None):
                return False
        except Exception:  # noqa: BLE001 - a rank is gone: no agreement, each rank raises its own line
            return False
        dead = self._mark_dead(alive, f"dead during the weight sync ({err})")
        if dead:
            self.sender, self.relay, self.joined = None, None, False
        return bool(dead) and len(dead) < len(alive)

    def _mark_dead(self, alive: tuple[int, ...], why: str) -> list[int]:
        """Collective: rank 0 asks each engine of ``alive`` whether it is up (a launched one's process, else its
        ``/health``: one GET each, at a join or a failed sync only); the dead ones, marked dead on every rank."""
        def dead_engines():
            def up(e):
                if e.server is not None:
                    return e.server.alive()
                healthy = getattr(e.client, "healthy", None)
                return bool(healthy()) if callable(healthy) else True
            return [k for k in alive if not up(self.engines[k])]

        dead = _on_rank0(self.rank, dead_engines)
        for k in dead:
            engine = self.engines[k]
            engine.failures += engine.alive
            engine.alive = False
        if dead:
            logger.warning("%s engine fleet: engines %s %s: a new transfer group of engines %s", self.engine_name,
                           dead, why, [k for k in alive if k not in dead])
        return dead

    def _streamed(self, err: str | None, t0: float) -> None:
        """Collective, after a streamed sync: refill a dead engine or raise every rank's error; every rank on the
        engine's (possibly new) URL."""
        if not self._refilled(err):
            self._raise_all(err)
        if len(self.engines) == 1:  # a refilled engine's new URL (a fleet's engines are not refilled mid-sync)
            url = collectives.broadcast_object(self.client.url if self.rank == 0 else None, src=0)
            if self.client is None or self.client.url != url:
                self._connect(url)
        for engine in self.engines:  # a fleet's one group: its engines only (the dead stay out)
            if self.grouped is None or engine.index in self.grouped:
                engine.version, engine.alive = self.version, True
        self.syncs += 1
        self.timings.update({"rollout/weight_export_s": 0.0, "rollout/weight_load_s": time.perf_counter() - t0})

    @property
    def streams(self) -> bool:
        """The weights stream to the engine (NCCL / IPC), no folder after the launch."""
        return self.eng.weight_sync in (self.stream_sync, "ipc")

    def _sync_ipc(self, t0: float) -> None:
        """Collective: the policy in buckets to the colocated engines by IPC handles (``engines/ipc_weights.py``):
        every rank gathers each bucket whole (each slice crossing nodes once per node, over its rail's NIC) and
        copies it into its exported buffer, each engine's source posts its block's handles, all engines at once;
        the first sync sends the init info. Every rank's error is raised on every rank, in one line."""
        from ..engines.ipc_weights import IPCSender, ipc_node, sync_ipc
        from ..engines.vllm_weights import RailGroups

        world = dist.get_world_size() if dist.is_initialized() else 1
        per_node = min(int(os.environ.get("LOCAL_WORLD_SIZE", "1")) or 1, world)
        self._fleet()
        layout = self.layout
        if self.rails is None:  # every rank, once (a refilled engine keeps them)
            self.rails = (RailGroups.make(world, per_node) if world > 1 else None) or False
        if self.ipc is None:  # every rank, once: the engines' block groups
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            self.ipc = ipc_node(layout, self.rank, world, device) or False
        if not self.joined:  # the first sync, or a refilled engine: each engine's source sends the init info
            err = None
            for engine in self.engines:
                if engine.slot.source_rank != self.rank:
                    continue
                try:
                    if engine.client is None:
                        self._connect(engine.slot.url or self.eng.url, engine.index)
                    client = engine.client
                    self._install_fused(client)
                    self.ipc.poster = IPCSender(lambda path, body, c=client: c.post(path, body, retry=False))
                    self.ipc.poster.init()
                except Exception as e:  # noqa: BLE001 - raised on every rank
                    err = f"{type(e).__name__}: {e}"
            self._raise_all(err)
            self.joined = True
        stream = self._bucket_stream(0, everywhere=True)
        self._streamed(sync_ipc(stream, self.rank, self.ipc or None, weight_version=str(self.version),
                                sources=layout.sources()), t0)

    def _bucket_stream(self, src: int | list[int], everywhere: bool = False):
        """This sync's pass in buckets (``engines/weight_buckets.py``), from each sender group's source ``src``; with
        ``fused`` each layer's experts as two stacked tensors (the engine's extension is installed when it joins;
        vLLM's NCCL and IPC consumers take a tensor past the bucket size whole)."""
        from ..engines.weight_buckets import BucketStream

        weights = self.weights()
        weights.fused = self.fused
        return BucketStream(weights, self.eng.weight_sync_bucket_mb << 20, src=src, rails=self.rails or None,
                            everywhere=everywhere)

    def _install_fused(self, client=None) -> None:
        """A source, as an engine (first, restarted or refilled) joins: our stacked-expert loader installed in its
        workers before any stacked tensor reaches them (one line if the engine lacks the extension)."""
        if self.fused:
            from ..engines.vllm_fused_load import install

            client = client or self.client
            install(client.post, client.url)

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
        if len(self.engines) > 1:  # a fleet's engine dead mid-sync: the step stops (refill: docs/rollouts_vllm.md)
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
        self.sleep.fresh()  # relaunched: awake
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

    def _join(self, groups: list[list[int]], fleet: tuple[int, ...] | None = None) -> str | None:
        """The sender groups join the engine's transfer groups: each source makes its sender and rendezvous, its
        relays join at group ranks 1.. (each rank its own process: concurrently; the engine joins one group at a
        time). ``fleet``: the engines of a fleet's one group (one source, every engine's workers after the
        relays). One all-gather of the sources' rendezvous, at each join."""
        from ..engines.weight_buckets import Relay

        mine = next((k for k, g in enumerate(groups) if self.rank in g), None)
        is_src = mine is not None and groups[mine][0] == self.rank
        info, err = None, None
        if is_src:
            try:
                for engine in [self.engines[k] for k in fleet] if fleet else [self.engines[0]]:
                    if engine.client is None:
                        self._connect(engine.slot.url or self.eng.url, engine.index)
                    self._install_fused(engine.client)
                self.sender = self._new_sender(len(groups[mine]) - 1, mine, fleet=fleet)
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

    def _new_sender(self, relays: int = 0, index: int = 0, fleet: tuple[int, ...] | None = None):
        """A source: vLLM's packed NCCL sender (one group: ``index`` 0; ``fleet``: every engine of the one group),
        posting through the clients with one attempt per call (the engine may still be inside NCCL); a fresh port
        each time (a new group after a failure)."""
        from ..engines.vllm_server import free_port
        from ..engines.vllm_weights import PackedNCCLSender

        clients = [self.engines[k].client for k in fleet] if fleet else [self.engines[0].client]
        posts = [lambda path, body, c=c: c.post(path, body, retry=False) for c in clients]
        client = clients[0]
        return PackedNCCLSender(posts if fleet else posts[0],
                                master_address=source_address(self.rank, self.eng.nccl_address, client.url),
                                master_port=free_port(),
                                engine_workers=self.eng.gpus_per_engine,
                                bucket_bytes=self.eng.weight_sync_bucket_mb << 20, relays=relays)
