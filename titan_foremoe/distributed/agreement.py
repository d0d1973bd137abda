"""Check that every rank holds the same thing (config, code, stage plan) and that senders and receivers agree.

NCCL never compares what one rank sends with what its peer expects (gloo does, so CPU tests cannot see it): a
rank with another plan or config hangs an all-to-all or trains a diverged replica silently. Two checks:

* ``check_same``: every rank holds the same ``{key: value}``. One all-reduce (MAX) of ``[d, -d]`` for a 63-bit
  digest ``d`` of all items gives max and min at once: 16 bytes when all agree. Only on a mismatch are the
  per-key digests gathered (``all_gather_object``) to name the first differing key and the ranks that differ.
* ``check_splits``: what each rank will send to each peer equals what that peer expects to receive. Each rank
  hashes its send row and its receive column per peer (a linear hash over (micro-step, layer, kind) with fixed
  odd 64-bit weights, so a single differing count is always caught), and one all-to-all of one int64 per peer
  hands each peer the sender's hash: O(R) bytes per rank, never the R x R matrix. Only on a mismatch the full
  rows go peer to peer to name micro-step, layer, kind and ranks.

Both end in a ``DisagreementError`` (one line, the same on every rank of the group): never a hang, never a
size error from the backend. Host tensors through ``collectives`` (gloo half of the group on CUDA).

Legend: M micro-steps, L layers, K kinds of exchange (``SPLIT_KINDS``), R ranks of the group (peers),
X flattened (micro-step, layer, kind).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist

from . import collectives

SPLIT_KINDS = ("tokens", "direct", "host", "grad")


class DisagreementError(RuntimeError):
    """Ranks that must hold the same thing do not (raised on every rank of the group, same message)."""


def _skip(group) -> bool:
    """Nothing to compare: one rank, or torchtitan's fake backend (collectives do nothing: a dry run)."""
    return not collectives.active(group) or dist.get_backend(group) == "fake"


