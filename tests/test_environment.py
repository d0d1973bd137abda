"""The start-up check of versions and torch features (``distributed/environment.py``) and the collective
timeouts sized from the job (``config/timeouts.py``): each mismatch is one line naming what is needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from titan_foremoe.config import ConfigError, load_config
from titan_foremoe.config.timeouts import model_params, wait_budget
from titan_foremoe.config.validate import model_args, validate
from titan_foremoe.distributed import environment

ROOT = Path(__file__).resolve().parents[1]
QWEN = str(ROOT / "train_configs" / "qwen3_30b_a3b_grpo.toml")


def test_this_environment_passes():
    assert environment.problem() is None
    assert all(environment.features().values())


def test_wrong_torch_is_one_line(monkeypatch):
    monkeypatch.setattr(environment, "version", lambda p: {"torch": "2.10.0+cu128"}.get(p, environment.NEEDS[p][0]))
    line = environment.problem(import_torchtitan=False)
    assert line == ("environment: torch 2.10.0+cu128 installed; this trainer needs torch 2.11-2.14, torchtitan "
                    "0.3.0, spmd_types 0.2.3 (pyproject.toml)")


@pytest.mark.parametrize("have, ok", [("2.11.0+cu130", True), ("2.14.1", True), ("2.13.0+cpu", True),
                                      ("2.1.0", False), ("2.110.0", False), ("2.15.0", False)])
def test_supported_torch_range(have, ok):
    assert environment.supported(have, environment.NEEDS["torch"]) is ok


def test_compat_names_exist_here():
    """The names our code takes from the compatibility module resolve on this torch, and 2.13+ patches nothing."""
    from torchtitan_patches import torch_compat

    import torch

    assert callable(torch_compat.all_gather_single) and callable(torch_compat.reduce_scatter_single_autograd)
    if torch.__version__ >= "2.13":
        assert torch_compat.PATCHED == [] and environment.compat_line() is None

    class State211:
        _fsdp_param_group = "g"

    class State213:
        _fsdp_param_groups = ["g", "h"]

    assert torch_compat.fsdp_param_groups(State211()) == ["g"]
    assert torch_compat.fsdp_param_groups(State213()) == ["g", "h"]


def test_missing_package_and_feature(monkeypatch):
    real = environment.version
    monkeypatch.setattr(environment, "version", lambda p: None if p == "spmd_types" else real(p))
    assert environment.problem().startswith("environment: spmd_types not installed; this trainer needs")
    monkeypatch.setattr(environment, "version", real)
    monkeypatch.setitem(environment.FEATURES, "torch.no_such_feature", "a test")
    assert "lacks torch.no_such_feature (a test)" in environment.problem()


def test_check_names_torchtitan_that_does_not_import(tmp_path):
    """torchtitan blocked from importing (as on an image with another torch): the config check ends in one
    line that names the versions, before anything else imports torchtitan."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torchtitan' or name.startswith('torchtitan.'):\n"
            "            raise ImportError('libtorch_cuda.so: undefined symbol')\n"
            "sys.meta_path.insert(0, Block())\n"
            "from titan_foremoe.config.check import main\n"
            f"sys.exit(main([{str(ROOT / 'train_configs' / 'debug_tiny_rl.toml')!r}]))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("environment: torchtitan 0.3.0 does not import on torch 2.13")
    assert "ImportError: libtorch_cuda.so: undefined symbol" in lines[0] and lines[0].endswith("spmd_types 0.2.3")


def test_model_params_match_the_published_size():
    """Qwen3-30B-A3B: 30.5 B parameters (its model card), from our shape arithmetic."""
    args = model_args(load_config(QWEN, []))
    assert abs(model_params(args) / 30.5e9 - 1) < 0.01


def test_timeouts_sized_from_the_job():
    cfg = load_config(QWEN, [])
    b = wait_budget(cfg, model_args(cfg), 64)
    # the save: 30.5 B params x 14 B / 64 ranks at 200 MB/s per rank; the decode waits one token of 48 layers
    assert 30 < b.save_s < 37 and b.decode_token_s == pytest.approx(48 * 2e-3) and b.engine_s == 0
    validate(cfg, 64)  # the shipped config passes
    with pytest.raises(ConfigError, match=r"^\[comm\] train_timeout_seconds: 30 s is below the 67 s this job "
                                          r"needs from step 2 on \(2 x the longest wait in one collective: save 33 s"):
        validate(load_config(QWEN, ["--comm.train_timeout_seconds=30"]), 64)
    # a live engine: the trainer ranks wait through the engine's generation (8000 tokens) and weight load
    vllm = load_config(QWEN, ["--rl.rollout_source=vllm", "--checkpoint.interval=1"])
    e = wait_budget(vllm, model_args(vllm), 64)
    assert e.engine_s > 8000 * 0.03 and e.first_step_saves and e.first_step_s >= e.engine_s
    with pytest.raises(ConfigError, match=r"^\[comm\] init_timeout_seconds: 600 s is below"):
        from titan_foremoe.config.timeouts import check_timeouts
        check_timeouts(vllm, model_args(vllm), 64)
