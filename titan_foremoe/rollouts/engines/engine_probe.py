"""Why a vLLM engine at a URL cannot serve, in one line each (issue 46): nothing listens there (connection
refused), the host does not answer (timed out), something that is not vLLM answers (an HTML page, another
server), or vLLM answers without our ``FusedExpertLoad`` worker extension. ``probe`` asks once, before any worker
starts (the pre-flight, for an engine the user runs); ``reach_reason`` names a failed request's cause at run time.

Cost: at most two HTTP requests per pre-flight (``GET /version``, ``POST /collective_rpc`` with the extension's
idempotent install), none per step.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

from .errors import EngineError, EngineUnreachable, not_vllm


def reach_reason(err: BaseException) -> str:
    """A request that got no answer, in words naming the cause."""
    reason = getattr(err, "reason", err)  # URLError wraps the socket's error
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused (nothing listens at that port: is the engine started, and the URL's port right?)"
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return "timed out (the host does not answer: a wrong address, a firewall, or an engine too busy to reply)"
    if isinstance(reason, socket.gaierror):
        return f"unknown host ({reason})"
    return str(reason) or type(reason).__name__


def _call(url: str, path: str, body: dict | None, timeout_s: float) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise EngineError(f"vLLM at {url}{path}: HTTP {e.code}: {e.read()[:300]!r}") from None
    except (OSError, urllib.error.URLError) as e:
        raise EngineUnreachable(f"vLLM at {url} is unreachable: {reach_reason(e)}") from None
    try:
        answer = json.loads(raw)
    except ValueError:
        raise EngineError(not_vllm(url, path, raw)) from None
    if not isinstance(answer, dict):
        raise EngineError(not_vllm(url, path, raw))
    return answer


def probe(url: str, timeout_s: float, extension: bool) -> None:
    """Ask the engine at ``url`` once: reachable, vLLM of a version we speak, and (``extension``) our worker
    extension installed; an ``EngineError`` naming the first thing wrong."""
    from .vllm_api import api_for
    from .vllm_fused_load import missing_extension

    url = url.rstrip("/")
    version = _call(url, "/version", None, timeout_s).get("version")
    if version is None:
        raise EngineError(f"{url}/version answered JSON without a 'version': not a vLLM server?")
    api_for(str(version), f"served at {url}")
    if not extension:
        return
    try:
        out = _call(url, "/collective_rpc", {"method": "install_fused_expert_load"}, timeout_s)
    except EngineError as e:
        if "HTTP " not in str(e):
            raise
        raise EngineError(missing_extension(url, str(e))) from None
    if not out.get("results"):
        raise EngineError(f"vLLM at {url}: /collective_rpc install_fused_expert_load answered no worker")
