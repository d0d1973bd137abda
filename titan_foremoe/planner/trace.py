"""Routing traces: validate, group responses into steps / micro-steps, count loads.

Trace format (npz): ``experts`` uint8 [tokens, layers, top_k] (selected experts of
every generated token), ``offsets`` int64 [responses + 1] (response i is
experts[offsets[i]:offsets[i+1]]); other arrays (dataset, category) are ignored.
"""

from __future__ import annotations

import numpy as np


def validate_trace(experts: np.ndarray, offsets: np.ndarray, num_experts: int | None = None) -> int:
    """Raise ValueError naming the bad field; return the number of experts."""
    if not isinstance(experts, np.ndarray) or experts.dtype.kind not in "iu":
        raise ValueError(f"trace field 'experts' must be an integer array, got {getattr(experts, 'dtype', type(experts))}")
    if experts.ndim != 3 or min(experts.shape) < 1:
        raise ValueError(f"trace field 'experts' must be [tokens, layers, top_k], got shape {experts.shape}")
    if not isinstance(offsets, np.ndarray) or offsets.dtype.kind not in "iu" or offsets.ndim != 1:
        raise ValueError("trace field 'offsets' must be a 1-D integer array")
    if len(offsets) < 2:
        raise ValueError("trace field 'offsets' must hold at least one response")
    if offsets[0] != 0 or offsets[-1] != experts.shape[0]:
        raise ValueError(
            f"trace field 'offsets' must start at 0 and end at the token count {experts.shape[0]}, "
            f"got {offsets[0]}..{offsets[-1]}"
        )
    if (np.diff(offsets) < 0).any():
        raise ValueError("trace field 'offsets' is not monotone")
    lo, hi = int(experts.min()), int(experts.max())
    if num_experts is None:
        num_experts = hi + 1
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"trace field 'experts' has ids out of range [0, {num_experts}): {lo}..{hi}")
    return num_experts


def load_trace(path: str, num_experts: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Read and validate a trace file; returns (experts, offsets, num_experts)."""
    try:
        data = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise ValueError(f"trace file not found: {path}") from None
    except Exception as exc:  # zip / pickle / format errors
        raise ValueError(f"trace file {path} is not a readable npz: {exc}") from None
    for field in ("experts", "offsets"):
        if field not in data.files:
            raise ValueError(f"trace is missing the field '{field}'")
    experts, offsets = data["experts"], data["offsets"]
    return experts, offsets, validate_trace(experts, offsets, num_experts)


def schedule_responses(
    num_responses: int, global_batch: int, responses_per_microstep: int, seed: int
) -> np.ndarray:
    """responses_MB: trace indices of each micro-step, from a seeded permutation.

    Responses form steps of ``global_batch`` (the incomplete last step is dropped),
    each split into global_batch / responses_per_microstep micro-steps.
    """
    if global_batch % responses_per_microstep:
        raise ValueError(f"global batch {global_batch} is not a multiple of responses per micro-step {responses_per_microstep}")
    steps = num_responses // global_batch
    if steps < 1:
        raise ValueError(f"trace has {num_responses} responses, fewer than one global batch of {global_batch}")
    perm = np.random.default_rng(seed).permutation(num_responses)[: steps * global_batch]
    return perm.reshape(-1, responses_per_microstep).astype(np.int64)


def loads_from_trace(experts: np.ndarray, offsets: np.ndarray, responses_MB: np.ndarray, num_ranks: int, num_experts: int) -> np.ndarray:
    """loads_MLSE: source rank s of micro-step m gets responses [s*B/R, (s+1)*B/R)."""
    M, B = responses_MB.shape
    if B % num_ranks:
        raise ValueError(f"responses per micro-step ({B}) must be a multiple of ranks ({num_ranks})")
    _, L, _ = experts.shape
    E = num_experts
    src = (np.arange(B) // (B // num_ranks))[None, :].repeat(M, 0)
    ms = (np.arange(M)[:, None] * num_ranks + src).ravel()  # micro-step x source id of each response
    resp = responses_MB.ravel()
    lens = offsets[resp + 1] - offsets[resp]
    starts = offsets[resp]
    tok = np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(lens.sum())
    tok_ms = np.repeat(ms, lens)
    m, s = np.divmod(tok_ms, num_ranks)
    ex = experts[tok].astype(np.int64)  # [T, L, k]
    idx = ((m[:, None, None] * L + np.arange(L)[None, :, None]) * num_ranks + s[:, None, None]) * E + ex
    return np.bincount(idx.ravel(), minlength=M * L * num_ranks * E).reshape(M, L, num_ranks, E)
