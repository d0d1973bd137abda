"""The one error every engine module raises (its own module, so the engine modules need not import each other)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine is unreachable, died, or answered something we cannot use; names the URL."""


class EngineUnreachable(EngineError):
    """No answer at all (connection refused, timed out): not something the engine said."""
