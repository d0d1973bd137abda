"""torch 2.11 through 2.14 under torchtitan 0.3.0 (released against 2.13).

The GPU machines lent to this project carry torch 2.11; torchtitan 0.3.0 and our trainer were written for 2.13.
Each gap below is filled only where the running torch lacks the 2.13 name (``apply()`` is a no-op on 2.13+), and
``PATCHED`` names what was filled, for the environment check's line:

- ``DataParallelMeshDims`` (``torch.distributed.fsdp``): imported at module level by torchtitan's
  ``distributed/fsdp.py``, built only under ``full_dtensor`` (which 2.11's ``fully_shard`` cannot take and this
  trainer never sets): a plain dataclass stand-in lets the module import.
- ``torch.compiler._is_non_strict_tracing``: read by torchtitan's token dispatcher beside ``is_compiling()``; it is
  true only inside non-strict export, which this trainer never runs: ``False``.
- ``datasets``: torchtitan's ``components/validate.py`` imports ``torchtitan.hf_datasets.text_datasets`` (and so
  the ``datasets`` package) for its text validator, which this trainer never builds; where ``datasets`` is not
  installed, that one torchtitan module is replaced by a stub whose names raise on use.
- 2.13's per-parameter FSDP mesh (``ShardPlacementResult``, ``_get_mesh_info(mesh, dims)``), used by
  ``apply_fsdp_to_decoder`` for EP > 1: 2.11 has one mesh per FSDP unit, so the routed experts become their own
  unit on the expert mesh (``edp``), the rest of the block one unit on ``dp``. The experts' post-backward (the
  reduce-scatter and reshard of their gradients) is run from the block's rather than at the gradient of the experts'
  input: replica gradient returns and the slot paths add into the owned experts' gradients after that point, so
  they would arrive after the reshard. Two FSDP units per MoE block instead of one: one more all-gather and
  reduce-scatter launch per block per micro-step (the bytes are the same).

The functional collectives renamed in 2.13 (``all_gather_single*``, ``reduce_scatter_single_autograd``; 2.11 has
the same signatures as ``*_tensor*``, which 2.13 deprecates) and FSDP2's per-state param groups
(``_fsdp_param_groups`` in 2.13, one ``_fsdp_param_group`` in 2.11) are resolved here by name for our own code.

Cost: attribute look-ups once per process; nothing per step.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import torch
import torch.distributed._functional_collectives as _funcol

SUPPORTED = ("2.11", "2.12", "2.13", "2.14")  # torch minor versions the trainer runs on (CI: 2.13 and 2.11)

PATCHED: list[str] = []  # what apply() filled in this process

all_gather_single = getattr(_funcol, "all_gather_single", None) or _funcol.all_gather_tensor
all_gather_single_autograd = (getattr(_funcol, "all_gather_single_autograd", None)
                              or _funcol.all_gather_tensor_autograd)
reduce_scatter_single_autograd = (getattr(_funcol, "reduce_scatter_single_autograd", None)
                                  or _funcol.reduce_scatter_tensor_autograd)


def fsdp_param_groups(state) -> list:
    """An FSDP2 state's parameter groups: 2.13's list, or 2.11's single group (or none) as a list."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def needed() -> bool:
    import torch.distributed.fsdp as fsdp

    return not hasattr(fsdp, "DataParallelMeshDims")


def apply() -> bool:
    """Fill each missing 2.13 name; must run before ``torchtitan.distributed`` is imported."""
    if PATCHED:
        return True
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = DataParallelMeshDims
        PATCHED.append("DataParallelMeshDims")
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = lambda: False
        PATCHED.append("torch.compiler._is_non_strict_tracing")
    if _stub_text_datasets():
        PATCHED.append("torchtitan.hf_datasets.text_datasets (no datasets package)")
    if _per_param_mesh_missing():
        _patch_apply_fsdp_to_decoder()
        PATCHED.append("apply_fsdp_to_decoder (EP > 1: experts as their own FSDP unit)")
    return bool(PATCHED)


@dataclasses.dataclass(frozen=True)
class DataParallelMeshDims:
    """Stand-in for 2.13's class of the same name: torchtitan builds one only under ``full_dtensor``."""

    shard: object = None
    replicate: object = None


