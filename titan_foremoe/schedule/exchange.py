"""Move each of a step's sequences to the rank the sequence schedule gave it: one host exchange per step.

A rollout arrives split over the data-parallel ranks (each rank generated, read or received its own prompts'
rows); the schedule (``schedule_sequences``) puts every sequence on a (rank, micro-step). Each rank then sends
the rows it holds to their ranks, trimmed to their own length, and builds its local ``Rollout`` from what it
receives, in global sequence order: tokens, behaviour log-probs, the multi-turn loss mask, the routing log (and
its holes), the advantage, whether the row is trained and its per-layer expert counts (``loads.row_loads``).

Cost at the real size (Qwen3-30B-A3B, 48 MoE layers, top-8, uint8 routes): a token travels with 8 B of id, 4 B
of log-prob and 384 B of routes, so ~0.4 KB per token (plus 24 KB of per-layer expert counts per sequence); a rank holding 64 sequences of 8k tokens sends at most
~0.2 GB, and only the rows whose rank changes (``moved_fraction``): with R = 64 / 256 / 1024 each rank still sends
and receives only its own rows (one all-to-all of counts, one of bytes: two collectives per step, none per
micro-step), on the host, before the stages start. No device memory, no host sync of a device tensor.

Legend: N sequences of the step over all ranks, B rows held by this rank, T tokens, X MoE layers, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..distributed import collectives
from ..rollouts.generate import Rollout
from ..routing_log import RoutingLog


@dataclass
class LocalRows:
    """This rank's share of a step after the exchange."""

    rollout: Rollout
    advantages_B: torch.Tensor
    trained_B: torch.Tensor | None  # None: every row is trained
    ids_B: np.ndarray  # the global sequence id of each local row, ascending
    loads_BLE: torch.Tensor | None = None  # each row's token-expert counts per layer (loads.row_loads), if counted

    def local(self, global_ids: list[int]) -> list[int]:
        """Local row indices of global sequence ids held here."""
        return np.searchsorted(self.ids_B, np.asarray(global_ids, dtype=np.int64)).tolist()


def _rows_payload(rollout: Rollout, rows: np.ndarray, ids: np.ndarray, advantages_B: torch.Tensor,
                  trained_B: torch.Tensor | None, loads_BLE: torch.Tensor | None) -> dict:
    """The rows ``rows`` of ``rollout``, each trimmed to its own length (numpy, picklable)."""
    lengths = rollout.lengths_B[rows].tolist()
    routes = rollout.routes
    return {
        "ids": ids,
        "lengths": np.asarray(lengths, dtype=np.int64),
        "prompt_lens": rollout.prompt_lens_B[rows].numpy(),
        "finished": rollout.finished_B[rows].numpy(),
        "advantages": advantages_B[rows].numpy(),
        "trained": None if trained_B is None else trained_B[rows].numpy(),
        "loads": None if loads_BLE is None else loads_BLE[rows].numpy(),
        "tokens": [rollout.tokens_BT[r, :n].numpy() for r, n in zip(rows.tolist(), lengths)],
        "logprobs": [rollout.logprobs_BT[r, :n].numpy() for r, n in zip(rows.tolist(), lengths)],
        "loss_mask": None if rollout.loss_mask_BT is None else
        [rollout.loss_mask_BT[r, :n].numpy() for r, n in zip(rows.tolist(), lengths)],
        "experts": [routes.experts_BTXK[r, : max(n - 1, 0)].numpy() for r, n in zip(rows.tolist(), lengths)],
        "live": None if routes.live_BTX is None else
        [routes.live_BTX[r, : max(n - 1, 0)].numpy() for r, n in zip(rows.tolist(), lengths)],
    }


def _pad(rows: list[np.ndarray], width: int, dtype: torch.dtype, fill=0) -> torch.Tensor:
    out = torch.full((len(rows), width, *rows[0].shape[1:]), fill, dtype=dtype)
    for b, r in enumerate(rows):
        out[b, : len(r)] = torch.from_numpy(np.ascontiguousarray(r))
    return out


def _or_fill(parts: list[dict], key: str, like: str, value: bool) -> list[np.ndarray]:
    """Every row's ``key`` array; a part without one gives ``value`` over its rows' ``like`` positions."""
    return [x for p in parts for x in (p[key] if p[key] is not None else
                                       [np.full(a.shape[:1] if key == "loss_mask" else a.shape[:2], value)
                                        for a in p[like]])]


