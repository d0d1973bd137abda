"""Rows of a JSON-lines or Parquet file, streamed: the one reader of prompt files and engine outputs.

Each row comes with ``where`` (``FILE line N`` / ``FILE row I``) so the caller's
error names it; a line that is not a JSON object, or a Parquet file that cannot
be read, is a ``RecordError`` naming the same place.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


class RecordError(ValueError):
    """A line or file that is not a record; ``where`` and ``problem`` for the caller's own error."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where}: {problem}")
        self.where, self.problem = where, problem


def _array(path: Path) -> str:
    return (f"one JSON array, not JSON lines (one object per line): convert it with "
            f"jq -c '.[]' {path} > {path.with_suffix('')}.lines.jsonl")


def first_line(path: Path) -> int:
    """The index of the first non-blank line (where a JSON array saved as ``.jsonl`` starts)."""
    with open(path) as f:
        return next((i for i, line in enumerate(f) if line.strip()), 0)


def iter_records(path: str | Path) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` for every JSON line (blank lines skipped) or Parquet row of ``path``."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        i = 0
        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=256):  # streamed, not the whole table
                for rec in batch.to_pylist():
                    yield f"{path} row {i}", rec
                    i += 1
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise RecordError(str(path), f"cannot read Parquet ({e})") from None
        return
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            where = f"{path} line {i + 1}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if line.lstrip().startswith("[") and i == first_line(path):
                    raise RecordError(str(path), _array(path)) from None
                raise RecordError(where, f"invalid JSON ({e})") from None
            if isinstance(rec, list) and rec and all(isinstance(x, dict) for x in rec) and i == first_line(path):
                raise RecordError(str(path), _array(path))
            if not isinstance(rec, dict):
                raise RecordError(where, f"expected an object per line, got {type(rec).__name__}")
            yield where, rec
