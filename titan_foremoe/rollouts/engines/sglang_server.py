"""An SGLang server (launched and owned by the trainer, or one the user runs) and its HTTP client.

Legend: P prompt tokens, G generated tokens, R = P + G - 1 routed positions (every fed token; the last generated
token is never fed back), X MoE layers, K experts per token.

What the client relies on, read from SGLang's source (sgl-project/sglang; file @ commit):

- ``POST /generate`` (``srt/entrypoints/http_server.py`` @ 0025436e) takes a ``GenerateReqInput``
  (``srt/managers/io_struct.py`` @ 001067ff): ``input_ids``, ``sampling_params`` (``max_new_tokens``,
  ``temperature``, ``top_p``, ``sampling_seed``: ``srt/sampling/sampling_params.py`` @ 00c17caf; temperature 0
  is greedy, ``top_k = 1``), ``return_logprob``, ``logprob_start_len`` (-1 by default: output tokens only; 0:
  every prompt token too), ``return_routed_experts``. A server started with ``--skip-tokenizer-init`` answers
  ``{"output_ids": [...], "meta_info": {...}}`` (``tokenizer_manager.py``, the ``BatchTokenIDOutput`` branch).
- ``meta_info["output_token_logprobs"]``: one ``[logprob, token_id, text-or-null]`` per generated token;
  ``meta_info["input_token_logprobs"]`` (``logprob_start_len`` 0): one per prompt token, the first one's
  logprob null (``scheduler_output_processor_mixin.py``: "Always pad the first one with None"). The values are
  ``log_softmax(logits / temperature)`` before top-k / top-p / min-p (``srt/layers/sampler.py``), unless the
  server sets ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (then before temperature).
- ``meta_info["routed_experts"]`` (server flag ``--enable-return-routed-experts``, request
  ``return_routed_experts``): base64 of the raw bytes of an **int32** ``[R, X, K]`` array, C order, positions
  ``routed_experts_start_len`` (0 by default) .. ``P + G - 2``: ``RoutedExpertsCapturer.get_routed_experts``
  reads ``req_to_token[: seqlen - 1]`` (``srt/layers/moe/routed_experts_capturer.py`` @ d4d0fc58), and
  ``tokenizer_manager`` encodes ``tensor.numpy().tobytes()``; newer versions may add
  ``meta_info["routed_experts_dtype"]``.
- ``POST /update_weights_from_disk`` ``{"model_path", "load_format"?, "abort_all_requests"?, "flush_cache"?
  (newer versions; the scheduler flushes after a successful load either way), "weight_version"?}`` answers
  ``{"success", "message", "num_paused_requests"}``, HTTP 400 on failure. ``/flush_cache`` (GET or POST) drops
  the radix cache (HTTP 400 while requests run). ``GET /health`` generates one token (503 while starting);
  ``GET /get_model_info`` names ``model_path`` and ``weight_version``; ``GET /get_server_info`` has ``version``.
- ``POST /init_weights_update_group`` ``{"master_address", "master_port", "rank_offset", "world_size",
  "group_name", "backend"}`` and ``/update_weights_from_distributed`` ``{"names", "dtypes", "shapes",
  "group_name", "flush_cache"}`` move weights by NCCL broadcast (GPU); not wired here (docs/rollouts_sglang.md).
"""

from __future__ import annotations

import base64
import binascii
import os
import subprocess

import numpy as np

from .vllm_server import Completion, EngineError, VLLMClient, VLLMServer

_HAS_SGLANG = ("import importlib.util as u, sys; m = [n for n in ('sglang',) if u.find_spec(n) is None];"
               " print(' '.join(m)); sys.exit(1 if m else 0)")


