"""Max/mean rank load of a micro-step, on hand-computed counts."""

import pytest
import torch

from titan_foremoe.metrics.balance import max_over_mean, micro_step_balance_metrics, rank_loads


def test_rank_loads_and_ratio():
    tokens_LE = torch.tensor([[4.0, 0, 1, 1, 2, 2, 0, 2], [1.0, 1, 1, 1, 1, 1, 1, 1]])
    loads = rank_loads(tokens_LE, 4)  # rank r owns experts 2r, 2r+1
    assert loads.tolist() == [[4, 2, 4, 2], [2, 2, 2, 2]]
    assert max_over_mean(loads).tolist() == pytest.approx([4 / 3, 1.0])
    assert max_over_mean(torch.zeros(1, 4)).tolist() == [1.0]


def test_micro_step_metrics_names():
    m = micro_step_balance_metrics(torch.tensor([[3.0, 1, 0, 0]]), 2, per_expert=True)
    assert m["balance/max_over_mean"] == 2.0
    assert m["balance/layer_0/max_rank_tokens"] == 4.0
    assert m["tokens_per_expert/layer_0/expert_0"] == 3.0
    assert "tokens_per_expert/layer_0/expert_0" not in micro_step_balance_metrics(
        torch.tensor([[3.0, 1, 0, 0]]), 2, per_expert=False
    )
