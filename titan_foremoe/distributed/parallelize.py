"""Build the model on torchtitan's meshes: FSDP2 everywhere, experts on the EP mesh.

gloo on CPU and NCCL (+ gloo for host tensors) on CUDA are picked from the device type;
``spmd_backend = partial_dtensor`` keeps DTensor for the model-parallel axes
(the experts' EP shards) and plain tensors elsewhere.
"""

from __future__ import annotations


from contextlib import contextmanager, nullcontext
from datetime import timedelta
from types import SimpleNamespace

import torch
from torchtitan.config import CompileConfig, CommConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.tools import utils as tt_utils

from ..config.job_config import JobConfig
from . import group_order, groups
from .activation_checkpoint import ac_config, inner_block
from .start_wait import announce_wait
from ..config.loader import ConfigError
from ..models.attention_kernels import activate_varlen_impl, job_attention_problem
from ..models.build import build_model_config
from ..models.flavors import MoEModelArgs

SPMD_BACKEND = "partial_dtensor"


def init_distributed(cfg: JobConfig) -> int:
    """Start the default process group (torchrun env); return the world size.

    On an accelerator the group is ``cuda:nccl,cpu:gloo`` (torchtitan's ``enable_cpu_backend``):
    device tensors take NCCL, host metadata the gloo half (``collectives``). Every mesh group
    inherits both. ``[comm] mode = "fake_backend"`` is torchtitan's dry run (no real collectives).

    On an accelerator this process's device (``LOCAL_RANK``, torchtitan's ``get_local_device``) is made current
    *before* the group exists and passed as ``init_process_group(device_id=...)``: NCCL then binds its
    communicator to that device at once (eagerly, instead of guessing it at the first collective, where a
    rank that has not called ``set_device`` yet would put its context on device 0) and later groups are split
    from it. torchtitan 0.3.0 passes ``device_id`` only in its ``torchcomms`` mode, so it is added to that one
    call (``_with_device_id``). On CPU nothing changes (no device, no ``device_id``).
    """
    groups.set_timeouts(timedelta(seconds=cfg.comm.init_timeout_seconds))  # our own groups, until the first step
    group_order.record()  # every group's creation, compared across ranks once set up (check_same_order)
    device = bind_local_device(cfg)
    fake = cfg.comm.mode == "fake_backend"  # a dry run: no peers to wait for
    wait = nullcontext() if fake else announce_wait(cfg.comm.init_timeout_seconds)
    with _with_device_id(device), wait:  # the wait for peers, named
        return dist_utils.init_distributed(
            comm_config(cfg), enable_cpu_backend=tt_utils.device_type != "cpu", base_folder=cfg.job.dump_folder,
        )


def bind_local_device(cfg: JobConfig) -> torch.device | None:
    """``set_device(local device)`` on an accelerator with a real process group; None (nothing done) on CPU and
    under torchtitan's fake backend (a dry run has no device of its own)."""
    if tt_utils.device_type == "cpu" or cfg.comm.mode != "default":
        return None
    device = tt_utils.get_local_device()
    tt_utils.device_module.set_device(device)
    return device


@contextmanager
def _with_device_id(device: torch.device | None):
    """While torchtitan starts the group: ``torch.distributed.init_process_group`` gets ``device_id=device``
    when its caller passed none (restored afterwards; nothing patched when ``device`` is None)."""
    if device is None:
        yield
        return
    init = torch.distributed.init_process_group

    def init_process_group(*args, **kwargs):
        if kwargs.get("device_id") is None:
            kwargs["device_id"] = device
        return init(*args, **kwargs)

    torch.distributed.init_process_group = init_process_group
    try:
        yield
    finally:
        torch.distributed.init_process_group = init


def comm_config(cfg: JobConfig) -> CommConfig:
    """torchtitan's ``CommConfig`` of the job. ``[comm] trace_buf_size`` > 0 keeps NCCL's flight recorder on
    (torchtitan's default, 20000 entries; a timeout dumps every rank's last collectives under
    ``<dump_folder>/comm_traces/``); 0 switches it off."""
    c = cfg.comm
    return CommConfig(init_timeout_seconds=c.init_timeout_seconds, train_timeout_seconds=c.train_timeout_seconds,
                      trace_buf_size=c.trace_buf_size, mode=c.mode)


def parallelism_config(cfg: JobConfig) -> ParallelismConfig:
    p = cfg.parallelism
    return ParallelismConfig(
        data_parallel_shard_degree=p.data_parallel_shard_degree,
        data_parallel_replicate_degree=p.data_parallel_replicate_degree,
        expert_parallel_degree=p.expert_parallel_degree,
        fsdp_reshard_after_forward=p.fsdp_reshard_after_forward,
        spmd_backend=SPMD_BACKEND,
    )


def build_parallel_dims(cfg: JobConfig, world_size: int) -> ParallelDims:
    dist_utils.set_spmd_backend(SPMD_BACKEND)
    return ParallelDims.from_config(parallelism_config(cfg), world_size)


