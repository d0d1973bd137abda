"""Rollout engines' routed-experts wire formats -> ``RolloutSample`` (and back, for tests and examples).

Every engine below records the top-k expert ids of each token *fed through the
model*, so a sequence of T tokens has routes for positions ``0 .. T-2``: the last
token was sampled and never fed back. That is our ``RoutingLog`` convention
(``titan_foremoe/routing_log/``: ``[T-1, layers, top_k]`` per sequence, uint8
for <= 256 experts else int16). What differs is where the rows sit and how they
are encoded; each reader below checks the row count against the tokens, so a
shifted or padded layout is refused, never replayed against the wrong tokens.
Sources read (2026): vllm-project/vllm, sgl-project/sglang, volcengine/verl,
THUDM/slime.

One module per engine (``vllm``, ``sglang``, ``verl``, ``slime``) documents where its
routes sit, their dtype, which positions they cover, and what the reader refuses;
``codec`` decodes arrays, ``files`` reads JSONL / Parquet.
"""

from __future__ import annotations

from collections.abc import Callable

from ..sample import RolloutSample
from .codec import decode_array, encode_npy_b64
from .files import iter_records, write_records
from .sglang import read_sglang, write_sglang
from .slime import read_slime, write_slime
from .verl import read_verl, write_verl
from .vllm import read_vllm, write_vllm

FORMATS = ("vllm", "sglang", "verl", "slime")

READERS: dict[str, Callable[[dict, str, tuple[int, int]], list[RolloutSample]]] = {
    "vllm": read_vllm, "sglang": read_sglang, "verl": read_verl, "slime": read_slime,
}

__all__ = ["FORMATS", "READERS", "decode_array", "encode_npy_b64", "iter_records", "read_sglang", "read_slime",
           "read_verl", "read_vllm", "write_records", "write_sglang", "write_slime", "write_verl", "write_vllm"]
