"""Stable keys for device copies of host index arrays.

The runtime uploads a stage's index arrays in one copy and looks each up again by the host array it came from.
Keying by ``id(array)`` alone is unsafe: once an array is freed CPython may give its id to a new one, and the
lookup would then return another table's indices without an error. ``HostKey`` holds the array itself, so the
array stays alive (its id cannot be reused) as long as the key is in a cache, and two keys are equal only for
the *same* array object (``is``), never for an equal-looking or id-recycled one. Cost: one reference per key.
"""

from __future__ import annotations

import numpy as np


class HostKey:
    """(host array, part) by identity: ``part`` names a derived array (``"own_pos"``, ``"flat"``; ``""``:
    the array itself)."""

    __slots__ = ("host", "part", "_hash")

    def __init__(self, host: np.ndarray, part: str = ""):
        self.host = host
        self.part = part
        self._hash = hash((id(host), part))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, HostKey) and other.host is self.host and other.part == self.part

    def __repr__(self) -> str:
        return f"HostKey({type(self.host).__name__}{getattr(self.host, 'shape', '')}, {self.part!r})"