def _stub_text_datasets() -> bool:
    import importlib.util

    if importlib.util.find_spec("datasets") is not None or "torchtitan.hf_datasets.text_datasets" in sys.modules:
        return False
    stub = types.ModuleType("torchtitan.hf_datasets.text_datasets")

    def _absent(*args, **kwargs):
        raise ImportError("torchtitan's text datasets need the 'datasets' package, which is not installed")

    stub.__getattr__ = lambda name: _absent if not name.startswith("__") else None
    sys.modules[stub.__name__] = stub
    return True


def _per_param_mesh_missing() -> bool:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult  # noqa: F401
    except ImportError:
        return True
    return False


def _patch_apply_fsdp_to_decoder() -> None:
    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.models.qwen3.parallelize as qwen3_parallelize

    original = tt_fsdp.apply_fsdp_to_decoder

    def apply_fsdp_to_decoder(model, dp_mesh, param_dtype, reduce_dtype, pp_enabled, cpu_offload=False,
                              reshard_after_forward_policy="default", ep_degree=1, edp_mesh=None,
                              dp_mesh_dims=None, edp_mesh_dims=None, enable_symm_mem=False):
        if ep_degree > 1:
            _shard_experts_on_edp(model, edp_mesh, ep_degree, param_dtype, reduce_dtype, cpu_offload,
                                  tt_fsdp.get_fsdp_reshard_after_forward_policy(reshard_after_forward_policy,
                                                                                pp_enabled))
        # the blocks' remaining parameters: one mesh per unit, as torchtitan does at EP 1
        original(model, dp_mesh, param_dtype, reduce_dtype, pp_enabled, cpu_offload, reshard_after_forward_policy,
                 1, None, dp_mesh_dims, None, enable_symm_mem)
        if ep_degree > 1:
            _chain_post_backward(model)
            _explicit_prefetch(model)

    tt_fsdp.apply_fsdp_to_decoder = apply_fsdp_to_decoder
    if getattr(qwen3_parallelize, "apply_fsdp_to_decoder", None) is original:
        qwen3_parallelize.apply_fsdp_to_decoder = apply_fsdp_to_decoder


def _moe_blocks(model):
    return [(b, b.moe.routed_experts.inner_experts) for b in model.layers.values() if getattr(b, "moe_enabled", False)]


def _shard_experts_on_edp(model, edp_mesh, ep_degree, param_dtype, reduce_dtype, cpu_offload,
                          reshard_after_forward) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    extra = {"offload_policy": CPUOffloadPolicy()} if cpu_offload else {}
    for _, experts in _moe_blocks(model):
        # torchtitan's rule: Shard(1) when the experts would not fill efsdp x ep shards along dim 0
        placement = Shard(1) if edp_mesh["efsdp"].size() * ep_degree > experts.num_experts else Shard(0)
        fully_shard(experts, mesh=edp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=lambda _p, pl=placement: pl, **extra)


def _chain_post_backward(model) -> None:
    """Run each experts unit's post-backward from its block's (see the module docstring)."""
    for block, experts in _moe_blocks(model):
        (eg,) = fsdp_param_groups(experts._get_fsdp_state())
        block_groups = fsdp_param_groups(block._get_fsdp_state())
        eg._register_post_backward_hook = lambda args, kwargs: (args, kwargs)
        if not block_groups:  # every parameter of the block is an expert's: the root's final callback runs it
            continue
        (bg,) = block_groups
        block_post_backward = bg.post_backward

        def post_backward(*unused, _eg=eg, _orig=block_post_backward):
            _eg.post_backward()
            return _orig(*unused)

        bg.post_backward = post_backward


def _explicit_prefetch(model) -> None:
    """torchtitan's EP > 1 prefetch order (each block prefetches the next), with each block's experts unit."""
    blocks = list(model.layers.values())
    units = [[b] + ([b.moe.routed_experts.inner_experts] if getattr(b, "moe_enabled", False) else [])
             for b in blocks]
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch(units[i + 1])
        if i > 0:
            block.set_modules_to_backward_prefetch(units[i - 1])
    if blocks and model.tok_embeddings is not None:
        model.tok_embeddings.set_modules_to_forward_prefetch(units[0])
