"""DTensor random init on a CPU mesh gives every shard the same values.

torchtitan initializes sharded parameters in place (``init_weights`` ->
``nn.init.normal_`` on DTensors). On CUDA, DTensor's offset-based RNG gives
each shard its own slice of one global random stream; on a CPU mesh that
tracker is unavailable ("DTensor random operators may not have complete
support on cpu device mesh"), so every rank draws the same local values: the
experts of rank 1 are copies of rank 0's, FSDP shards of a dense weight repeat.
With identical experts a route-normalized router gets no gradient at all.

Fix: initialize a full-size, unsharded twin of the model (built from the same
config, on the same seed) and copy each rank's shard of every DTensor
parameter out of it. The result equals single-process initialization. The
twin is transient; on CPU the models this is used for are small.
"""

from __future__ import annotations

import torch

_MARK = "_titan_foremoe_full_init"
unpatched_init_weights = None  # torchtitan's own, kept for the test that shows the breakage


def needed() -> bool:
    return not torch.cuda.is_available()


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(param, DTensor):
        mesh = param.device_mesh
        replicated = DTensor.from_local(full.to(param.dtype), mesh, [Replicate()] * mesh.ndim, run_check=False)
        param.to_local().copy_(replicated.redistribute(mesh, param.placements).to_local())
    else:
        param.copy_(full)


def apply() -> bool:
    if not needed():
        return False
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
    from torch.distributed.tensor import DTensor
    from torchtitan.protocols.model import BaseModel

    global unpatched_init_weights
    original = BaseModel.init_weights
    if getattr(original, _MARK, False):
        return False
    unpatched_init_weights = original

    def init_weights(self, **kwargs) -> None:
        params = dict(self.named_parameters())
        if not any(isinstance(p, DTensor) for p in params.values()):
            return original(self, **kwargs)
        rng = torch.get_rng_state()  # the twin draws what a single process would draw
        original(self, **kwargs)  # buffers, and parameters that are not sharded
        with torch.device("meta"):
            twin = self.config.build()
        twin.to_empty(device="cpu")
        torch.set_rng_state(rng)
        with torch.no_grad():
            original(twin, **kwargs)
            full = dict(twin.named_parameters())
            for name, p in params.items():  # activation checkpointing's wrappers are not in the twin's names
                _copy_full_into(p, full[name.replace(_CHECKPOINT_PREFIX, "")])

    setattr(init_weights, _MARK, True)
    BaseModel.init_weights = init_weights
    return True
