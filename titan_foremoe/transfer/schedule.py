"""What one rank sends and receives in one layer's weight moves and gradient return: plain index lists.

The lists are compiled ahead of the stage (``placement/tables.py``); the engine only executes them.
Legend: T rows of an exchange (one expert's weights or gradient each), R ranks (peers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

@dataclass(frozen=True)
class Exchange:
    """One uneven all-to-all of expert rows, seen from one rank.

    ``send_peer_T`` (sorted) is the destination of each row this rank sends and
    ``send_row_T`` where the row comes from; ``recv_peer_T`` (sorted) is the
    source of each row it receives, in arrival order, and ``recv_row_T`` where it
    goes. What a row index means is the exchange's (see ``LayerTransfers``).
    """

    send_peer_T: np.ndarray
    send_row_T: np.ndarray
    recv_peer_T: np.ndarray
    recv_row_T: np.ndarray

    def splits(self, num_ranks: int) -> tuple[list[int], list[int]]:
        """(input splits per destination, output splits per source) for ``all_to_all_single``."""
        return (np.bincount(self.send_peer_T, minlength=num_ranks).tolist(),
                np.bincount(self.recv_peer_T, minlength=num_ranks).tolist())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.send_peer_T, self.send_row_T, self.recv_peer_T, self.recv_row_T))


@dataclass(frozen=True)
class LayerTransfers:
    """This rank's weight moves into one bank and its gradient return, one (micro-step, layer).

    * ``direct``: rows sent over the EP collective. Send rows index ``cat(owned K, previous bank B)``
      (an owned expert or a replica resident in the other bank); receive rows are bank rows 0..n-1.
    * ``host``: the CPU-assisted lane, always from the owner's staged host copy. Send rows are owned
      indices; receive rows are the next bank rows.
    * ``keep_prev_row_U -> keep_row_U``: replicas that stay (local copy between the two banks), the last rows.
      Bank rows are numbered in arrival order (direct, host, kept) so each lane lands in place: the
      engine's all-to-all output is a run of the bank (``banks.py``) and refuses other numberings.
    * ``grad``: replica gradients back to the owners. Send rows are bank rows; receive rows are owned
      indices (summed with ``index_add``).
    * ``send_inter_T``: for ``direct`` sends, whether the destination is on another node (statistics).
    * ``stale``: compiled as the first micro-step after an optimizer step (every replica from its owner).
    * ``host_any``: some rank of the group moves a row of this layer on the host lane (the same on every rank:
      the exchange is a collective, joined by all ranks exactly when this is true).
    * ``grad_any``: some rank of the group holds a replica in this layer, so the gradient return runs (the same on
      every rank: without one no rank joins it, and the layer's bank rows get no autograd node).
    """

    direct: Exchange
    host: Exchange
    grad: Exchange
    keep_prev_row_U: np.ndarray
    keep_row_U: np.ndarray
    send_inter_T: np.ndarray
    stale: bool
    host_any: bool = True
    grad_any: bool = True

    @property
    def nbytes(self) -> int:
        return (self.direct.nbytes + self.host.nbytes + self.grad.nbytes + self.keep_prev_row_U.nbytes
                + self.keep_row_U.nbytes + self.send_inter_T.nbytes)
