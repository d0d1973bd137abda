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

**vllm** (``--enable-return-routed-experts``; ``vllm/outputs.py``
``CompletionOutput.routed_experts``, filled by the v1 scheduler's
``_get_routed_experts`` with ``num_tokens = request.num_tokens - 1`` rows read
from an **int32** host buffer). Offline ``LLM.generate``: per completion
``routed_experts [prompt_len + gen_len - 1, L, K]`` covering prompt *and*
completion. vLLM 0.21.0's OpenAI server split it: response-level
``prompt_routed_experts [prompt_len, L, K]`` plus per-choice ``routed_experts
[gen_len - 1, L, K]`` (removed again in 0.21.1). The issue text describes the
split layout as the only one and says int16/uint8; the sources we read use
int32 for both. Record: ``{"prompt_token_ids", "outputs" | "choices": [{"token_ids",
"routed_experts", "logprobs"?}], "prompt_routed_experts"?, "reward"?, "answer"?}``;
arrays as nested lists, base64 ``.npy``, or ``{"data": base64, "dtype", "shape"}``;
``logprobs`` as floats or vLLM's ``[{token_id: {"logprob": x}}]``. Without a ``group``
field, consecutive samples with the same prompt (one record's ``n`` completions, or
``n = 1`` records in a row) form one GRPO group, in every format.

**sglang** (``--enable-return-routed-experts``, request ``return_routed_experts``;
``meta_info["routed_experts"]`` = base64 of a flat **int32** array, decoded by
``extract_routed_experts_from_meta_info``; newer versions add
``meta_info["routed_experts_dtype"]``). It covers positions
``[routed_experts_start_len, len(input_ids) + len(output_ids) - 1)``, start 0 by
default (slime checks ``len(tokens) - 1 - start_len`` rows). Record: ``{"input_ids",
"output_ids", "meta_info": {"routed_experts", "output_token_logprobs"?:
[[logprob, id, text]]}, "reward"?, "answer"?, "group"?}``. Multi-turn: ``{"turns":
[record, ...]}``, each turn's ``input_ids`` the conversation so far: the final
sequence is the last turn's input + output, every turn's input must be a prefix of
it, and the turns' rows together must cover every position ``0 .. T-2`` (a missing
segment is refused with the positions it leaves uncovered). Every token after the
first turn's prompt is trained on (tool/user tokens included: we keep no
per-token loss mask).

**verl** (router replay "R3", ``verl/experimental/agent_loop/agent_loop.py``):
batch tensors padded to ``[batch, prompt_len + response_len, L, K]``; prompts
left-padded, responses right-padded, the engine's ``seq_len - 1`` rows copied in
from the first real prompt token, so the **last real token's row and every padding
row are zero filler** that looks like expert 0. We keep rows where
``attention_mask`` is 1, drop the last, and refuse (for top-k > 1) a filler row
that is not zero, which is what a route shifted by one position or a padding row
counted as a route looks like. Record (one batch row): ``{"input_ids",
"attention_mask", "prompts" | "prompt_length", "routed_experts", "rollout_log_probs"?
(response positions), "reward"?, "answer"?, "uid"?}``.

**slime** (``slime/utils/types.py`` ``Sample.rollout_routed_experts``; its Megatron
actor asserts ``experts.shape[0] == tokens.shape[0] - 1``): ``[seq_len - 1, L, K]``
per sample, int32 from SGLang. Record: ``{"tokens", "response_length",
"rollout_routed_experts", "rollout_log_probs"? (response), "reward"?, "label"?,
"group_index"?}``.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from .sample import RolloutError, RolloutSample

FORMATS = ("vllm", "sglang", "verl", "slime")

# -- array codecs -----------------------------------------------------------------

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


def _reward(rec: dict, *keys: str) -> float | None:
    for k in keys:
        if rec.get(k) is not None:
            return float(rec[k])
    return None


def _answer(rec: dict, *keys: str) -> str | None:
    for k in keys:
        if rec.get(k) is not None:
            return str(rec[k])
    return None


# -- vLLM ------------------------------------------------------------------------


def _vllm_logprobs(value, ids: np.ndarray, where: str) -> list[float]:
    out = []
    for i, entry in enumerate(value):
        if isinstance(entry, dict):  # vLLM's {token_id: Logprob}; JSON keys are strings
            hit = entry.get(str(int(ids[i])), entry.get(int(ids[i])))
            if hit is None:
                raise RolloutError(where, "logprobs", f"no entry for the sampled token at completion position {i}")
            out.append(float(hit["logprob"] if isinstance(hit, dict) else hit))
        else:
            out.append(float(entry))
    return out


