"""The routing log of a batch of sequences.

Sequence b has ``lengths_B[b] = T`` tokens. Every token the model was fed
has a route; the last token (generated, never fed back) has none. So positions
``0 .. T-2`` carry the experts chosen at each MoE layer, and row ``T-1`` (and
any padding after it) is masked out. This is exactly what the recompute and
update stages need: their inputs are ``tokens[:-1]``.

Routes are stored compactly: uint8 when there are at most 256 experts, else
int16. A (position, layer) an engine sent without a route (``-1``) is a *hole*:
``live_BTX`` marks it (its stored ids are 0 filler) and ``routes_for_inputs``
hands it to the router as ``-1``, so the live router picks that token's experts
at that layer (``models/moe.py``); ``fill_holes`` writes the recompute's choice
back, after which the log is complete again and foresight can plan it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class RoutingLogError(ValueError):
    """A routing log that does not fit its batch; the message names the sequence and the field."""


def route_dtype(num_experts: int) -> torch.dtype:
    if num_experts < 1 or num_experts > 32768:
        raise ValueError(f"num_experts must be in [1, 32768], got {num_experts}")
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class RoutingLog:
    experts_BTXK: torch.Tensor
    """``[sequences, max_tokens, layers, top_k]`` expert ids (uint8 or int16)."""
    lengths_B: torch.Tensor
    """``[sequences]`` int64 token count of each sequence (routes cover the first ``T-1``)."""
    num_experts: int
    live_BTX: torch.Tensor | None = None
    """bool, True where the engine sent no route (the live router decides); None: no holes."""

    @property
    def num_sequences(self) -> int:
        return self.experts_BTXK.shape[0]

    @property
    def num_layers(self) -> int:
        return self.experts_BTXK.shape[2]

    @property
    def top_k(self) -> int:
        return self.experts_BTXK.shape[3]

    def route_mask_BT(self) -> torch.Tensor:
        """True where a position has a route (``t < T - 1``)."""
        t = torch.arange(self.experts_BTXK.shape[1])
        return t[None, :] < (self.lengths_B[:, None] - 1)

    def select(self, indices: list[int] | torch.Tensor) -> "RoutingLog":
        idx = torch.as_tensor(indices, dtype=torch.int64)
        lengths = self.lengths_B[idx]
        width = max(int(lengths.max()) if len(idx) else 1, 1)
        live = None if self.live_BTX is None else self.live_BTX[idx, :width]
        return RoutingLog(self.experts_BTXK[idx, :width], lengths, self.num_experts, live)

    def holes(self) -> int:
        """Routed positions with at least one layer the engine left without a route."""
        if self.live_BTX is None:
            return 0
        return int((self.live_BTX.any(-1) & self.route_mask_BT()[:, : self.live_BTX.shape[1]]).sum())

    def fill_holes(self, indices: list[int], used_BLXK: torch.Tensor) -> None:
        """Write the routes a forward of sequences ``indices`` used (``[B, L, layers, K]``, L >= their
        routed positions) into the holes; the log is hole-free once every hole was filled."""
        if self.live_BTX is None:
            return
        idx = torch.as_tensor(indices, dtype=torch.int64)
        n = min(used_BLXK.shape[1], self.experts_BTXK.shape[1])
        hole_BLX = self.live_BTX[idx, :n]
        cur = self.experts_BTXK[idx, :n]
        self.experts_BTXK[idx, :n] = torch.where(hole_BLX[..., None], used_BLXK[:, :n].to(cur.dtype), cur)
        self.live_BTX[idx, :n] = False
        if not self.live_BTX.any():
            self.live_BTX = None

    def routes_for_inputs(self, input_len: int) -> torch.Tensor:
        """int64 routes ``[B, input_len, layers, K]`` aligned with ``tokens[:, :-1]``; masked rows are 0,
        holes (no route) are -1."""
        B, T, X, K = self.experts_BTXK.shape
        out = torch.zeros(B, input_len, X, K, dtype=torch.int64)
        n = min(T, input_len)
        routes = self.experts_BTXK[:, :n].to(torch.int64)
        mask = self.route_mask_BT()[:, :n, None, None]
        if self.live_BTX is not None:
            routes = torch.where(self.live_BTX[:, :n, :, None], torch.full_like(routes, -1), routes)
        out[:, :n] = torch.where(mask, routes, torch.zeros_like(routes))
        return out

    def routes_at(self, seq_N: torch.Tensor, pos_N: torch.Tensor) -> torch.Tensor:
        """int64 routes ``[N, layers, K]`` of routed positions ``(seq_N, pos_N)`` (``pos < T - 1``; a packed
        micro-batch's inputs, ``rl_batches``), holes -1: ``routes_for_inputs`` without the padding."""
        routes = self.experts_BTXK[seq_N, pos_N].to(torch.int64)
        if self.live_BTX is not None:
            routes = torch.where(self.live_BTX[seq_N, pos_N][..., None], torch.full_like(routes, -1), routes)
        return routes

    @staticmethod
    def from_sequences(routes: list[torch.Tensor], lengths: list[int], num_experts: int) -> "RoutingLog":
        """Pack per-sequence ``[>= T-1, layers, K]`` routes into one padded log; ``-1`` in all K entries of a
        (position, layer) is a hole (no route)."""
        if len(routes) != len(lengths):
            raise RoutingLogError(f"{len(routes)} route arrays for {len(lengths)} sequences")
        if not routes:
            raise RoutingLogError("empty routing log")
        X, K = routes[0].shape[1:]
        width = max(max(lengths), 1)
        out = torch.zeros(len(routes), width, X, K, dtype=route_dtype(num_experts))
        live = None
        for b, (r, n) in enumerate(zip(routes, lengths)):
            if r.dim() != 3 or tuple(r.shape[1:]) != (X, K):
                raise RoutingLogError(f"sequence {b}: routes shape {tuple(r.shape)}, expected [T-1, {X}, {K}]")
            if r.shape[0] < n - 1:
                raise RoutingLogError(f"sequence {b}: {r.shape[0]} routed positions for {n} tokens (need {n - 1})")
            r = r[: n - 1]
            if r.numel() and not r.dtype.is_floating_point and int(r.min()) < 0:
                hole_RX = (r == -1).all(-1)
                if not hole_RX.any() or ((r < 0) & ~hole_RX[..., None]).any():
                    raise RoutingLogError(f"sequence {b}: expert id out of range [0, {num_experts}) "
                                          "(no route is -1 in all top-k entries of a position and layer)")
                if live is None:
                    live = torch.zeros(len(routes), width, X, dtype=torch.bool)
                live[b, : n - 1] = hole_RX
                r = torch.where(hole_RX[..., None], torch.zeros_like(r), r)
            if r.numel() and int(r.max()) >= num_experts:
                raise RoutingLogError(f"sequence {b}: expert id out of range [0, {num_experts})")
            out[b, : n - 1] = r.to(out.dtype)
        return RoutingLog(out, torch.tensor(lengths, dtype=torch.int64), num_experts, live)

    def validate(self, *, token_lengths: list[int] | torch.Tensor, num_layers: int, top_k: int,
                 num_experts: int) -> None:
        """Refuse a log that does not fit the batch it is replayed on."""
        e = self.experts_BTXK
        if e.dim() != 4:
            raise RoutingLogError(f"experts: expected [sequences, tokens, layers, top_k], got shape {tuple(e.shape)}")
        if e.dtype != route_dtype(num_experts):
            raise RoutingLogError(
                f"experts: dtype {e.dtype}, expected {route_dtype(num_experts)} for {num_experts} experts"
            )
        lengths = torch.as_tensor(token_lengths, dtype=torch.int64)
        if e.shape[0] != len(lengths) or self.lengths_B.shape[0] != len(lengths):
            raise RoutingLogError(
                f"sequence count: log has {e.shape[0]} sequences ({self.lengths_B.shape[0]} lengths), "
                f"batch has {len(lengths)}"
            )
        if e.shape[2] != num_layers:
            raise RoutingLogError(f"layers: log has {e.shape[2]} MoE layers, model has {num_layers}")
        if e.shape[3] != top_k:
            raise RoutingLogError(f"top_k: log has {e.shape[3]} experts per token, model routes to {top_k}")
        if self.num_experts != num_experts:
            raise RoutingLogError(f"num_experts: log was recorded with {self.num_experts}, model has {num_experts}")
        for b in torch.nonzero(self.lengths_B != lengths).flatten().tolist():
            raise RoutingLogError(
                f"sequence {b}: token count {int(self.lengths_B[b])} in the log, {int(lengths[b])} in the batch"
            )
        for b in torch.nonzero(lengths - 1 > e.shape[1]).flatten().tolist():
            raise RoutingLogError(f"sequence {b}: {int(lengths[b])} tokens but only {e.shape[1]} routed positions")
        mask = self.route_mask_BT()[:, : e.shape[1]]
        bad = ((e.to(torch.int64) >= num_experts) | (e.to(torch.int64) < 0)).any(-1).any(-1) & mask
        if bad.any():
            b, t = torch.nonzero(bad)[0].tolist()
            raise RoutingLogError(f"sequence {b}: expert id out of range [0, {num_experts}) at position {t}")
        dup_BTX = (e.to(torch.int64).sort(-1).values.diff(dim=-1) == 0).any(-1)
        if self.live_BTX is not None:  # holes hold 0 filler
            dup_BTX &= ~self.live_BTX[:, : e.shape[1]]
        dup = dup_BTX.any(-1) & mask
        if dup.any():
            b, t = torch.nonzero(dup)[0].tolist()
            raise RoutingLogError(f"sequence {b}: repeated expert id among the top-k at position {t}")
