"""Issue 23: bad input fails early with one line naming what is wrong (pre-flight level, no workers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_foremoe.config import ConfigError, load_config
from titan_foremoe.config.validate import validate

ROOT = Path(__file__).resolve().parents[1]
RL = ROOT / "train_configs" / "debug_tiny_rl.toml"


def _error(overrides, world_size: int = 4, path=RL) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(path, list(overrides)), world_size)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_placement_needs_router_replay_and_bounded_spare_slots():
    for balancer in ("foremoe", "static", "reactive"):
        assert "[rl] router_replay: false needs [balance] balancer = 'off'" in _error(
            ["--rl.router_replay=false", f"--balance.balancer={balancer}"])
    validate(load_config(RL, ["--rl.router_replay=false", "--balance.balancer=off"]), 4)
    cfg = load_config(RL)
    r = validate(cfg, 4)
    most = r.num_experts - r.num_experts // r.ep
    validate(load_config(RL, [f"--balance.spare_slots={most}"]), 4)
    msg = _error([f"--balance.spare_slots={most + 1}"])
    assert f"[balance] spare_slots: {most + 1} exceeds what the model can use" in msg and f"at most {most}" in msg
    assert "[balance] spare_slots" in _error(["--balance.spare_slots=1000000"])
