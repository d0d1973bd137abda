"""A checkpoint's file checksums: written with each save, verified by the pre-flight before a resume.

``step-N/checksums.json`` maps every file a resume reads (DCP's ``.metadata`` and ``*.distcp`` shards, the side
files: ``model_facts.json``, ``in_flight_rollouts/*``) to its size, its SHA-256 and the SHA-256 of ``SAMPLES``
blocks of ``SAMPLE_BYTES`` spread over it (the first and the last included). Each rank hashes the shard files it
wrote (``__R_*.distcp``, ``in_flight_rollouts/rankRRRR.pkl``), rank 0 the rest; HF exports (``hf/``,
``*.safetensors``) are not read by a resume and not hashed.

Cost at Qwen3-30B-A3B (61 GB of model + AdamW + KL reference): a save re-reads what each rank just wrote (page
cache) at SHA-256's ~1.4 GB/s per core (SHA-NI, measured on this machine): 0.95 GB, ~0.7 s per rank on 64 ranks,
60 MB / 0.05 s on 1024. The pre-flight's ``verify = "sample"`` reads ``SAMPLES x SAMPLE_BYTES`` (1 MiB) per file
plus sizes: 64 MiB on 64 ranks, 1 GiB on 1024 (~1 s); it finds a zeroed, truncated or replaced shard, not a flipped
byte between samples (``verify = "full"`` streams all 61 GB: ~45 s at 1.4 GB/s on one core, or the disk's rate).
A load that fails anyway is diagnosed by a full check of the step it read (``first_mismatch``).
"""

from __future__ import annotations

import hashlib
import json
import os

CHECKSUMS_FILE = "checksums.json"
SAMPLES = 4
SAMPLE_BYTES = 256 << 10
_CHUNK = 8 << 20
_NOT_HASHED = ("hf", CHECKSUMS_FILE)


def sample_offsets(size: int) -> list[int]:
    """Start of each sampled block: ``SAMPLES`` blocks evenly spread from the first to the last."""
    if size <= SAMPLES * SAMPLE_BYTES:
        return [0]
    last = size - SAMPLE_BYTES
    return [round(i * last / (SAMPLES - 1)) for i in range(SAMPLES)]


def _sampled(f, size: int) -> str:
    h = hashlib.sha256()
    if size <= SAMPLES * SAMPLE_BYTES:
        f.seek(0)
        h.update(f.read())
        return h.hexdigest()
    for offset in sample_offsets(size):
        f.seek(offset)
        h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def file_record(path: str) -> dict:
    """Size, SHA-256 and sampled SHA-256 of one file (one streaming read)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        size = f.tell()
        return {"size": size, "sha256": h.hexdigest(), "sampled": _sampled(f, size)}


def owned_files(folder: str, rank: int) -> list[str]:
    """The files of a step folder that ``rank`` wrote and hashes (relative paths); rank 0 also takes every
    file no rank claims. One ``listdir`` of the folder per rank per save."""
    names = sorted(os.listdir(folder))
    mine = [n for n in names if n.startswith(f"__{rank}_")]
    side = os.path.join("in_flight_rollouts", f"rank{rank:04d}.pkl")
    if os.path.isfile(os.path.join(folder, side)):
        mine.append(side)
    if rank == 0:
        mine += [n for n in names if not n.startswith("__") and n not in _NOT_HASHED and not n.endswith(".safetensors")
                 and os.path.isfile(os.path.join(folder, n))]
        flights = os.path.join(folder, "in_flight_rollouts")
        if os.path.isdir(flights):  # a rank's own rows are claimed by it; anything else here by rank 0
            mine += [os.path.join("in_flight_rollouts", n) for n in sorted(os.listdir(flights))
                     if not n.startswith("rank") and os.path.isfile(os.path.join(flights, n))]
    return mine


def records(folder: str, names: list[str]) -> dict[str, dict]:
    return {name: file_record(os.path.join(folder, name)) for name in names}


def write_checksums(folder: str, files: dict[str, dict]) -> None:
    tmp = os.path.join(folder, CHECKSUMS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"version": 1, "algorithm": "sha256", "samples": SAMPLES, "sample_bytes": SAMPLE_BYTES,
                   "files": dict(sorted(files.items()))}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, CHECKSUMS_FILE))


def first_mismatch(folder: str, full: bool = False) -> str | None:
    """The first file of a step folder that does not match its recorded checksum, in words (None: all match,
    or no ``checksums.json``: saved before checksums were kept). ``full``: hash whole files, else samples."""
    try:
        with open(os.path.join(folder, CHECKSUMS_FILE)) as f:
            saved = json.load(f)["files"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"cannot read {os.path.join(folder, CHECKSUMS_FILE)} ({type(e).__name__})"
    for name, want in saved.items():
        path = os.path.join(folder, name)
        try:
            size = os.path.getsize(path)
            if size != want["size"]:
                return f"{path} has {size} bytes, {want['size']} were saved"
            if full:
                got = file_record(path)["sha256"]
                key = "sha256"
            else:
                with open(path, "rb") as f:
                    got = _sampled(f, size)
                key = "sampled"
        except OSError as e:
            return f"{path} cannot be read ({e.strerror or e})"
        if got != want[key]:
            return f"{path} does not match its saved checksum (changed or corrupted after the save)"
    return None
