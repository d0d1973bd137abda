"""One imported rollout sample, and its validation against the model.

Legend: T tokens of one sequence, R routed positions (``R = T - 1``: every
token fed to the model has a route, the last token was sampled and never fed
back, so it has none), X MoE layers, K experts per token.

A route of ``-1`` in all K entries of (position, layer) is *no route* (``NO_ROUTE``): engines send it for
tokens they did not capture (e.g. prefix-cache hits). The trainer's recompute lets the live router pick
that token's experts at that layer, and the update replays them (``docs/rollouts.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


NO_ROUTE = -1
"""A (position, layer) whose top-k the engine did not record: routed live at recompute."""


class RolloutError(ValueError):
    """A sample that cannot be imported or replayed; names the sample and the field."""

    def __init__(self, where: str, field: str, problem: str):
        super().__init__(f"{where}: {field}: {problem}")
        self.where, self.field, self.problem = where, field, problem


@dataclass(frozen=True)
class ModelSpec:
    """What routes and tokens must fit: the MoE shape (and vocabulary, when known)."""

    num_layers: int
    top_k: int
    num_experts: int
    vocab_size: int | None = None


@dataclass
class RolloutSample:
    tokens_T: np.ndarray
    """int64 prompt + completion token ids."""
    prompt_len: int
    routes_RXK: np.ndarray
    """Integer expert ids of positions ``0 .. T-2`` (any integer dtype before validation)."""
    logprobs_T: np.ndarray | None = None
    """float32 behaviour log-prob of token t given tokens < t; NaN where the engine gave none (the prompt)."""
    reward: float | None = None
    answer: str | None = None
    group: str | None = None
    """Samples of one prompt share a group (GRPO advantages); None: decided from the prompt tokens."""
    loss_mask_T: np.ndarray | None = None
    """bool per token: trained (the assistant's output). Multi-turn: tool and user tokens inside the completion
    are False (replayed and routed, not trained). None: every completion token is trained."""


def to_logical(routes_RXK: np.ndarray, map_XP: np.ndarray, where: str) -> np.ndarray:
    """Physical expert slots (an engine-side EPLB's replicas) to logical expert ids: ``map_XP[x, p]`` is the
    logical expert of physical slot p in MoE layer x. An id outside the map is refused naming it."""
    r = np.asarray(routes_RXK)
    if r.ndim != 3 or not np.issubdtype(r.dtype, np.integer):
        return routes_RXK  # validate_sample names what is wrong
    r = r.astype(np.int64)
    if map_XP.shape[0] != r.shape[1]:
        raise RolloutError(where, "routes", f"{r.shape[1]} layers, the expert map has {map_XP.shape[0]}")
    hole_RX1 = (r == NO_ROUTE).all(-1, keepdims=True)  # no route stays no route
    bad = ((r < 0) | (r >= map_XP.shape[1])) & ~hole_RX1
    if bad.any():
        p, x, k = np.argwhere(bad)[0]
        raise RolloutError(where, "routes", f"physical expert id {int(r[p, x, k])} outside the expert map's "
                           f"{map_XP.shape[1]} slots at position {p}, layer {x}")
    return np.where(hole_RX1, NO_ROUTE, map_XP[np.arange(r.shape[1])[None, :, None], np.where(hole_RX1, 0, r)])


def validate_sample(s: RolloutSample, spec: ModelSpec, where: str) -> None:
    """Raise ``RolloutError`` naming ``where`` and the field for anything the trainer cannot replay exactly."""
    t = s.tokens_T
    if t.ndim != 1 or not np.issubdtype(t.dtype, np.integer):
        raise RolloutError(where, "tokens", f"expected a 1-D list of integer ids, got shape {t.shape} dtype {t.dtype}")
    T = len(t)
    if T < 2:
        raise RolloutError(where, "tokens", f"{T} tokens: need a prompt and at least one completion token")
    if t.min() < 0 or (spec.vocab_size is not None and t.max() >= spec.vocab_size):
        raise RolloutError(where, "tokens", f"id out of range [0, {spec.vocab_size}): min {t.min()}, max {t.max()}")
    if not 1 <= s.prompt_len < T:
        raise RolloutError(where, "prompt_len", f"{s.prompt_len} for {T} tokens: need 1 <= prompt_len < tokens")
    if s.loss_mask_T is not None and s.loss_mask_T.shape != (T,):
        raise RolloutError(where, "loss_mask", f"shape {s.loss_mask_T.shape} for {T} tokens")
    r = s.routes_RXK
    if r.ndim != 3:
        raise RolloutError(where, "routes", f"shape {r.shape}, expected [tokens - 1, layers, top_k]")
    if not np.issubdtype(r.dtype, np.integer):
        raise RolloutError(where, "routes", f"dtype {r.dtype} is not an integer type")
    if r.shape[0] != T - 1:
        raise RolloutError(
            where, "routes",
            f"{r.shape[0]} routed positions for {T} tokens, expected {T - 1} "
            "(one per token fed to the model; the last token has none)",
        )
    if r.shape[1] != spec.num_layers:
        raise RolloutError(where, "routes", f"{r.shape[1]} layers, model has {spec.num_layers} MoE layers")
    if r.shape[2] != spec.top_k:
        raise RolloutError(where, "routes", f"{r.shape[2]} experts per token, model routes to top-{spec.top_k}")
    hole_RX = (r == NO_ROUTE).all(-1)  # no route: the live router decides (all K entries -1 together)
    bad = ((r < 0) | (r >= spec.num_experts)) & ~hole_RX[..., None]
    if bad.any():
        p, x, k = np.argwhere(bad)[0]
        hint = (" (no route must be -1 in all top-k entries of a position and layer)" if r[p, x, k] == NO_ROUTE
                else " (physical slot ids of an engine-side EPLB with redundant experts? import with --expert-map)"
                if r[p, x, k] >= spec.num_experts else "")
        raise RolloutError(where, "routes", f"expert id {int(r[p, x, k])} out of range [0, {spec.num_experts}) "
                           f"at position {p}, layer {x}{hint}")
    if spec.top_k > 1:
        dup = np.zeros(r.shape[:2], dtype=bool)
        for a in range(spec.top_k):  # K(K-1)/2 vectorized compares: ~10x faster than sorting K-long rows
            for b in range(a + 1, spec.top_k):
                dup |= r[..., a] == r[..., b]
        dup &= ~hole_RX
        if dup.any():
            p, x = np.argwhere(dup)[0]
            raise RolloutError(where, "routes",
                               f"repeated expert id in the top-{spec.top_k} at position {p}, layer {x}: {r[p, x].tolist()}")
    lp = s.logprobs_T
    if lp is not None:
        if lp.shape != (T,):
            raise RolloutError(where, "logprobs", f"shape {lp.shape}, expected ({T},): one per token")
        trained = np.arange(T) >= s.prompt_len if s.loss_mask_T is None else s.loss_mask_T.astype(bool)
        missing = np.flatnonzero(np.isnan(lp) & trained)  # untrained tool / user tokens need none
        if len(missing):
            raise RolloutError(where, "logprobs", f"missing at trained completion position {int(missing[0])}")
        done = lp[trained]
        if not np.isfinite(done).all() or (done > 1e-4).any():
            raise RolloutError(where, "logprobs", "completion log-probs must be finite and <= 0")
    if s.reward is not None and not math.isfinite(s.reward):
        raise RolloutError(where, "reward", f"{s.reward} is not finite")
