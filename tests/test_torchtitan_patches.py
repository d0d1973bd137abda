"""Each torchtitan patch: what breaks on CPU without it, and that it works with it.

Every check runs in a fresh interpreter, since the patches change process-wide
module state that this test process already has patched.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import torchtitan_patches
from distributed_helpers import run_ranks
from torchtitan_patches import cpu_device, dtensor_cpu_init, gloo_sum_reduction, pg_set_timeout, triton_stub

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the patches are CPU-only no-ops on CUDA")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_patches_are_noops_where_cuda_is_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not cpu_device.needed()
    assert not triton_stub.needed()
    assert not gloo_sum_reduction.needed()
    assert not dtensor_cpu_init.needed()
    assert cpu_device.apply() is False and gloo_sum_reduction.apply() is False


def test_triton_stub():
    broken = _python("import torchtitan.models.common.moe")
    assert broken.returncode != 0 and "No module named 'triton'" in broken.stderr
    fixed = _python(
        """
        import torchtitan_patches
        torchtitan_patches.triton_stub.apply()
        import torchtitan.models.common.moe
        from torchtitan.distributed.minimal_async_ep import kernels
        try:
            kernels.fill_dispatch_metadata_kernel()
        except RuntimeError as e:
            print("raised:", e)
        """
    )
    assert fixed.returncode == 0, fixed.stderr
    assert "raised: fill_dispatch_metadata_kernel is a triton kernel" in fixed.stdout


def test_cpu_device():
    broken = _python(
        """
        import os, torch
        os.environ["LOCAL_RANK"] = "0"
        import torchtitan.tools.utils as u
        print(u.device_type)
        torch.empty(1, device=u.get_local_device())
        """
    )
    assert broken.returncode != 0 and broken.stdout.strip() == "cuda"
    fixed = _python(
        """
        import torch, torchtitan_patches
        assert torchtitan_patches.cpu_device.apply()
        import torchtitan.tools.utils as u
        from torchtitan.components.metrics import device_type
        print(u.device_type, device_type, u.device_module.current_device(), torch.empty(1, device=u.device_type).device)
        """
    )
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.split() == ["cpu", "cpu", "0", "cpu"]
    late = _python(
        """
        import torchtitan.distributed.utils, torchtitan_patches
        torchtitan_patches.cpu_device.apply()
        """
    )
    assert late.returncode != 0 and "must run before importing" in late.stderr


def test_pg_set_timeout():
    code = """
        import torch.distributed as dist, torchtitan_patches
        torchtitan_patches.cpu_device.apply(); torchtitan_patches.triton_stub.apply()
        {extra}
        from datetime import timedelta
        from types import SimpleNamespace
        from torchtitan.distributed import utils
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
        no_meshes = SimpleNamespace(get_all_one_dimensional_meshes=lambda: {{}})  # just the default group
        utils.set_pg_timeouts(timedelta(seconds=7), no_meshes)
        print("timeouts set")
    """
    from distributed_helpers import free_port

    broken = _python(code.format(extra="", port=free_port()))
    assert broken.returncode != 0 and "has no attribute 'set_timeout'" in broken.stderr
    fixed = _python(code.format(extra="torchtitan_patches.pg_set_timeout.apply()", port=free_port()))
    assert fixed.returncode == 0, fixed.stderr
    assert "timeouts set" in fixed.stdout


def _fsdp_backward(rank, world_size, patched, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if patched:
        torchtitan_patches.apply_all()
    else:
        torchtitan_patches.cpu_device.apply()
        torchtitan_patches.triton_stub.apply()
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    disable_fsdp_gradient_division(model)
    try:
        model(torch.randn(3, 4) + rank).sum().backward()
        result = "ok"
    except Exception as e:  # noqa: BLE001 - the failure is the point of the test
        result = f"{type(e).__name__}: {e}"
    with open(f"{out_dir}/rank{rank}", "w") as f:
        f.write(result)
    dist.destroy_process_group()


@pytest.mark.parametrize("patched", [False, True])
def test_gloo_sum_reduction(tmp_path, patched):
    run_ranks(_fsdp_backward, 2, patched, str(tmp_path), apply_patches=False)
    results = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    if patched:
        assert results == ["ok", "ok"]
    else:
        assert all("PREMUL_SUM" in r or "premul" in r.lower() for r in results), results



def _init_on_two_ranks(rank, world_size, out_path):
    import torch.distributed as dist

    from titan_foremoe.config import load_config
    from titan_foremoe.train.trainer import Trainer

    trainer = Trainer(load_config(None, [f"--job.dump_folder={out_path}.d", "--metrics.enable_tensorboard=false",
                                         "--parallelism.expert_parallel_degree=2", "--job.seed=3"]))
    out = {}
    for name, init in [("unpatched", dtensor_cpu_init.unpatched_init_weights), ("patched", type(trainer.model).init_weights)]:
        torch.manual_seed(3)
        with torch.no_grad():
            init(trainer.model)
        out[name] = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                     for n, p in trainer.model.named_parameters()}
    if rank == 0:
        torch.save(out, out_path)
    dist.destroy_process_group()


def test_dtensor_cpu_init(tmp_path):
    out = tmp_path / "params.pt"
    run_ranks(_init_on_two_ranks, 2, str(out))
    params = torch.load(out)
    key = "layers.0.moe.routed_experts.inner_experts.w1_EFD"  # 8 experts, 4 per rank
    assert torch.equal(params["unpatched"][key][0], params["unpatched"][key][4])  # rank 1 repeats rank 0
    w1 = params["patched"][key]
    assert not torch.equal(w1[0], w1[4])
    from titan_foremoe.config import load_config
    from titan_foremoe.config.validate import model_args
    from titan_foremoe.distributed.parallelize import build_model

    cfg = load_config(None, ["--job.seed=3"])
    torch.manual_seed(3)
    single = build_model(cfg, model_args(cfg, vocab_size=64), None, torch.device("cpu"))
    for name, p in single.named_parameters():  # sharded init == single-process init
        torch.testing.assert_close(params["patched"][name], p.detach(), rtol=0, atol=0, msg=name)
