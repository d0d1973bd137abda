"""The one error every engine module raises, and the line for an answer that is not vLLM's (its own module, so
the engine modules need not import each other: ``vllm_fused_load``'s trainer side names such an answer too)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine is unreachable, died, or answered something we cannot use; names the URL."""


class EngineUnreachable(EngineError):
    """No answer at all (connection refused, timed out): not something the engine said."""


def not_vllm(url: str, path: str, raw: bytes) -> str:
    """An answer that is not vLLM's JSON, in words with its first characters."""
    head = raw[:80].decode(errors="replace").strip().replace("\n", " ")
    kind = "an HTML page" if head.lower().startswith(("<!doctype", "<html")) else "not JSON"
    return (f"{url}{path} answered {kind} ({head!r}...), not a vLLM answer: is {url} a vLLM server's address "
            "(http://HOST:PORT, no path)?")
