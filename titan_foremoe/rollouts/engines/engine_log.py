"""The root cause of an engine start failure (vLLM or SGLang), as one line of its log.

A refused vLLM start ends its log with wrappers ("Engine core initialization failed. See root cause above.") after
three tracebacks (worker, engine core, API server); the worker's own exception line, the first one after the first
error, says why. Records below ``ERROR`` are never read as the cause: every vLLM 0.28 start with
``--skip-tokenizer-init`` logs a whole traceback at ``WARNING`` (its chat-template warmup: ``ValueError: Tokenizer
not available``), and a ulimit hint quotes ``OSError: [Errno 24]``.
"""

from __future__ import annotations

import os
import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# "(Worker pid=12) " then "ERROR 11-25 16:11:14 [core.py:1346] ": vLLM's process tag and record header
_PROCESS = re.compile(r"^\(\w[\w ]*pid=\d+\)\s?")
_RECORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:.]+ \[[^\]]*\]\s?")
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::(?:\s.*)?)?$")
_ERRORISH = re.compile(r"error|exception|fail", re.IGNORECASE)
_MAX = 400


def _strip(line: str) -> tuple[str, str]:
    """The line without colour codes, process tag and record header, and the record's level ("" for a raw line:
    a traceback printed to stderr)."""
    text = _PROCESS.sub("", _ANSI.sub("", line.rstrip("\n")))
    m = _RECORD.match(text)
    return (text[m.end():].strip(), m.group(1)) if m else (text.strip(), "")


def root_cause(path: str | None, offset: int = 0) -> str:
    """The first exception line after the first error of the log written from ``offset`` on (an engine log is
    appended to across restarts); else its first line that mentions an error; else ``last log line: ...``;
    empty when the log is missing or empty."""
    if not path or not os.path.isfile(path):
        return ""
    with open(path, errors="replace") as f:
        f.seek(offset)
        lines = [_strip(line) for line in f]
    start = next((i for i, (text, level) in enumerate(lines) if level in ("ERROR", "CRITICAL")
                  or not level and text.startswith("Traceback (most recent call last)")), 0)
    texts = [text for text, level in lines[start:] if text and level not in ("DEBUG", "INFO", "WARNING")]
    last = next((text for text, _ in reversed(lines) if text), "")
    at = next((i for i, t in enumerate(texts) if _EXCEPTION.match(t)), None)
    line = texts[at] if at is not None else None
    if line is not None and line.endswith(":") and at + 1 < len(texts):  # its message on the next line (SGLang's
        line = f"{line} {texts[at + 1]}"                                  # sgl_kernel: "ImportError: \n[...] ...")
    line = (line or next((t for t in texts if _ERRORISH.search(t)), None)
            or (f"last log line: {last}" if last else ""))
    return line if len(line) <= _MAX else line[:_MAX] + " ..."