def local_device() -> torch.device:
    if tt_utils.device_type == "cpu":
        return torch.device("cpu")
    device = tt_utils.get_local_device()
    tt_utils.device_module.set_device(device)  # already current since init_distributed; idempotent
    return device


def build_model(
    cfg: JobConfig, args: MoEModelArgs, parallel_dims: ParallelDims | None, device: torch.device
) -> torch.nn.Module:
    """Meta-init, parallelize (EP shards + activation checkpointing + FSDP2 + optional compile), materialize, init.

    ``[activation_checkpoint]`` wraps the blocks after EP and before compile and FSDP (torchtitan's order);
    without a parallel mesh (one process, no FSDP) it is applied here the same way."""
    if why := job_attention_problem(cfg, args.head_dim, device):  # before any weight is made
        raise ConfigError(why)
    if device.type == "cuda":
        activate_varlen_impl(device)  # FA3 only where installed (not in forward: compiled blocks run it)
    model_config = build_model_config(
        args, expert_dtype=cfg.model.expert_dtype, load_balance_coeff=cfg.model.load_balance_coeff
    )
    par = parallelism_config(cfg)
    model_config.update_from_config(config=SimpleNamespace(parallelism=par))
    with torch.device("meta"):
        model = model_config.build()
    if parallel_dims is not None:
        # RL compiles its blocks itself (below): torchtitan's per-block compile is fullgraph. So does SFT under
        # activation checkpointing: torchtitan compiles the checkpoint wrapper, whose context_fn must then be
        # dispatch modes (our seam contexts are not), and on this stack (torch 2.13) even its own FullAC fails
        # there (an in-place load counter saved by the checkpoint op); the block inside the wrapper compiles.
        compile_cfg = CompileConfig(enable=cfg.compile.enable and not cfg.rl.enable and not _ac_on(cfg),
                                    components=["model"], backend=cfg.compile.backend)
        model = parallelize_qwen3(
            model,
            parallel_dims=parallel_dims,
            training=TrainingConfig(mixed_precision_param=cfg.training.mixed_precision_param),
            parallelism=par,
            compile_config=compile_cfg,
            ac_config=ac_config(cfg.activation_checkpoint),  # before compile and FSDP, as torchtitan orders them
            dump_folder=cfg.job.dump_folder,
        )
    elif (ac := ac_config(cfg.activation_checkpoint)) is not None:
        ac.build().apply(model)
    if cfg.compile.enable and cfg.rl.enable:
        apply_rl_compile(model, cfg.compile.backend)
    elif cfg.compile.enable and _ac_on(cfg):
        apply_compile_inside_ac(model, cfg.compile.backend)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def apply_rl_compile(model: torch.nn.Module, backend: str) -> None:
    """torchtitan's per-block compile for RL, with the placement seams as graph breaks.

    Differs from ``torchtitan.distributed.compile.apply_compile`` in two flags only. ``fullgraph=False``: the
    calls into run-time placement (the planned dispatch and combine with their all-to-alls, slot weights
    with their transfer waits, the expert timer) run eagerly between graphs (``torch.compiler.disable`` in
    ``models/moe.py`` and ``models/dispatch.py``), so a new plan is data, never a new graph.
    ``dynamic=True``: rollout prefill, every decoded token, recompute and update share one graph per
    region (token counts and lengths are symbolic), instead of one recompile per shape.
    """
    torch._dynamo.config.capture_scalar_outputs = True  # torchtitan's dispatcher reads its splits in-graph
    torch._dynamo.config.capture_dynamic_output_shape_ops = True  # the token mask's boolean indexing
    # A block's frames hold one entry per kind of forward (prefill/decode x grad on/off x replay), not per layer,
    # plan or step: up to 7 measured (benchmarks/count_recompiles.py), against dynamo's default limit of 8, past
    # which a frame silently runs eagerly. Margin for kinds not measured here (HSDP, activation checkpointing).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    for block in model.layers.values():
        # under activation checkpointing the block inside the wrapper: the checkpoint (and its seam contexts)
        # stays eager, and the forward and its recompute run the same compiled graphs between the seams
        inner_block(block).compile(backend=backend, fullgraph=False, dynamic=True)


def _ac_on(cfg: JobConfig) -> bool:
    return cfg.activation_checkpoint.mode != "none"


def apply_compile_inside_ac(model: torch.nn.Module, backend: str) -> None:
    """torchtitan's per-block compile (``fullgraph=True``) for SFT, of the block inside each activation
    checkpoint wrapper: the checkpoint stays eager; forward and recompute run the same compiled graph."""
    torch._dynamo.config.capture_scalar_outputs = True  # torchtitan's dispatcher reads its splits in-graph
    for block in model.layers.values():
        inner_block(block).compile(backend=backend, fullgraph=True)


def set_train_timeouts(cfg: JobConfig, parallel_dims: ParallelDims) -> None:
    """After the first step, tighten collective timeouts as torchtitan does (mesh groups and the default group),
    and on every group the project made itself (``groups``)."""
    timeout = timedelta(seconds=cfg.comm.train_timeout_seconds)
    dist_utils.set_pg_timeouts(timeout, parallel_dims)
    groups.set_timeouts(timeout)