def _join(parts: list[dict], like: Rollout) -> LocalRows:
    """One ``Rollout`` of every received row, in global id order."""
    parts = [p for p in parts if len(p["ids"])]  # peers that sent nothing carry only "ids"
    cat = lambda k: np.concatenate([p[k] for p in parts])  # noqa: E731
    ids = cat("ids")
    order = np.argsort(ids, kind="stable")
    flat = lambda k: [x for p in parts for x in p[k]]  # noqa: E731
    pick = lambda xs: [xs[i] for i in order]  # noqa: E731
    lengths = torch.from_numpy(cat("lengths")[order])
    W = max(int(lengths.max()), 1)
    X, K = like.routes.num_layers, like.routes.top_k
    experts = pick(flat("experts"))
    # holes and multi-turn masks may come from some sources only: the others' rows get none / every token
    live = None if all(p["live"] is None for p in parts) else pick(_or_fill(parts, "live", "experts", False))
    loss_mask = None if all(p["loss_mask"] is None for p in parts) else pick(_or_fill(parts, "loss_mask", "tokens",
                                                                                      True))
    routes = RoutingLog(
        _pad([e.reshape(-1, X, K) for e in experts], W, like.routes.experts_BTXK.dtype),
        lengths.clone(), like.routes.num_experts,
        None if live is None else _pad([v.reshape(-1, X) for v in live], W, torch.bool, False),
    )
    if routes.live_BTX is not None and not routes.live_BTX.any():
        routes.live_BTX = None
    rollout = Rollout(
        tokens_BT=_pad(pick(flat("tokens")), W, like.tokens_BT.dtype),
        prompt_lens_B=torch.from_numpy(cat("prompt_lens")[order]),
        lengths_B=lengths,
        logprobs_BT=_pad(pick(flat("logprobs")), W, like.logprobs_BT.dtype),
        finished_B=torch.from_numpy(cat("finished")[order]),
        routes=routes,
        loss_mask_BT=None if loss_mask is None else _pad(loss_mask, W, torch.bool, False),
    )
    trained = None if parts[0]["trained"] is None else torch.from_numpy(cat("trained")[order])
    loads = None if parts[0]["loads"] is None else torch.from_numpy(cat("loads")[order])
    return LocalRows(rollout, torch.from_numpy(cat("advantages")[order]), trained, ids[order], loads)


_NONE = {"ids": np.zeros(0, dtype=np.int64)}  # a peer that gets none of this rank's rows


def exchange_rows(rollout: Rollout, advantages_B: torch.Tensor, trained_B: torch.Tensor | None,
                  ids_B: np.ndarray, dest_B: np.ndarray, group: dist.ProcessGroup | None = None,
                  loads_BLE: torch.Tensor | None = None) -> LocalRows:
    """Collective over ``group`` (the data-parallel ranks the schedule spans): send row b (global id ``ids_B[b]``)
    to rank ``dest_B[b]``; returns the rows this rank received. A rank that receives nothing gets an empty
    ``Rollout`` (B = 0): its micro-steps are all empty."""
    R = dist.get_world_size(group) if collectives.active(group) else 1
    dest_B = np.asarray(dest_B, dtype=np.int64)
    order = np.argsort(dest_B, kind="stable")
    cuts = np.searchsorted(dest_B[order], np.arange(R + 1))
    ids_B = np.asarray(ids_B, dtype=np.int64)
    payloads = [_rows_payload(rollout, order[a:b], ids_B[order[a:b]], advantages_B, trained_B, loads_BLE)
                if b > a else _NONE
                for a, b in zip(cuts[:-1], cuts[1:])]
    received = collectives.all_to_all_objects(payloads, group)
    if not any(len(p["ids"]) for p in received):
        empty = np.zeros(0, dtype=np.int64)
        return LocalRows(_empty_like(rollout), advantages_B[:0], None if trained_B is None else trained_B[:0], empty,
                         None if loads_BLE is None else loads_BLE[:0])
    return _join(received, rollout)


def _empty_like(rollout: Rollout) -> Rollout:
    r = rollout.routes
    return Rollout(rollout.tokens_BT[:0, :1], rollout.prompt_lens_B[:0], rollout.lengths_B[:0],
                   rollout.logprobs_BT[:0, :1], rollout.finished_B[:0],
                   RoutingLog(r.experts_BTXK[:0, :1], r.lengths_B[:0], r.num_experts),
                   None if rollout.loss_mask_BT is None else rollout.loss_mask_BT[:0, :1])
