"""A reactive layer plans once per micro-step: a second dispatch of the layer (activation checkpointing's
recompute in backward) reuses the forward's tables and replicas; different routes in the same micro-step are
refused rather than silently planned against another layout. The distributed behaviour (same losses and
parameters as ``static``, replicas moved, lower measured imbalance) is in ``test_placement_runtime.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titan_foremoe.placement.reactive import ReactivePlacement


class _Runtime:
    def __init__(self):
        self.planned, self.moved = [], []

    def plan_layer(self, layer, mine_E):
        self.planned.append((layer, mine_E.tolist()))
        return object()  # stands for the layer's tables

    def move(self, layer, owned, tables):
        self.moved.append(layer)


def test_prepare_plans_once_and_refuses_other_routes(monkeypatch):
    rt = _Runtime()
    p = ReactivePlacement(engine=None, layer=3, tables=None, bank=0, runtime=rt)
    counts = torch.tensor([2.0, 0.0, 5.0, 1.0])  # torchtitan's histc counts are float
    p.prepare(counts)
    tables = p.tables
    p.prepare(counts.clone())
    assert rt.planned == [(3, [2, 0, 5, 1])] and p.tables is tables
    monkeypatch.setattr("titan_foremoe.placement.active.ActivePlacement.slot_weights", lambda self, o, d: o)
    owned = (torch.zeros(4, 2, 2),) * 3
    p.slot_weights(owned, torch.float32)
    p.slot_weights(owned, torch.float32)
    assert rt.moved == [3]  # moved once, at the first expert compute
    with pytest.raises(RuntimeError, match="layer 3: dispatched twice in a micro-step with different routes"):
        p.prepare(torch.tensor([1, 1, 5, 1]))
    fresh = ReactivePlacement(engine=None, layer=0, tables=None, bank=0, runtime=rt)
    with pytest.raises(RuntimeError, match="experts ran before the reactive plan"):
        fresh.slot_weights(owned, torch.float32)
    assert np.array_equal(p.tokens_E, [2, 0, 5, 1])