def read_vllm(rec: dict, where: str, layers_topk) -> list[RolloutSample]:
    prompt = _tokens(rec.get("prompt_token_ids"), where, "prompt_token_ids")
    outputs = rec.get("outputs", rec.get("choices"))
    if not outputs:
        raise RolloutError(where, "outputs", "no completions")
    split = rec.get("prompt_routed_experts") is not None
    prompt_routes = _routes(rec["prompt_routed_experts"], where, "prompt_routed_experts") if split else None
    if split and prompt_routes.shape[0] != len(prompt):
        raise RolloutError(where, "prompt_routed_experts",
                           f"{prompt_routes.shape[0]} rows for {len(prompt)} prompt tokens (expected one per prompt token)")
    samples = []
    for j, out in enumerate(outputs):
        w = f"{where} completion {j}"
        gen = _tokens(out.get("token_ids"), w, "token_ids")
        tokens = np.concatenate([prompt, gen])
        routes = _routes(out.get("routed_experts"), w, "routed_experts")
        if split:
            if routes.shape[0] != max(len(gen) - 1, 0):
                raise RolloutError(w, "routed_experts", f"{routes.shape[0]} rows for {len(gen)} generated tokens "
                                   "(the split layout has gen_len - 1: the last sampled token has none)")
            routes = np.concatenate([prompt_routes, routes.reshape(-1, *prompt_routes.shape[1:])])
        lp = None
        if out.get("logprobs") is not None:
            lp = _logprobs_full(len(tokens), len(prompt), _vllm_logprobs(out["logprobs"], gen, w), w, "logprobs")
        samples.append(RolloutSample(
            tokens, len(prompt), routes, lp, _reward(out, "reward") if "reward" in out else _reward(rec, "reward"),
            _answer(rec, "answer"), _group(rec, "group"),  # else: consecutive samples of one prompt
        ))
    return samples


def write_vllm(samples: list[RolloutSample], split: bool = False, logprob_dicts: bool = True) -> dict:
    """One vLLM record for samples sharing a prompt (a GRPO group)."""
    P = samples[0].prompt_len
    prompt = samples[0].tokens_T[:P]
    rec = {"prompt_token_ids": prompt.tolist(), "outputs": []}
    if split:
        rec["prompt_routed_experts"] = encode_npy_b64(samples[0].routes_RXK[:P].astype(np.int32))
    for s in samples:
        assert s.prompt_len == P and (s.tokens_T[:P] == prompt).all()
        gen = s.tokens_T[P:]
        routes = s.routes_RXK[P:] if split else s.routes_RXK
        out = {"token_ids": gen.tolist(), "routed_experts": routes.astype(np.int32).tolist() if not split
               else encode_npy_b64(routes.astype(np.int32))}
        if s.logprobs_T is not None:
            out["logprobs"] = ([{str(int(t)): {"logprob": float(v)}} for t, v in zip(gen, s.logprobs_T[P:])]
                               if logprob_dicts else s.logprobs_T[P:].tolist())
        if s.reward is not None:
            out["reward"] = s.reward
        rec["outputs"].append(out)
    if samples[0].answer is not None:
        rec["answer"] = samples[0].answer
    if samples[0].group is not None:
        rec["group"] = samples[0].group
    return rec


# -- SGLang ----------------------------------------------------------------------


def _sglang_turn(turn: dict, where: str, layers_topk):
    inp = _tokens(turn.get("input_ids"), where, "input_ids")
    out = _tokens(turn.get("output_ids"), where, "output_ids")
    meta = turn.get("meta_info") or {}
    routes = _routes(meta.get("routed_experts"), where, "meta_info.routed_experts", layers_topk,
                     meta.get("routed_experts_dtype"))
    start = int(meta.get("routed_experts_start_len", 0) or 0)
    end = len(inp) + len(out) - 1
    if start < 0 or routes.shape[0] != end - start:
        raise RolloutError(where, "meta_info.routed_experts",
                           f"{routes.shape[0]} rows, expected positions [{start}, {end}) = {end - start} "
                           "(input + output tokens - 1: the last output token has none)")
    lps = meta.get("output_token_logprobs")
    return inp, out, routes, start, [float(e[0]) for e in lps] if lps is not None else None


