"""The rollout phase of the simulated step, on the engine fleet the runtime would launch.

The fleet is ``rollouts/fleet/layout.py``'s ``engine_layout`` of the config (``fleet_of_config``: ``[rollout_engine]
engines``, ``gpus_per_engine``, ``urls``, ``colocated``, read with defaults so a config from before the fleet keys
gives one engine as the runtime drove it) or of the simulator's flags (``fleet_layout``). ``rollout_phase``
charges on it: the rollout as the fleet client deals it (``rollout.rollout_ms``) or the embedded loop
(``embedded_rollout.py``), the sync to every engine at once (``sync_cost.fleet_sync_cost`` disaggregated, by default
``one_group``: the one transfer group of every engine's workers that ``sources/streamed.py`` runs;
``colocated_ipc_cost``: every node's engines fed at once, colocated), and colocated engines' sleep and wake
(``rollout.sleep_wake_ms``).
"""

from __future__ import annotations

import numpy as np

from ..rollouts.engines.sync_cost import (FleetSync, SyncLinks, SyncSetting, colocated_ipc_cost, expert_tensor_count,
                                          fleet_sync_cost, hf_tensor_bytes)
from ..rollouts.fleet.layout import EngineLayout, engine_layout
from .embedded_rollout import embedded_rollout_ms
from .rollout import rollout_ms, sleep_wake_ms, weight_sync_ms


def fleet_layout(trainer_gpus: int, gpus_per_node: int, rollout_gpus: int, engine_gpus: int, engines: int = 0
                 ) -> EngineLayout:
    """The simulator's flags as a layout: ``rollout_gpus`` 0 colocated (``engines`` 0: one per ``engine_gpus``
    GPUs of the job), else ``engines`` (0: ``rollout_gpus // engine_gpus``) of their own."""
    g = engine_gpus or gpus_per_node
    if rollout_gpus:
        K = engines or max(rollout_gpus // g, 1)
        if K * g > rollout_gpus:
            raise ValueError(f"{K} engines of {g} GPUs need {K * g} GPUs; --rollout-gpus is {rollout_gpus}")
        return engine_layout(trainer_gpus=trainer_gpus, gpus_per_node=gpus_per_node, engines=K, gpus_per_engine=g,
                             colocated=False)
    return engine_layout(trainer_gpus=trainer_gpus, gpus_per_node=gpus_per_node, engines=engines,
                         gpus_per_engine=min(g, gpus_per_node), colocated=True)


def fleet_of_config(cfg, trainer_gpus: int, gpus_per_node: int) -> EngineLayout:
    """The fleet a config launches, as the runtime reads it (``rollouts.fleet.layout.fleet_of``)."""
    from ..rollouts.fleet.layout import fleet_of

    return fleet_of(cfg.rollout_engine, trainer_gpus, gpus_per_node)


def fleet_sync_ms(model, link, layout: EngineLayout, design: str = "one_group", bucket_mb: int = 512,
                  load: str = "stacked") -> dict:
    """One sync to every engine of ``layout`` at once: disaggregated ``fleet_sync_cost`` of ``design`` (default the
    runtime's ``one_group``; ``per_engine`` / ``node_forward`` for comparison); colocated,
    the IPC sync of each node with an engine, all nodes at once. ``{"sync_ms", "detail"}``."""
    sizes = hf_tensor_bytes(model, 2)
    links = SyncLinks.of(link)
    kw = dict(bucket_bytes=bucket_mb << 20, state_entries=12 * model.num_layers + 3,
              expert_tensors=expert_tensor_count(model), load=load)
    if layout.colocated:
        T, n = layout.trainer_gpus, layout.gpus_per_node
        s = SyncSetting("bucketed", T, 0, layout.engines[0].gpus, n, **kw)
        r = colocated_ipc_cost(sizes, s, links)  # every rank gathers every entry: all engines fed at once
        return {"sync_ms": r["sync_s"] * 1e3, "detail": {"engines": layout.count, "stages_s": r["stages_s"]}}
    r = fleet_sync_cost(sizes, FleetSync.of(layout, design, **kw), links)
    return {"sync_ms": r["sync_s"] * 1e3, "detail": {k: v for k, v in r.items() if k != "failure_isolation"}}


def rollout_phase(model, cal, link, lens_by_group: list[np.ndarray], layout: EngineLayout, rollout, ep: int,
                  hbm_Bps: float) -> dict:
    """The rollout, sync and sleep/wake of one step (``RolloutSpec`` ``rollout``) on ``layout``."""
    g = layout.engines[0].gpus
    lens = np.concatenate(lens_by_group)
    if rollout.source == "embedded":
        roll = embedded_rollout_ms(model, cal, link, lens_by_group, ep, rollout.prompt_tokens, hbm_Bps,
                                   rollout.embedded_lockstep, rollout.embedded_attention)
        return {"roll": roll, "sync_ms": 0.0, "sleep_wake_ms": 0.0, "layout": None}
    pool = layout.trainer_gpus if layout.colocated else layout.engine_gpus
    roll = rollout_ms(model, cal, link, lens, pool, g, rollout.prompt_tokens, rollout.max_batch, hbm_Bps,
                      rollout.decode_efficiency, engines=layout.count, samples_per_prompt=rollout.samples_per_prompt,
                      max_tokens=rollout.max_tokens)
    fleet_design = rollout.weight_sync == "bucketed" and rollout.sync_senders == 1
    if fleet_design:
        sync = fleet_sync_ms(model, link, layout, rollout.fleet_sync, rollout.sync_bucket_mb, rollout.sync_load)
    else:  # the per-tensor / reload rows and SGLang's sender groups: one engine server, as before
        sync = {"sync_ms": weight_sync_ms(model, link, layout.trainer_gpus, layout.engine_gpus, g,
                                          layout.gpus_per_node, rollout.weight_sync, rollout.sync_bucket_mb,
                                          senders=rollout.sync_senders, load=rollout.sync_load), "detail": {}}
    sw = sleep_wake_ms(model, link, g, rollout.sleep_level if layout.colocated else 0)
    return {"roll": roll, "sync_ms": sync["sync_ms"], "sync_detail": sync["detail"],
            "sleep_wake_ms": sw["sleep_ms"] + sw["wake_ms"], "sleep": sw,
            "layout": {"engines": layout.count, "gpus_per_engine": g, "colocated": layout.colocated,
                       "sources": layout.sources()}}
