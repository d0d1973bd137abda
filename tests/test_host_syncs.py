"""The host-sync census (``benchmarks/count_host_syncs.py``) on 2 gloo ranks, EP 2, one RL step per run.

``static``, ``exact`` (planned on the device in every layer) and ``foremoe`` run their recompute and update MoE layers with no op that would make the host
wait for the device on CUDA and no upload (0 per MoE layer per micro-step: the stage's tables, the batch's
token indices and routes are on the device before the layers run; route checks are device flags). The
census can see a sync: one ``.item()`` put into every MoE layer's forward shows up as one more per MoE
layer per micro-step, attributed to the layer's forward.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import count_host_syncs  # noqa: E402


def _inject(trainer) -> None:
    """A host sync in every MoE layer's forward (as a stray ``int(t)`` or ``.item()`` in the layer would be)."""
    from titan_foremoe.models.seams import moe_layers

    def stray_sync(module, args):
        args[0].detach().abs().sum().item()

    for moe in moe_layers(trainer.model):
        moe.register_forward_pre_hook(stray_sync)


def test_census_zero_syncs_per_moe_layer_and_sees_an_injected_one(tmp_path):
    res = count_host_syncs.census(["static", "exact", "foremoe"], tmp_path / "census.json", inject=_inject)
    for b in ("static", "exact", "foremoe"):
        for stage in ("recompute", "update"):
            s = res[b]["stages"][stage]
            assert s["forwards"] == {"1": 2, "2": 2}, (b, stage, s["forwards"])  # 2 micro-steps per stage
            assert s["per_moe_layer_per_unit"] == 0, (b, stage, s["per_moe_layer_by_site"])
        assert res[b]["stages"]["recompute"]["total"]["1"] > 0  # the stage's own reads are counted
        # the rollout's decode loop: one sync per decoded token for the whole model (the lockstep "any active")
        assert res[b]["stages"]["rollout"]["decode_per_token_at_2_layers"] == 1, res[b]["stages"]["rollout"]
    # a sync in every MoE layer shows in the decode loop too (2 layers: 2 more per decoded token)
    assert res["foremoe+injected"]["stages"]["rollout"]["decode_per_token_at_2_layers"] == 3
    for stage in ("recompute", "update"):
        s = res["foremoe+injected"]["stages"][stage]
        assert s["per_moe_layer_per_unit"] == 1, (stage, s["per_moe_layer_by_site"])
        assert s["per_moe_layer_by_kind"] == {"item": 1}


def test_upload_packs_arrays_of_any_dtype_in_one_copy():
    import numpy as np
    import torch

    from titan_foremoe.distributed import uploads

    arrays = {"a": np.arange(5, dtype=np.int64), "b": np.array([[1, 2, 3]], dtype=np.int32),
              "m": torch.tensor([True, False, True]), "e": np.zeros(0, dtype=np.int64), "f": torch.randn(2, 3)}
    seen = []
    stop = uploads.observe(seen.append)
    calls = uploads.STATS.calls
    try:
        out = uploads.upload(arrays, "cpu")
    finally:
        stop()
    assert uploads.STATS.calls == calls + 1 and len(seen) == 1
    for k, a in arrays.items():
        t = torch.as_tensor(a)
        assert out[k].dtype == t.dtype and out[k].shape == t.shape and torch.equal(out[k], t), k


def test_route_check_is_a_device_flag_raised_once_per_stage_naming_layer_and_micro_step():
    from types import SimpleNamespace

    import numpy as np
    import pytest
    import torch

    from titan_foremoe.placement.active import ActivePlacement
    from titan_foremoe.placement.runtime import PlacementRuntime
    from titan_foremoe.transfer.engine import TransferEngine

    engine = TransferEngine(None, 0, 1, np.zeros(1, dtype=np.int64))
    tables = SimpleNamespace(dispatch=SimpleNamespace(tokens_E=np.array([2, 0, 1])))
    runtime = SimpleNamespace(route_bad_ML=torch.zeros(2, 4, dtype=torch.bool))
    good = ActivePlacement(engine, 3, tables, 0, route_bad=runtime.route_bad_ML[0, 3])
    bad = ActivePlacement(engine, 3, tables, 0, route_bad=runtime.route_bad_ML[1, 3])
    good.check_loads(torch.tensor([2, 0, 1]))
    bad.check_loads(torch.tensor([1, 1, 1]))  # no raise here: no sync in the layer
    with pytest.raises(RuntimeError, match=r"layer 3, micro-step 1: the routes differ"):
        PlacementRuntime._check_route_flags(runtime)
    assert runtime.route_bad_ML is None  # read once
    unflagged = ActivePlacement(engine, 2, tables, 0)  # installed by hand: checked at once
    with pytest.raises(RuntimeError, match="layer 2: this micro-step's routes"):
        unflagged.check_loads(torch.tensor([0, 0, 3]))
