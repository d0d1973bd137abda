"""Slow brute-force reference for ``placement/tables.py`` (the pre-compiler all-ranks layout, kept for tests).

What one rank does in one (micro-step, layer) of a plan: pure index arithmetic.

From the stage plan (``slots_MLRC``, ``assign_MLER``) and the known loads
(``loads_MLSE``) every rank derives the same tables, so the dispatcher needs
no count exchange and the transfer engine no negotiation:

* where each of this rank's token-expert pairs goes (rank and slot),
* how many rows it receives from each source for each of its slots,
* where each of its slots' weights come from (its own shard or a replica bank row).

Shape suffixes: S source ranks, R ranks, E experts, C slots per rank (E/R owned
+ spare), K owned experts per rank (E/R).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from titan_foremoe.planner.split import source_split


@dataclass(frozen=True)
class LayerLayout:
    rank: int
    slot_expert_C: np.ndarray  # expert in each of this rank's slots (-1 empty)
    dest_slot_ER: np.ndarray  # slot hosting expert e on rank r (-1 if none), all ranks
    send_ER: np.ndarray  # this rank's tokens for expert e sent to rank r
    recv_SC: np.ndarray  # rows this rank receives from source s for its slot c
    owner_E: np.ndarray
    slot_source_C: np.ndarray  # index into cat(owned K, bank C): weights of slot c (-1: empty)

    @property
    def input_splits_R(self) -> np.ndarray:
        return self.send_ER.sum(0)

    @property
    def output_splits_S(self) -> np.ndarray:
        return self.recv_SC.sum(1)

    @property
    def tokens_per_slot_C(self) -> np.ndarray:
        return self.recv_SC.sum(0)


def dest_slots(slots_RC: np.ndarray, num_experts: int) -> np.ndarray:
    """``[E, R]``: the first slot of rank r that hosts expert e, -1 where none does."""
    R, C = slots_RC.shape
    out = np.full((num_experts, R), -1, dtype=np.int64)
    for c in range(C - 1, -1, -1):  # reversed so the first matching slot wins
        e = slots_RC[:, c]
        ok = e >= 0
        out[e[ok], np.nonzero(ok)[0]] = c
    return out


def layer_layout(
    rank: int, slots_RC: np.ndarray, assign_ER: np.ndarray, loads_SE: np.ndarray, node_of_rank_R: np.ndarray
) -> LayerLayout:
    """This rank's dispatch and weight tables for one layer of one micro-step."""
    R, C = slots_RC.shape
    E = assign_ER.shape[0]
    K = E // R
    dest_ER = dest_slots(slots_RC, E)
    hosted = dest_ER >= 0
    if (assign_ER[~hosted] > 0).any():
        e, r = np.argwhere((assign_ER > 0) & ~hosted)[0]
        raise ValueError(f"plan sends tokens of expert {e} to rank {r}, which does not host it")
    tokens_SER = source_split(loads_SE, assign_ER, node_of_rank_R)
    slot_expert_C = slots_RC[rank]
    recv_SC = np.zeros((R, C), dtype=np.int64)
    for c, e in enumerate(slot_expert_C):
        if e >= 0 and dest_ER[e, rank] == c:
            recv_SC[:, c] = tokens_SER[:, e, rank]
    owner_E = np.arange(E) // K
    slot_source_C = np.where(
        slot_expert_C < 0, -1, np.where(owner_E[slot_expert_C.clip(0)] == rank, slot_expert_C.clip(0) - rank * K,
                                        K + np.arange(C))
    )
    return LayerLayout(rank, slot_expert_C, dest_ER, tokens_SER[rank], recv_SC, owner_E, slot_source_C)
