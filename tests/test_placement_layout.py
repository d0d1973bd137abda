"""The index arithmetic of run-time placement, on hand-computed plans (the compiled tables and the
brute-force reference layout of ``tests/reference_layout.py`` both)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reference_layout import dest_slots, layer_layout
from titan_foremoe.metrics.heatmap import load_heatmap
from titan_foremoe.models.dispatch import route_pairs
from titan_foremoe.placement.tables import compile_micro_step
from titan_foremoe.planner.types import TRANSFER_DTYPE

# 2 ranks, 4 experts (rank 0 owns 0,1; rank 1 owns 2,3), one spare slot each.
# Expert 1 is hot: rank 1 hosts a replica of it in its spare slot.
SLOTS_RC = np.array([[0, 1, -1], [2, 3, 1]])
LOADS_SE = np.array([[1, 4, 0, 1], [0, 2, 1, 1]])  # tokens of each source for each expert
ASSIGN_ER = np.array([[1, 0], [3, 3], [0, 1], [0, 2]])  # expert 1's 6 tokens split 3 / 3
NODES = np.array([0, 0])


def test_dest_slots():
    assert dest_slots(SLOTS_RC, 4).tolist() == [[0, -1], [1, 2], [-1, 0], [-1, 1]]


def test_layer_layout_tables():
    r0 = layer_layout(0, SLOTS_RC, ASSIGN_ER, LOADS_SE, NODES)
    r1 = layer_layout(1, SLOTS_RC, ASSIGN_ER, LOADS_SE, NODES)
    # locality first: source 1 keeps its 2 tokens of expert 1 on its replica, source 0 sends 1 more there
    assert r0.send_ER.tolist() == [[1, 0], [3, 1], [0, 0], [0, 1]]
    assert r1.send_ER.tolist() == [[0, 0], [0, 2], [0, 1], [0, 1]]
    assert r0.recv_SC.tolist() == [[1, 3, 0], [0, 0, 0]]
    assert r1.recv_SC.tolist() == [[0, 1, 1], [1, 1, 2]]
    assert r0.tokens_per_slot_C.tolist() == [1, 3, 0] and r1.tokens_per_slot_C.tolist() == [1, 2, 3]
    # slot weights: owned experts from the shard (indices 0..K-1), the replica from bank row K + c
    assert r0.slot_source_C.tolist() == [0, 1, -1]
    assert r1.slot_source_C.tolist() == [0, 1, 2 + 2]
    assert r0.input_splits_R.tolist() == [4, 2] and r1.output_splits_S.tolist() == [2, 4]


def _compiled(rank, assign_ER=ASSIGN_ER):
    return compile_micro_step(SLOTS_RC[None], assign_ER[None], LOADS_SE[None], rank, 2, prev_slots_LRC=None,
                              moves_T=np.zeros(0, dtype=TRANSFER_DTYPE), stale=True)


def test_compiled_tables_match_hand_computed():
    r0, r1 = (_compiled(r).layers[0] for r in range(2))
    # source 0 sends expert 0 -> rank 0 slot 0 (1), expert 1 -> rank 0 slot 1 (3) and rank 1 slot 2 (1),
    # expert 3 -> rank 1 slot 1 (1): segments in (expert, destination) order
    d0 = r0.dispatch
    assert np.diff(d0.seg_end_Q, prepend=0).tolist() == [1, 3, 1, 1]
    assert d0.seg_rank_Q.tolist() == [0, 0, 1, 1] and d0.seg_slot_Q.tolist() == [0, 1, 2, 1]
    assert d0.recv_SC.tolist() == [[1, 3, 0], [0, 0, 0]] and r1.dispatch.recv_SC.tolist() == [[0, 1, 1], [1, 1, 2]]
    assert d0.input_splits() == [4, 2] and r1.dispatch.output_splits() == [2, 4]
    # slot weights: owned experts from the shard (0..K-1), rank 1's replica from bank row 0 (index K + 0)
    assert r0.slot_source_C.tolist() == [0, 1, -1] and r1.slot_source_C.tolist() == [0, 1, 2]
    # stale (first micro-step): rank 0 sends expert 1 to rank 1, which receives it into bank row 0
    assert r0.transfers.direct.send_peer_T.tolist() == [1] and r0.transfers.direct.send_row_T.tolist() == [1]
    assert r1.transfers.direct.recv_peer_T.tolist() == [0] and r1.transfers.direct.recv_row_T.tolist() == [0]
    # gradient return: rank 1's bank row 0 to rank 0, summed into its owned index 1
    assert r1.transfers.grad.send_peer_T.tolist() == [0] and r0.transfers.grad.recv_row_T.tolist() == [1]


def test_layout_refuses_tokens_for_an_unhosted_expert():
    bad = ASSIGN_ER.copy()
    bad[0] = [0, 1]  # rank 1 does not host expert 0
    with pytest.raises(ValueError, match="expert 0 to rank 1, which does not host it"):
        layer_layout(0, SLOTS_RC, bad, LOADS_SE, NODES)
    with pytest.raises(ValueError, match="expert 0 to rank 1 in layer 0, which does not host it"):
        _compiled(0, bad)


def test_route_pairs_fills_hosts_in_rank_order():
    d = _compiled(0).layers[0].dispatch
    e_N = torch.tensor([1, 0, 1, 3, 1, 1])  # source 0's pairs, in token order
    order, rank, slot = route_pairs(e_N, *(torch.as_tensor(a) for a in (d.seg_end_Q, d.seg_rank_Q, d.seg_slot_Q)), 3)
    # expert 1's pairs (indices 0, 2, 4, 5): the first 3 stay on rank 0, the 4th goes to rank 1's replica
    assert rank.tolist() == [0, 0, 0, 1, 0, 1]
    assert slot.tolist() == [1, 0, 1, 1, 1, 2]
    # send order: rank 0 slot 0, rank 0 slot 1 (x3), rank 1 slot 1 (expert 3), rank 1 slot 2 (replica)
    assert order.tolist() == [1, 0, 2, 4, 3, 5]


def test_heatmap_image():
    img = load_heatmap(torch.tensor([[0.0, 2.0], [5.0, 5.0]]), cell=3)
    assert img.shape == (3, 6, 6)
    assert torch.allclose(img[:, 0, 0], torch.tensor([0.07, 0.04, 0.33]))  # zero load: darkest
    assert torch.allclose(img[:, 0, 3], torch.tensor([0.99, 0.91, 0.14]))  # the layer's max: brightest
