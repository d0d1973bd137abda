"""NCCL's issue order across communicators that share ranks, checked on CPU (part of the checked backend).

Why: NCCL runs each communicator's kernels in issue order on that communicator's stream. Kernels of two
communicators over the same GPUs can deadlock when the ranks enqueue them in different orders: each GPU
spins in the kernel whose peer is still queued behind the other communicator's kernel (or behind a stream
wait on it). gloo never deadlocks that way (a thread per group), so CI could not see it. The EP group and its
prefetch and gradient-return twins (``transfer/groups.py``) are three communicators over the same ranks,
issued from the compute and the side stream.

The rule checked: for every *set of ranks*, the collectives this rank issues on all communicators over exactly
that set form one sequence of (communicator, op, issuing stream); every rank of the set must issue the same
sequence. Host collectives are in it too: which collectives NCCL runs on a GPU cannot be told apart here (an
object collective's source tensor is a host tensor on CPU, its receivers' are not), and a program whose
host and device collectives interleave alike on every rank is what the rule wants anyway. Then each communicator's n-th collective has the same place in one common order on every rank
of the set, every stream wait on another communicator's collective points backwards in that order, and no
rank's collective can wait on one its peer has not issued. A mismatch ends the job on every rank with the
first divergence (index, each rank's communicator, op, stream and call site). Not covered: a cycle through
communicators over *different* rank sets (the EP group of ranks {0, 1} and the FSDP group {0, 2}); each of
those is only checked for its own order (which c10d needs anyway).

Cost: per collective one 8-byte blake2b of ~40 bytes and a log entry (a few µs of Python; the log is
cleared at every check); per check (the end of each outermost ``strict`` region: the recompute and update
stages) one ``all_gather_object`` of {rank set: (count, digest)} (~60 B per rank set per rank) and one
one-element all-reduce, both on the host (gloo). Only on a mismatch are the logs gathered.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import collectives


class IssueOrderError(RuntimeError):
    """Two ranks issued collectives on communicators over the same ranks in different orders."""


@dataclass
class _Sequence:
    count: int = 0  # collectives issued on the rank set's communicators so far
    digest: bytes = b""  # running hash of (communicator, op, stream) in issue order
    log: list = field(default_factory=list)  # (communicator, op, stream, call site) since the last check
    first: int = 0  # index of log[0]


def _group(ref) -> dist.ProcessGroup | None:
    """The process group behind a c10d op's argument: a boxed ``ProcessGroup`` or a functional op's name."""
    try:
        if isinstance(ref, str):
            return dist.distributed_c10d._resolve_process_group(ref)
        return torch._C._distributed_c10d.ProcessGroup.unbox(ref)
    except Exception:  # not a process group
        return None


class IssueOrder:
    """Per rank set, the running sequence of device collectives this rank issued (see the module docstring)."""

    def __init__(self):
        self.sequences: dict[tuple[int, ...], _Sequence] = {}
        self._groups: dict[object, tuple[tuple[int, ...], str] | None] = {}
        self.checks = 0
        self.seconds = 0.0  # spent in ``check`` (the exchange), for the cost figure

    def record(self, ref, key, op: str, stream: str, site: str) -> None:
        """One collective ``op`` on the group ``ref`` (cache ``key``), issued from ``stream``."""
        got = self._groups.get(key, False)
        if got is False:
            pg = _group(ref)
            got = None
            if pg is not None:
                ranks = tuple(sorted(dist.get_process_group_ranks(pg)))
                desc = getattr(pg, "group_desc", "") or ""
                got = (ranks, f"{pg.group_name}" + (f" ({desc})" if desc and desc != "undefined" else ""))
            self._groups[key] = got
        if got is None or len(got[0]) < 2:  # a group of one rank waits for nobody
            return
        ranks, name = got
        s = self.sequences.setdefault(ranks, _Sequence())
        s.digest = hashlib.blake2b(s.digest + f"{name}|{op}|{stream}".encode(), digest_size=8).digest()
        s.count += 1
        s.log.append((name, op, stream, site))

    def check(self, where: str) -> None:
        """Collective over the world: every rank set's sequences agree on all its ranks, else every rank raises
        ``IssueOrderError`` naming the first divergence. A no-op without a process group of two or more ranks."""
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return
        self.checks += 1
        t0 = time.perf_counter()
        mine = {ranks: (s.count, s.digest) for ranks, s in self.sequences.items()}
        every = collectives.all_gather_objects(mine)
        bad = any(every[p].get(ranks, (0, b"")) != state for ranks, state in mine.items() for p in ranks)
        flag = torch.tensor([int(bad)])
        collectives.all_reduce(flag, collectives.ReduceOp.MAX)
        if not int(flag):
            for s in self.sequences.values():
                s.first, s.log = s.count, []
            self.seconds += time.perf_counter() - t0
            return
        logs = collectives.all_gather_objects({ranks: (s.first, s.log) for ranks, s in self.sequences.items()})
        raise IssueOrderError(first_divergence(every, logs, where))


    def describe(self) -> str:
        sets = ", ".join(f"{list(r)}: {s.count}" for r, s in sorted(self.sequences.items()))
        return (f"collective issue order agreed at {self.checks} checks ({self.seconds * 1e3:.1f} ms in all); "
                f"collectives per rank set: {sets or 'none'}")


def first_divergence(states: list[dict], logs: list[dict], where: str) -> str:
    """The first place two ranks of one rank set issued different collectives, as one line (all ranks: the same)."""
    for ranks in sorted({r for d in states for r in d}):
        base = ranks[0]
        for p in ranks[1:]:
            if states[p].get(ranks, (0, b"")) == states[base].get(ranks, (0, b"")):
                continue
            (first_a, log_a), (first_b, log_b) = logs[base].get(ranks, (0, [])), logs[p].get(ranks, (0, []))
            i = 0
            while i < min(len(log_a), len(log_b)) and log_a[i][:3] == log_b[i][:3]:
                i += 1

            def say(rank, log):
                if i >= len(log):
                    return f"rank {rank} issued nothing more"
                name, op, stream, site = log[i]
                return f"rank {rank} issued {op} on group {name} from the {stream} stream ({site})"
            return (f"collective issue order differs on the communicators over ranks {list(ranks)} (checked at the "
                    f"end of {where}): collective {first_a + i} since the start: {say(base, log_a)}, "
                    f"{say(p, log_b)}; NCCL can deadlock on this (docs/gpu.md)")
    return f"collective issue order differs (checked at the end of {where}), divergence not found in the logs"
