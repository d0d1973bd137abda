"""Array and field decoding shared by the engine formats (every error names the sample and field)."""

from __future__ import annotations

import base64
import io

import numpy as np

from ..sample import RolloutError, RolloutSample


_NPY_B64 = base64.b64encode(b"\x93NUMPY")[:6].decode()


def decode_array(value, where: str, field: str, dtype: str | None = None) -> np.ndarray:
    """Nested lists, base64 ``.npy``, ``{"data", "dtype", "shape"}``, or raw base64 of ``dtype``."""
    if value is None:
        raise RolloutError(where, field, "missing")
    try:
        if isinstance(value, dict):
            data = value.get("data", value.get("values"))
            arr = np.frombuffer(base64.b64decode(data), dtype=np.dtype(value.get("dtype", dtype or "int32")))
            return arr.reshape(value["shape"]) if "shape" in value else arr
        if isinstance(value, str):
            raw = base64.b64decode(value, validate=True)
            if value.startswith(_NPY_B64):
                return np.load(io.BytesIO(raw), allow_pickle=False)
            return np.frombuffer(raw, dtype=np.dtype(dtype or "int32"))
        arr = np.asarray(value)
    except (ValueError, TypeError, KeyError) as e:
        raise RolloutError(where, field, f"cannot decode ({e})") from None
    if arr.dtype == object:
        raise RolloutError(where, field, "ragged nested lists (rows of different lengths)")
    return arr


def encode_npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _tokens(value, where: str, field: str) -> np.ndarray:
    arr = decode_array(value, where, field)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise RolloutError(where, field, f"expected a list of integer token ids, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64)


def _routes(value, where: str, field: str, layers_topk: tuple[int, int] | None = None, dtype=None) -> np.ndarray:
    if value is None:
        raise RolloutError(where, field, "missing (was the engine started with routed experts returned?)")
    arr = decode_array(value, where, field, dtype)
    if arr.dtype in (np.uint16, np.uint32):  # -1 (no route) written into an unsigned buffer reads as its max
        arr = np.where(arr == np.iinfo(arr.dtype).max, -1, arr.astype(np.int64))  # never an expert id (<= 32768)
    if layers_topk is not None and arr.ndim == 1:  # flat wire format (SGLang)
        X, K = layers_topk
        if arr.size % (X * K):
            raise RolloutError(where, field, f"{arr.size} ids are not a multiple of layers x top_k = {X} x {K}")
        arr = arr.reshape(-1, X, K)
    if arr.ndim == 2 and arr.shape[0] == 0:
        arr = arr.reshape(0, *(layers_topk or (0, 0)))
    return arr


def _logprobs_full(T: int, start: int, values, where: str, field: str) -> np.ndarray:
    lp = np.full(T, np.nan, dtype=np.float32)
    vals = np.asarray(values, dtype=np.float64)
    if vals.ndim != 1 or start + len(vals) > T:
        raise RolloutError(where, field, f"{vals.shape} values do not fit positions {start}..{T - 1}")
    lp[start : start + len(vals)] = vals
    return lp


def _first(rec: dict, keys: tuple[str, ...], cast):
    """``cast`` of the first of ``keys`` that ``rec`` holds (not None), else None: engines name fields differently."""
    for k in keys:
        if rec.get(k) is not None:
            return cast(rec[k])
    return None


def _reward(rec: dict, *keys: str) -> float | None:
    return _first(rec, keys, float)


def _text(rec: dict, *keys: str) -> str | None:
    """An answer or group id, as text."""
    return _first(rec, keys, str)


def _extras(rec: dict, s: RolloutSample, answer_key: str = "answer", group_key: str = "group") -> None:
    if s.reward is not None:
        rec["reward"] = s.reward
    if s.answer is not None:
        rec[answer_key] = s.answer
    if s.group is not None:
        rec[group_key] = s.group
