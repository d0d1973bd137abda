"""Checkpointed job state beyond model / optimizer / LR schedule, so a resume is exact.

torchtitan's ``CheckpointManager`` saves every ``Stateful`` in its ``states``
dict with DCP. The trainer registers one ``JobState`` there (key ``job_state``);
components that carry state across steps join it with one line::

    trainer.job_state.register("prompts", dataset)  # any object with state_dict() / load_state_dict()

Keys must be the same at save and load time (DCP refuses missing keys), so a
component registers in ``__init__``, before ``checkpointer.load``, whether or
not it has state yet.

Legend: L layers, E experts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import ModelWrapper


class JobState(Stateful):
    """A registry of named ``Stateful`` parts, saved and loaded as one nested dict."""

    def __init__(self) -> None:
        self._parts: dict[str, Any] = {}

    def register(self, name: str, part: Any) -> None:
        if name in self._parts:
            raise ValueError(f"job state part {name!r} registered twice")
        self._parts[name] = part

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self._parts.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, part in self._parts.items():
            part.load_state_dict(state_dict[name])


class KLReference(Stateful):
    """The frozen KL reference policy, saved as its own weights (same sharding as the policy).

    The reference is the policy at the start of RL; after a resume it cannot be
    re-taken from the resumed policy, and the checkpoint of that step may have
    been purged, so its weights travel with every checkpoint: one more copy of
    the model (no optimizer state), i.e. about a third more checkpoint bytes with AdamW.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.requires_grad_(False)
        self.taken = False
        self._weights = ModelWrapper(model)

    @torch.no_grad()
    def take(self, policy: torch.nn.Module) -> None:
        for p_ref, p in zip(self.model.parameters(), policy.parameters(), strict=True):
            p_ref.copy_(p)
        self.taken = True

    def state_dict(self) -> dict[str, Any]:
        return {"taken": torch.tensor(int(self.taken)), "weights": self._weights.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.taken = bool(int(state_dict["taken"]))
        self._weights.load_state_dict(state_dict["weights"])


class BalancerHistory(Stateful):
    """The last step's expert loads ``history_LE`` (``eplb_history`` plans from it); none before the first RL step."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.shape = (num_layers, num_experts)
        self.loads_LE = None

    def state_dict(self) -> dict[str, Any]:
        loads = torch.zeros(self.shape, dtype=torch.int64) if self.loads_LE is None else torch.as_tensor(self.loads_LE)
        return {"present": torch.tensor(int(self.loads_LE is not None)), "loads_LE": loads.to(torch.int64)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        present = bool(int(state_dict["present"]))
        self.loads_LE = state_dict["loads_LE"].numpy().copy() if present else None