def read_sglang(rec: dict, where: str, layers_topk) -> list[RolloutSample]:
    turns = rec["turns"] if "turns" in rec else [rec]
    parsed = [_sglang_turn(t, f"{where} turn {i}" if "turns" in rec else where, layers_topk)
              for i, t in enumerate(turns)]
    final_in, final_out = parsed[-1][0], parsed[-1][1]
    tokens = np.concatenate([final_in, final_out])
    T = len(tokens)
    X, K = layers_topk
    routes = np.zeros((T - 1, X, K), dtype=np.int64)
    covered = np.zeros(T - 1, dtype=bool)
    lp = np.full(T, np.nan, dtype=np.float32)
    for i, (inp, out, r, start, lps) in enumerate(parsed):
        seq = np.concatenate([inp, out])
        if len(seq) > T or (tokens[: len(seq)] != seq).any():
            raise RolloutError(f"{where} turn {i}", "input_ids",
                               "this turn's tokens are not a prefix of the final sequence (turns out of order?)")
        routes[start : start + len(r)] = r
        covered[start : start + len(r)] = True
        if lps is not None:
            if len(lps) != len(out):
                raise RolloutError(f"{where} turn {i}", "meta_info.output_token_logprobs",
                                   f"{len(lps)} values for {len(out)} output tokens")
            lp[len(inp) : len(seq)] = lps
    if not covered.all():
        gaps = np.flatnonzero(~covered)
        raise RolloutError(where, "meta_info.routed_experts",
                           f"positions {gaps[0]}..{gaps[-1]} have no route ({len(gaps)} of {T - 1}): "
                           "a turn's routed experts are missing")
    has_lp = any(p[4] is not None for p in parsed)
    if has_lp and np.isnan(lp[len(parsed[0][0]) :]).any():
        lp = None  # tool/user tokens between turns carry no behaviour log-prob
    return [RolloutSample(tokens, len(parsed[0][0]), routes, lp if has_lp else None, _reward(rec, "reward"),
                          _answer(rec, "answer", "label"), _group(rec, "group"))]


def write_sglang(s: RolloutSample, turns: list[int] | None = None, dtype: str = "int32") -> dict:
    """A /generate response; ``turns``: completion split points (multi-turn, each turn re-sends the prefix)."""
    P, T = s.prompt_len, len(s.tokens_T)
    cuts = [P, *(turns or []), T]
    out_turns = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        meta = {"routed_experts": base64.b64encode(s.routes_RXK[: b - 1].astype(dtype).tobytes()).decode()}
        if dtype != "int32":
            meta["routed_experts_dtype"] = dtype
        if s.logprobs_T is not None:
            meta["output_token_logprobs"] = [[float(v), int(t), None] for v, t in zip(s.logprobs_T[a:b], s.tokens_T[a:b])]
        out_turns.append({"input_ids": s.tokens_T[:a].tolist(), "output_ids": s.tokens_T[a:b].tolist(), "meta_info": meta})
    rec = {"turns": out_turns} if turns else out_turns[0]
    _extras(rec, s)
    return rec


def _group(rec: dict, *keys: str) -> str | None:
    for k in keys:
        if rec.get(k) is not None:
            return str(rec[k])
    return None


def _extras(rec: dict, s: RolloutSample, answer_key: str = "answer", group_key: str = "group") -> None:
    if s.reward is not None:
        rec["reward"] = s.reward
    if s.answer is not None:
        rec[answer_key] = s.answer
    if s.group is not None:
        rec[group_key] = s.group


# -- verl ------------------------------------------------------------------------


def read_verl(rec: dict, where: str, layers_topk) -> list[RolloutSample]:
    ids = _tokens(rec.get("input_ids"), where, "input_ids")
    mask = decode_array(rec.get("attention_mask"), where, "attention_mask").astype(np.int64)
    if mask.shape != ids.shape:
        raise RolloutError(where, "attention_mask", f"shape {mask.shape} != input_ids {ids.shape}")
    P_pad = len(rec["prompts"]) if rec.get("prompts") is not None else rec.get("prompt_length")
    if P_pad is None:
        raise RolloutError(where, "prompts", "need 'prompts' (left-padded) or 'prompt_length' (its padded width)")
    P_pad = int(P_pad)
    real = np.flatnonzero(mask)
    if len(real) == 0 or (np.diff(real) != 1).any() or real[0] > P_pad or real[-1] < P_pad:
        raise RolloutError(where, "attention_mask",
                           "real tokens must be one run: prompt left-padded, response right-padded, both non-empty")
    lo, hi = int(real[0]), int(real[-1]) + 1
    routes = _routes(rec.get("routed_experts"), where, "routed_experts")
    if routes.ndim != 3 or routes.shape[0] != len(ids):
        raise RolloutError(where, "routed_experts",
                           f"shape {routes.shape}, expected [{len(ids)} (prompt_len + response_len, padded), layers, top_k]")
    if routes.shape[2] > 1:
        filler = np.concatenate([np.arange(0, lo), np.arange(hi - 1, len(ids))])
        nonzero = filler[(routes[filler] != 0).any(axis=(1, 2))]
        if len(nonzero):
            raise RolloutError(
                where, "routed_experts",
                f"row {nonzero[0]} is padding or the last real token (real tokens at {lo}..{hi - 1}) but holds "
                f"experts {routes[nonzero[0], 0].tolist()}: routes are shifted against the tokens",
            )
    tokens = ids[lo:hi]
    lp = None
    if rec.get("rollout_log_probs") is not None:
        resp = np.asarray(rec["rollout_log_probs"], dtype=np.float64)[: hi - P_pad]
        lp = _logprobs_full(len(tokens), P_pad - lo, resp, where, "rollout_log_probs")
    return [RolloutSample(tokens, P_pad - lo, routes[lo : hi - 1], lp, _reward(rec, "reward", "score"),
                          _answer(rec, "answer", "ground_truth"), _group(rec, "uid", "group"))]