def digest(value) -> bytes:
    """8-byte digest of a value: arrays by dtype, shape and bytes; anything else by ``repr``."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(value, np.ndarray):
        h.update(f"{value.dtype.str}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, (bytes, bytearray)):
        h.update(value)
    else:
        h.update(repr(value).encode())
    return h.digest()


def total_digest(items: Mapping[str, object], keyed: Mapping[str, bytes] | None = None) -> int:
    """63-bit digest of all keys and values (so that ``-d`` fits in int64)."""
    keyed = keyed if keyed is not None else {k: digest(v) for k, v in items.items()}
    total = hashlib.blake2b(b"".join(k.encode() + b"\0" + d for k, d in keyed.items()), digest_size=8)
    return int.from_bytes(total.digest(), "little") >> 1


def _show(value) -> str:
    if isinstance(value, (np.ndarray, bytes, bytearray)):
        return f"digest {digest(value).hex()}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _both_extremes(values: list[int], group) -> torch.Tensor:
    """All-reduce MAX of ``[v, -v for each v]``: max and -min of every value in one collective."""
    t = torch.tensor([x for v in values for x in (v, -v)], dtype=torch.int64)
    return collectives.all_reduce(t, collectives.ReduceOp.MAX, group)


def _rank_list(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def check_same(what: str, items: Mapping[str, object], group: dist.ProcessGroup | None = None) -> None:
    """Raise ``DisagreementError`` naming the first key whose value differs between ranks of ``group``."""
    if _skip(group):
        return
    keyed = {k: digest(v) for k, v in items.items()}
    hi, neg_lo = _both_extremes([total_digest(items, keyed)], group).tolist()
    if hi == -neg_lo:
        return
    # only on a mismatch: each rank's per-key digests
    every = collectives.all_gather_objects({k: (keyed[k], _show(v)) for k, v in items.items()}, group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(every)))
    keys = list(every[0]) + [k for e in every[1:] for k in e if k not in every[0]]
    for key in keys:
        seen = [e.get(key, (None, "missing")) for e in every]
        if len({s[0] for s in seen}) > 1:
            groups: dict = {}
            for r, (dg, shown) in zip(ranks, seen):
                groups.setdefault(dg, (shown, []))[1].append(r)
            parts = "; ".join(f"{_rank_list(rs)} {shown}" for shown, rs in groups.values())
            raise DisagreementError(f"{what}: ranks disagree on {key}: {parts}")
    raise DisagreementError(f"{what}: ranks disagree (same keys and values, another order)")


def row_digests(a: np.ndarray, rows: int) -> np.ndarray:
    """Linear hash of each of ``rows`` leading rows of ``a`` (``uint64[rows]``), one vectorized pass: for the
    per-(micro-step, layer) keys of large plan arrays (50 MB at Qwen3-30B-A3B, R = 64: ~15 ms)."""
    flat = np.ascontiguousarray(a).reshape(rows, -1)
    flat = flat.astype(np.int64, copy=False).view(np.uint64)
    with np.errstate(over="ignore"):
        return flat @ _weights(flat.shape[1])


def _weights(n: int) -> np.ndarray:
    """Fixed odd 64-bit weights (the same on every rank): ``a * w`` is never 0 mod 2^64 for a nonzero ``a``."""
    return np.random.default_rng(0x5EED).integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def peer_hash_R(counts_XR: np.ndarray) -> np.ndarray:
    """Linear hash per peer of ``counts_XR`` (X: flattened (micro-step, layer, kind)), as int64 bits."""
    w_X = _weights(counts_XR.shape[0])
    with np.errstate(over="ignore"):
        h_R = (counts_XR.astype(np.uint64) * w_X[:, None]).sum(axis=0, dtype=np.uint64)
    return h_R.view(np.int64)


def check_splits(what: str, send_MLKR: np.ndarray, recv_MLKR: np.ndarray,
                 group: dist.ProcessGroup | None = None, plan_items: Mapping[str, object] | None = None,
                 local_problem: str | None = None) -> None:
    """Raise ``DisagreementError`` unless, for every peer, this rank's send counts to it equal the peer's receive
    counts from this rank (``send_MLKR[m, l, k, s]``: rows this rank sends to group rank s in micro-step m,
    layer l, exchange kind k; ``recv_MLKR``: rows it receives from s). ``plan_items`` (optional) are checked to
    be the same on every rank in the same all-reduce (the plan the splits were compiled from).
    ``local_problem``: what this rank found wrong on its own (its batches do not fit the plan): raised on every
    rank of the group, from the same all-reduce (no extra collective when no rank has one)."""
    if _skip(group):
        if local_problem is not None:
            raise DisagreementError(f"{what}: {local_problem}")
        return
    M, L, K, R = send_MLKR.shape
    sent_R = torch.from_numpy(peer_hash_R(send_MLKR.reshape(-1, R)).copy())
    theirs_R = collectives.all_to_all(sent_R, group)  # peer s's hash of what it sends to this rank
    mine_R = peer_hash_R(recv_MLKR.reshape(-1, R))
    bad_R = theirs_R.numpy() != mine_R
    d = total_digest(plan_items) if plan_items is not None else 0
    hi, neg_lo, any_bad, _, any_problem, _ = _both_extremes(
        [d, int(bad_R.any()), int(local_problem is not None)], group).tolist()
    if any_problem:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(R))
        every = collectives.all_gather_objects(local_problem, group)
        first = next(i for i, p in enumerate(every) if p is not None)
        raise DisagreementError(f"{what}: rank {ranks[first]}: {every[first]}")
    if hi != -neg_lo:
        check_same(f"{what}: plan", plan_items, group)  # names the key (raises: the digests differ)
        raise DisagreementError(f"{what}: ranks hold different plans")
    if not any_bad:
        return
    # only on a mismatch: the full rows to each peer, then every rank's first disagreement for everyone
    rows_RX = collectives.all_to_all(torch.from_numpy(np.ascontiguousarray(
        send_MLKR.reshape(-1, R).T.astype(np.int64))), group).numpy()  # [s, x]: what s sends to this rank
    expect_RX = recv_MLKR.reshape(-1, R).T
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(R))
    me = ranks[dist.get_rank(group)] if group is not None else dist.get_rank()
    first = None
    diff_R, diff_X = np.nonzero(rows_RX != expect_RX)
    if len(diff_R):
        i = np.lexsort((diff_R, diff_X))[0]  # earliest (micro-step, layer, kind), then lowest peer
        m, l, k = np.unravel_index(diff_X[i], (M, L, K))
        s = diff_R[i]
        first = (int(diff_X[i]), f"micro-step {m} layer {l}: rank {ranks[s]} sends {rows_RX[s, diff_X[i]]} rows "
                                 f"({SPLIT_KINDS[k]}) to rank {me}, which expects {expect_RX[s, diff_X[i]]}")
    every = collectives.all_gather_objects(first, group)
    found = min((f for f in every if f is not None), default=(0, "send and receive counts differ"))
    raise DisagreementError(f"{what}: {found[1]}")
