"""What moved in one micro-step and what it cost (this rank's view)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TransferStats:
    transfers: int = 0
    bytes_by_path: dict = field(default_factory=lambda: {"intra_node": 0, "inter_node": 0, "host": 0})
    # direct: from issuing the all-to-all to its arrival at first use (an upper bound on the wire time; compute-
    # stream CUDA events on GPU, ``timing.ExposedTimer``); host: staging the owner's experts plus the host-lane
    # exchange and copies into the banks (host time)
    seconds_by_path: dict = field(default_factory=lambda: {"direct": 0.0, "host": 0.0})
    issue_s: float = 0.0
    exposed_s: float = 0.0  # compute-stream time waiting for transfers at first use and for gradient returns
    local_copies: int = 0
    grad_return_bytes: int = 0

    def add(self, other: "TransferStats") -> None:
        """Add ``other``'s counts and seconds into these."""
        self.transfers += other.transfers
        for k, v in other.bytes_by_path.items():
            self.bytes_by_path[k] = self.bytes_by_path.get(k, 0) + v
        for k, v in other.seconds_by_path.items():
            self.seconds_by_path[k] = self.seconds_by_path.get(k, 0.0) + v
        self.issue_s += other.issue_s
        self.exposed_s += other.exposed_s
        self.local_copies += other.local_copies
        self.grad_return_bytes += other.grad_return_bytes
