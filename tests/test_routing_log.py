"""Routing-log checks, the external-engine import (off-by-one) and the loads built from logs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titan_foremoe.loads import micro_step_loads, row_loads, sequence_loads
from titan_foremoe.routing_log import RoutingLog, RoutingLogError, from_external, route_dtype


def _log(lengths=(4, 3), layers=2, top_k=2, experts=8) -> RoutingLog:
    routes = [torch.tensor([[[(t + l) % experts, (t + l + 1) % experts] for l in range(layers)]
                            for t in range(n - 1)]) for n in lengths]
    return RoutingLog.from_sequences(routes, list(lengths), experts)


def _validate(log, lengths=(4, 3), layers=2, top_k=2, experts=8):
    log.validate(token_lengths=list(lengths), num_layers=layers, top_k=top_k, num_experts=experts)


def test_compact_dtype():
    assert route_dtype(256) == torch.uint8 and route_dtype(257) == torch.int16
    assert _log().experts_BTXK.dtype == torch.uint8


def test_valid_log_and_mask():
    log = _log()
    _validate(log)
    assert log.route_mask_BT().tolist() == [[True, True, True, False], [True, True, False, False]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lengths": (4, 3, 5)}, "sequence count: log has 2 sequences"),
        ({"lengths": (4, 5)}, "sequence 1: token count 3 in the log, 5 in the batch"),
        ({"layers": 3}, "layers: log has 2 MoE layers, model has 3"),
        ({"top_k": 4}, "top_k: log has 2 experts per token, model routes to 4"),
        ({"experts": 300}, "experts: dtype torch.uint8, expected torch.int16"),
    ],
)
def test_log_that_does_not_fit_its_batch(kwargs, message):
    with pytest.raises(RoutingLogError, match=message):
        _validate(_log(), **kwargs)


def test_expert_out_of_range_and_dtype_named_with_the_sequence():
    log = _log()
    log.experts_BTXK[1, 1, 0, 1] = 9
    with pytest.raises(RoutingLogError, match=r"sequence 1: expert id out of range \[0, 8\) at position 1"):
        _validate(log)
    log = _log()
    log.experts_BTXK[1, 2, 0, 1] = 200  # masked row (the last token): ignored
    _validate(log)
    log = _log()
    log.experts_BTXK = log.experts_BTXK.float()
    with pytest.raises(RoutingLogError, match="experts: dtype torch.float32"):
        _validate(log)
    log = _log()
    log.experts_BTXK[0, 0, 1] = 5
    with pytest.raises(RoutingLogError, match="sequence 0: repeated expert id"):
        _validate(log)


def test_external_import_off_by_one():
    # vLLM / SGLang: one row per token fed through the model, i.e. seq_len - 1 rows
    arrays = [np.array([[[0, 1]], [[2, 3]], [[4, 5]]]), np.array([[[6, 7]]])]
    log = from_external(arrays, num_experts=8, seq_lens=[4, 2])
    assert log.lengths_B.tolist() == [4, 2]
    _validate(log, lengths=(4, 2), layers=1, top_k=2)
    # aligned with tokens[:-1]: input position t has the route of row t; the last token has none
    routes = log.routes_for_inputs(3)
    assert routes[0, :, 0].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert routes[1, :, 0].tolist() == [[6, 7], [0, 0], [0, 0]]
    assert log.route_mask_BT().sum(1).tolist() == [3, 1]


def test_external_import_errors():
    # an array with one row per token (forgetting the off-by-one) is refused
    distinct = np.tile(np.array([0, 1]), (3, 1, 1))
    with pytest.raises(RoutingLogError, match="sequence 0: routed_experts has 3 rows, expected seq_len - 1 = 2"):
        from_external([distinct], num_experts=8, seq_lens=[3])
    with pytest.raises(RoutingLogError, match="sequence 1: routed_experts has shape"):
        from_external([np.zeros((3, 1, 2), dtype=np.int64), np.zeros((3, 2), dtype=np.int64)], num_experts=8)
    with pytest.raises(RoutingLogError, match="sequence 0: routed_experts dtype"):
        from_external([np.zeros((3, 1, 2), dtype=np.float32)], num_experts=8)
    with pytest.raises(RoutingLogError, match="sequence 0: expert id out of range"):
        from_external([np.array([[[0, 8]], [[1, 2]]])], num_experts=8)


def test_loads_count_only_routed_positions():
    log = _log(lengths=(4, 3))
    loads_LE = sequence_loads(log)
    assert loads_LE.shape == (2, 8)
    assert loads_LE.sum().item() == (3 + 2) * 2 * 2  # routed positions x layers x top-k
    # layer 0: seq 0 t=0,1,2 -> {0,1},{1,2},{2,3}; seq 1 t=0,1 -> {0,1},{1,2}
    assert loads_LE[0].tolist() == [2, 4, 3, 1, 0, 0, 0, 0]
    loads_MLE = micro_step_loads(log, [[0], [1]])
    assert torch.equal(loads_MLE.sum(0), loads_LE)
    assert loads_MLE[1, 0].tolist() == [1, 2, 1, 0, 0, 0, 0, 0]
    # counted once per row (the trainer's path): every micro-step, empty ones too, is the same sum
    loads_BLE = row_loads(log)
    assert torch.equal(loads_BLE.sum(0).long(), loads_LE)
    schedule = [[0], [1], [], [0, 1]]
    assert torch.equal(micro_step_loads(log, schedule, loads_BLE), micro_step_loads(log, schedule))


def test_uint16_routes_beyond_256_experts_import_exactly():
    """vLLM sends uint16 expert ids for more than 256 experts: read exactly (stored int16)."""
    a = np.array([[[300, 5]], [[1, 511]], [[65, 256]]], dtype=np.uint16)
    log = from_external([a], 512)
    assert log.experts_BTXK.dtype == torch.int16
    assert log.experts_BTXK[0, :3].flatten().tolist() == [300, 5, 1, 511, 65, 256]
