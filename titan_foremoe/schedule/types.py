"""The schedule of one stage: every sequence's destination rank and micro-step, and its figures.

Legend: N sequences of the step (all data-parallel ranks), R ranks, U mini-batches (optimizer steps of the
stage), M micro-steps per mini-batch, X = U * M * R (mini-batch, micro-step, rank) cells, E experts, G EP groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost import DenseCost, causal_pairs


def busiest_over_mean(load_YR: np.ndarray, real_YR: np.ndarray | None = None) -> float:
    """Mean over rows with work of ``max(load) / mean(real)`` (real defaults to load); 1.0 when none has work."""
    real_YR = load_YR if real_YR is None else real_YR
    mean_Y = real_YR.mean(axis=1)
    busy = mean_Y > 0
    return float((load_YR[busy].max(axis=1) / mean_Y[busy]).mean()) if busy.any() else 1.0


@dataclass(frozen=True)
class SequenceSchedule:
    """``rank_N``, ``micro_N``: where sequence n runs; ``minibatch_N`` is the caller's, unchanged.

    ``micro_steps`` is the same for every rank and every mini-batch, so every collective of the stage is
    matched; cells with no sequence are empty micro-steps.
    """

    rank_N: np.ndarray
    micro_N: np.ndarray
    minibatch_N: np.ndarray
    micro_steps: int
    ranks: int
    minibatches: int

    def cell_N(self) -> np.ndarray:
        """Flat (mini-batch, micro-step, rank) cell of each sequence, in ``[0, U * M * R)``."""
        return (self.minibatch_N * self.micro_steps + self.micro_N) * self.ranks + self.rank_N

    def rows(self, rank: int) -> list[list[list[int]]]:
        """``[minibatch][micro_step]`` -> global sequence ids on ``rank``, ascending. O(N) for one rank."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is outside the schedule's {self.ranks} ranks")
        mine = np.flatnonzero(self.rank_N == rank)  # ascending ids
        key = self.minibatch_N[mine] * self.micro_steps + self.micro_N[mine]
        order = np.argsort(key, kind="stable")
        ids, key = mine[order], key[order]
        cuts = np.searchsorted(key, np.arange(self.minibatches * self.micro_steps + 1))
        flat = [ids[cuts[c] : cuts[c + 1]].tolist() for c in range(self.minibatches * self.micro_steps)]
        return [flat[u * self.micro_steps : (u + 1) * self.micro_steps] for u in range(self.minibatches)]

    def cell_work(self, tokens_N: np.ndarray, padded: bool = False) -> dict:
        """``[X]`` per (mini-batch, micro-step, rank) cell: ``real_tokens`` and ``real_pairs`` (the sequences' own
        positions and causal pairs), ``tokens`` and ``pairs`` computed (packed: the real ones; ``padded``: every row
        of the rank's micro-batch as long as its longest, ``rows x longest`` and ``rows x longest (longest + 1) / 2``).
        """
        tokens_N = np.asarray(tokens_N, dtype=np.int64)
        X = self.minibatches * self.micro_steps * self.ranks
        cell_N = self.cell_N()
        out = {"real_tokens": np.bincount(cell_N, tokens_N.astype(np.float64), minlength=X),
               "real_pairs": np.bincount(cell_N, causal_pairs(tokens_N), minlength=X)}
        if padded:
            rows_X = np.bincount(cell_N, minlength=X).astype(np.float64)
            longest_X = np.zeros(X)
            np.maximum.at(longest_X, cell_N, tokens_N)
            out["tokens"], out["pairs"] = rows_X * longest_X, rows_X * causal_pairs(longest_X)
        else:
            out["tokens"], out["pairs"] = out["real_tokens"], out["real_pairs"]
        return out

    def metrics(self, tokens_N: np.ndarray, cost: DenseCost = DenseCost(), *, padded: bool = False,
                loads_NE: np.ndarray | None = None, ep: int = 1) -> dict:
        """Per micro-step, the busiest rank over the mean, averaged over the stage's micro-steps with work.

        ``padded``: each rank's micro-batch is its rows padded to its longest row (today's layout); the ratios are
        then the busiest rank's computed work over the mean *real* work, and ``padding_fraction`` the padded share of
        all computed positions. ``loads_NE``: adds ``experts_max_over_mean``, per micro-step and EP group of ``ep``
        consecutive ranks the busiest expert over the mean expert, averaged.
        """
        R = self.ranks
        w = self.cell_work(tokens_N, padded)
        cost_X = cost.token * w["tokens"] + cost.pair * w["pairs"]
        real_cost_X = cost.token * w["real_tokens"] + cost.pair * w["real_pairs"]
        out = {
            "tokens_max_over_mean": busiest_over_mean(w["tokens"].reshape(-1, R), w["real_tokens"].reshape(-1, R)),
            "pairs_max_over_mean": busiest_over_mean(w["pairs"].reshape(-1, R), w["real_pairs"].reshape(-1, R)),
            "cost_max_over_mean": busiest_over_mean(cost_X.reshape(-1, R), real_cost_X.reshape(-1, R)),
            "padding_fraction": (float(1.0 - w["real_tokens"].sum() / w["tokens"].sum()) if w["tokens"].sum() > 0
                                 else 0.0),
            "micro_steps": self.micro_steps,
        }
        if loads_NE is not None:
            loads_NE = np.asarray(loads_NE, dtype=np.float64)
            group_N = self.cell_N() // ep  # (mini-batch, micro-step, EP group): ep divides R
            per_GE = np.zeros((len(w["tokens"]) // ep, loads_NE.shape[1]))
            np.add.at(per_GE, group_N, loads_NE)
            out["experts_max_over_mean"] = busiest_over_mean(per_GE)
        return out
