"""The host-sync census (``scripts/count_host_syncs.py``) on 2 gloo ranks, EP 2, one RL step per run.

``static`` and ``foremoe`` run their recompute and update MoE layers with no op that would make the host
wait for the device on CUDA and no upload (0 per MoE layer per micro-step: the stage's tables, the batch's
token indices and routes are on the device before the layers run; route checks are device flags). The
census can see a sync: one ``.item()`` put into every MoE layer's forward shows up as one more per MoE
layer per micro-step, attributed to the layer's forward.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import count_host_syncs  # noqa: E402


def _inject(trainer) -> None:
    """A host sync in every MoE layer's forward (as a stray ``int(t)`` or ``.item()`` in the layer would be)."""
    from titan_foremoe.models.seams import moe_layers

    def stray_sync(module, args):
        args[0].detach().abs().sum().item()

    for moe in moe_layers(trainer.model):
        moe.register_forward_pre_hook(stray_sync)


def test_census_zero_syncs_per_moe_layer_and_sees_an_injected_one(tmp_path):
    res = count_host_syncs.census(["static", "foremoe"], tmp_path / "census.json", inject=_inject)
    for b in ("static", "foremoe"):
        for stage in ("recompute", "update"):
            s = res[b]["stages"][stage]
            assert s["forwards"] == {"1": 2, "2": 2}, (b, stage, s["forwards"])  # 2 micro-steps per stage
            assert s["per_moe_layer_per_unit"] == 0, (b, stage, s["per_moe_layer_by_site"])
        assert res[b]["stages"]["recompute"]["total"]["1"] > 0  # the stage's own reads are counted
    for stage in ("recompute", "update"):
        s = res["foremoe+injected"]["stages"][stage]
        assert s["per_moe_layer_per_unit"] == 1, (stage, s["per_moe_layer_by_site"])
        assert s["per_moe_layer_by_kind"] == {"item": 1}