def sglang_missing(python: str) -> str | None:
    """Why ``python`` cannot serve SGLang (it does not run, or lacks the package), or None; no import (~0.1 s)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        r = subprocess.run([python, "-c", _HAS_SGLANG], capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{python} does not run ({err})"
    if r.returncode != 0:
        return f"{python} lacks {r.stdout.strip() or r.stderr.strip()[-200:]}"
    return None


class SGLangServer(VLLMServer):
    """``python -m sglang.launch_server`` on 127.0.0.1 and a free port, tokens in and out, routes returned."""

    name = "SGLang"

    def command(self) -> list[str]:
        s = self.spec
        return [s.python, "-m", "sglang.launch_server", "--model-path", s.model, "--host", "127.0.0.1",
                "--port", str(self.port), "--dtype", s.dtype, "--context-length", str(s.max_model_len),
                "--max-running-requests", str(s.max_num_seqs), "--enable-return-routed-experts",
                "--random-seed", "0",
                # token ids in and out: no detokenizing (a sampled id of the padded vocabulary has no text)
                "--skip-tokenizer-init", *s.extra_args]

    def _refusal(self) -> str | None:
        if not os.path.isfile(self.spec.python):
            return (f"[sglang_engine] python {self.spec.python!r} does not exist: point it at a venv with SGLang "
                    "(docs/rollouts_sglang.md)")
        return None

    def _env(self) -> dict:
        env = {**os.environ}
        args = list(self.spec.extra_args)
        if "--device" in args[:-1] and args[args.index("--device") + 1] == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"  # 0.5.23 ``srt/utils/common.py: is_cpu`` reads it (else CUDA paths)
        return env


def decode_routes(meta: dict, n_tokens: int, layers: int, top_k: int, where: str) -> np.ndarray:
    """``meta_info["routed_experts"]`` as ``[R, X, K]`` int64 for a sequence of ``n_tokens`` (R = n_tokens - 1
    from ``routed_experts_start_len``, 0 by default); anything else is an ``EngineError`` saying what it holds."""
    b64 = meta.get("routed_experts")
    if b64 is None:
        raise EngineError(f"{where}: meta_info has no routed_experts (start SGLang with "
                          "--enable-return-routed-experts; the request sets return_routed_experts)")
    start = int(meta.get("routed_experts_start_len") or 0)
    dtype = np.dtype(meta.get("routed_experts_dtype") or "int32")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise EngineError(f"{where}: meta_info.routed_experts is not base64 ({e})") from None
    rows = n_tokens - 1 - start
    want = rows * layers * top_k * dtype.itemsize
    if len(raw) != want:
        have = len(raw) / dtype.itemsize
        per_row = have / rows if rows else float("nan")
        raise EngineError(
            f"{where}: meta_info.routed_experts holds {len(raw)} bytes = {have:g} {dtype} ids, expected {want} "
            f"bytes = {rows} positions (tokens {start}..{n_tokens - 2}) x {layers} layers x {top_k} experts "
            f"({per_row:g} ids per position instead of {layers * top_k}: does the engine serve a model with "
            f"another layer count or top-k?)")
    return np.frombuffer(raw, dtype=dtype).reshape(rows, layers, top_k).astype(np.int64)


def _logprobs(entries, token_ids: list[int], where: str, field: str) -> list[float]:
    """``[[logprob, token_id, text], ...]`` checked against ``token_ids``; returns the log-probs."""
    if not isinstance(entries, list) or len(entries) != len(token_ids):
        n = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise EngineError(f"{where}: meta_info.{field} has {n} entries for {len(token_ids)} tokens "
                          "(the request sets return_logprob)")
    out = []
    for t, (e, tok) in enumerate(zip(entries, token_ids)):
        if not isinstance(e, (list, tuple)) or len(e) < 2 or int(e[1]) != tok:
            raise EngineError(f"{where}: meta_info.{field}[{t}] = {e!r} is not [logprob, {tok}, text]")
        out.append(float("nan") if e[0] is None else float(e[0]))
    return out


class SGLangClient(VLLMClient):
    """HTTP client of one SGLang server (same calls as ``VLLMClient``; every failure an ``EngineError``).

    ``layers`` and ``top_k`` are the policy's: SGLang's routes are a flat int32 buffer, so its shape is checked
    against them."""

    name = "SGLang"

    def __init__(self, url: str, *, layers: int, top_k: int, timeout_s: float = 300.0, retries: int = 2,
                 concurrency: int = 8):
        super().__init__(url, timeout_s=timeout_s, retries=retries, concurrency=concurrency)
        self.layers, self.top_k = layers, top_k

    def _before_threads(self) -> None:
        """SGLang has one dialect: nothing to ask."""

    def _sample(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float,
                seed: int) -> Completion:
        sp = {"max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
              "sampling_seed": seed % 2**31}  # honoured by SGLang with --enable-deterministic-inference
        out = self.post("/generate", {"input_ids": list(prompt_ids), "sampling_params": sp, "return_logprob": True,
                                      "return_routed_experts": True}) or {}
        where = f"SGLang at {self.url}/generate"
        gen, meta = out.get("output_ids"), out.get("meta_info")
        if not isinstance(gen, list) or not isinstance(meta, dict):
            raise EngineError(f"{where}: expected {{output_ids, meta_info}}, got keys {sorted(out)}"
                              " (is the server started with --skip-tokenizer-init?)")
        gen = [int(t) for t in gen]
        lp = _logprobs(meta.get("output_token_logprobs"), gen, where, "output_token_logprobs")
        routes = decode_routes(meta, len(prompt_ids) + len(gen), self.layers, self.top_k, where)
        finish = meta.get("finish_reason")
        return Completion(list(prompt_ids), gen, lp, routes,
                          finish.get("type") if isinstance(finish, dict) else finish)

    def prompt_logprobs(self, token_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """log p(token t | tokens < t) for t >= 1 (``[T - 1]``) and the prompt's routes ``[T, X, K]``."""
        body = {"input_ids": list(token_ids), "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                "return_logprob": True, "logprob_start_len": 0, "return_routed_experts": True}
        out = self.post("/generate", body) or {}
        where = f"SGLang at {self.url}/generate (probe)"
        meta, gen = out.get("meta_info") or {}, out.get("output_ids") or []
        lp = _logprobs(meta.get("input_token_logprobs"), list(token_ids), where, "input_token_logprobs")
        routes = decode_routes(meta, len(token_ids) + len(gen), self.layers, self.top_k, where)
        return np.array(lp[1:], np.float64), routes[: len(token_ids)]

    def reload_weights(self, folder: str) -> None:
        """The engine loads ``folder`` (an HF folder) in place; a refusal names SGLang's message."""
        out = self.post("/update_weights_from_disk", {"model_path": folder, "flush_cache": True}) or {}
        if not out.get("success", False):
            raise EngineError(f"SGLang at {self.url}/update_weights_from_disk refused {folder}: "
                              f"{out.get('message', out)}")

    def reset_prefix_cache(self) -> None:
        """Radix-cache entries (KV and the routes recorded at their slots) belong to the old weights: drop them."""
        self.post("/flush_cache")