def write_verl(s: RolloutSample, prompt_width: int, response_width: int) -> dict:
    P, T = s.prompt_len, len(s.tokens_T)
    R = T - P
    assert P <= prompt_width and R <= response_width
    W = prompt_width + response_width
    lo = prompt_width - P
    ids = np.zeros(W, dtype=np.int64)
    mask = np.zeros(W, dtype=np.int64)
    ids[lo : lo + T] = s.tokens_T
    mask[lo : lo + T] = 1
    routes = np.zeros((W, *s.routes_RXK.shape[1:]), dtype=np.int32)
    routes[lo : lo + T - 1] = s.routes_RXK
    rec = {"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "prompts": ids[:prompt_width].tolist(),
           "responses": ids[prompt_width:].tolist(), "routed_experts": routes.tolist()}
    if s.logprobs_T is not None:
        rec["rollout_log_probs"] = np.pad(s.logprobs_T[P:], (0, response_width - R)).tolist()
    _extras(rec, s, group_key="uid")
    return rec


# -- slime -----------------------------------------------------------------------


def read_slime(rec: dict, where: str, layers_topk) -> list[RolloutSample]:
    tokens = _tokens(rec.get("tokens"), where, "tokens")
    R = int(rec.get("response_length", 0))
    if not 1 <= R < len(tokens):
        raise RolloutError(where, "response_length", f"{R} for {len(tokens)} tokens")
    routes = _routes(rec.get("rollout_routed_experts"), where, "rollout_routed_experts")
    lp = None
    if rec.get("rollout_log_probs") is not None:
        vals = rec["rollout_log_probs"]
        if len(vals) != R:
            raise RolloutError(where, "rollout_log_probs", f"{len(vals)} values for response_length {R}")
        lp = _logprobs_full(len(tokens), len(tokens) - R, vals, where, "rollout_log_probs")
    return [RolloutSample(tokens, len(tokens) - R, routes, lp, _reward(rec, "reward"), _answer(rec, "label", "answer"),
                          _group(rec, "group_index", "group"))]


def write_slime(s: RolloutSample) -> dict:
    T = len(s.tokens_T)
    rec = {"tokens": s.tokens_T.tolist(), "response_length": T - s.prompt_len,
           "rollout_routed_experts": s.routes_RXK.astype(np.int32).tolist()}
    if s.logprobs_T is not None:
        rec["rollout_log_probs"] = s.logprobs_T[s.prompt_len :].tolist()
    _extras(rec, s, answer_key="label", group_key="group_index")
    return rec


READERS: dict[str, Callable[[dict, str, tuple[int, int]], list[RolloutSample]]] = {
    "vllm": read_vllm, "sglang": read_sglang, "verl": read_verl, "slime": read_slime,
}


# -- files -----------------------------------------------------------------------


def iter_records(path: str | Path) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` for every JSON line or Parquet row of ``path``."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        i = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):  # streamed, not the whole table
            for rec in batch.to_pylist():
                yield f"{path.name} row {i}", rec
                i += 1
        return
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            where = f"{path.name} line {i + 1}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise RolloutError(where, "json", str(e)) from None
            if not isinstance(rec, dict):
                raise RolloutError(where, "json", f"expected an object per line, got {type(rec).__name__}")
            yield where, rec


def write_records(path: str | Path, records: list[dict]) -> None:
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
        return
    with open(path, "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
