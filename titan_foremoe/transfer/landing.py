"""When the owners' landing of returned replica gradients may start: once the owner's own gradient exists.

Why: each replica gradient returned to its owner is added into the owner's expert gradient (``index_add_``: the
returned row read, the owner's row read and written, bf16; 45 us per row at gpt-oss-20b's expert, 14 us at
Qwen3-30B-A3B's). Done at the block's gradient gate (``placement/runtime._GradGate``) on the compute stream, it
sat on the critical path of exactly the ranks the replicas unload, the hot experts' owners. It may run as soon
as (1) the return's all-to-all is issued and (2) the owner's own gradient of the layer is accumulated, and must
end before FSDP's reduce-scatter of the block reads the gradients. Both (1) and (2) hold when the owned
parameters' post-accumulate-grad hooks have fired: ``ReplicaWeights`` takes the owned tensors as inputs, so
their ``AccumulateGrad`` runs after its backward, which issues the return (a graph dependency, not an order of
the autograd engine's queue). The engine then lands on its own stream (``TransferEngine.land_async``) while the
compute stream runs the layer's dispatch backward and the block's attention backward; the gate waits for the
landing's event.

Cost per MoE layer with a return, per update micro-step and rank: one hook per expert matrix (3 Python calls
in the autograd engine's thread, µs), one stream wait and one event; no host sync; memory as before (the
received rows live until the gate). At Qwen3-30B-A3B (48 MoE layers) at most 144 hook calls and 48 events per
update micro-step per rank, the same at R = 64, 256 or 1024 (a rank watches its own experts only); the bytes
moved are the return's, unchanged. Hooks go on the module's parameters (FSDP2's unsharded ones in forward and
backward, the same objects every micro-step; with EP, DTensors), registered in the layer's forward, once per
(micro-step, layer), and dropped when the micro-step ends, fired or not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class LandingWatch:
    """Post-accumulate-grad hooks per layer that call ``start(layer)`` once every watched parameter has its
    gradient of this backward."""

    def __init__(self):
        self._hooks: dict[int, list] = {}

    def watch(self, layer: int, params: Sequence[torch.Tensor], start: Callable[[int], None]) -> bool:
        """Watch ``params`` for ``layer`` (from its forward); False where they cannot be watched (not leaves
        that require grad, or no autograd now): the gate then lands as before."""
        if layer in self._hooks:
            return True  # activation checkpointing's recompute of the same layer: the forward's hooks hold
        if not torch.is_grad_enabled() or not params or \
                not all(isinstance(p, torch.Tensor) and p.is_leaf and p.requires_grad for p in params):
            return False
        left = [len(params)]

        def fired(_param: torch.Tensor) -> None:
            left[0] -= 1
            if left[0] == 0:
                for h in self._hooks.pop(layer, ()):
                    h.remove()
                start(layer)

        self._hooks[layer] = [p.register_post_accumulate_grad_hook(fired) for p in params]
        return True

    def drop(self) -> None:
        """Remove every hook not fired (a micro-step without a backward, or one that failed)."""
        for hooks in self._hooks.values():
            for h in hooks:
                h.remove()
        self._hooks.clear()

    @property
    def watched(self) -> list[int]:
        return sorted(self._hooks)
