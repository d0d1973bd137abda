"""Engine output files: JSON lines or Parquet rows (streamed), one record each."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ..sample import RolloutError


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
