"""Engine files -> validated rollout directory (``python -m titan_foremoe.rollouts import``).

Samples are checked against the model (``validate_sample``) and kept in input
order, GRPO groups (samples of one prompt) contiguous. A bad sample is refused
with its position and field; with ``skip_bad`` its whole group is dropped and
counted instead (a group with a member missing would bias its advantages).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .formats import FORMATS, READERS, iter_records
from .sample import ModelSpec, RolloutError, RolloutSample, to_logical, validate_sample
from .store import RolloutWriter

logger = logging.getLogger("titan_foremoe")


@dataclass
class ImportReport:
    rows: int = 0
    groups: int = 0
    skipped_samples: int = 0
    skipped_groups: int = 0
    errors: list[str] = field(default_factory=list)
    """The first few errors skipped (``skip_bad``)."""


def import_rollouts(fmt: str, inputs: Iterable[str | Path], out_dir: str | Path, spec: ModelSpec, *,
                    skip_bad: bool = False, rows_per_shard: int = 4096,
                    expert_map_XP: np.ndarray | None = None) -> ImportReport:
    """``expert_map_XP``: logical expert of every physical slot per MoE layer, for routes an engine-side EPLB
    reported as physical ids (without it, such ids beyond ``num_experts`` are refused)."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {', '.join(FORMATS)}")
    inputs = [str(p) for p in inputs]
    out_dir = Path(out_dir)
    check_paths(inputs, out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    remove_stale_imports(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.importing-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        report = _import(fmt, inputs, tmp, spec, skip_bad, rows_per_shard, expert_map_XP)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        out_dir.rmdir()
    os.replace(tmp, out_dir)  # a rollout directory appears complete or not at all
    return report


def check_paths(inputs: list[str], out_dir: Path) -> None:
    """Every input a readable file and ``out_dir`` under a folder, before any work (one line, not a traceback)."""
    for path in inputs:
        if not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, "input not found", path)
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "input is a folder, expected an engine output file", path)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "--out exists and is a file", str(out_dir))
    parent = out_dir.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "--out is under a file, not a folder", str(parent))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_imports(out_dir: Path) -> None:
    """Remove ``.NAME.importing-PID`` folders whose import process is gone (killed imports left them)."""
    if not out_dir.parent.is_dir():
        return
    for tmp in out_dir.parent.glob(f".{out_dir.name}.importing-*"):
        pid = tmp.name.rsplit("-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            logger.info("rollouts import: removing %s, left by a killed import (pid %s)", tmp, pid)
            shutil.rmtree(tmp, ignore_errors=True)


def _import(fmt, inputs, out_dir, spec, skip_bad, rows_per_shard, expert_map_XP=None) -> ImportReport:
    writer = RolloutWriter(out_dir, spec, rows_per_shard, source={"format": fmt, "inputs": inputs})
    report = ImportReport()
    layers_topk = (spec.num_layers, spec.top_k)
    pending: list[tuple[str, RolloutSample]] = []
    pending_bad: list[str] = []
    seen: set[str] = set()
    current_key = None

    def flush():
        nonlocal pending, pending_bad
        if not pending and not pending_bad:
            return
        if pending_bad:
            report.skipped_samples += len(pending) + len(pending_bad)
            report.skipped_groups += 1
        else:
            for _, s in pending:  # the importer decides where groups begin: one id per group it keeps
                writer.add(s, report.groups)
            report.rows += len(pending)
            report.groups += 1
        pending, pending_bad = [], []

    def fail(err: RolloutError):
        if not skip_bad:
            raise err
        if len(report.errors) < 20:
            report.errors.append(str(err))
        pending_bad.append(err.where)

    for path in inputs:
        for where, rec in iter_records(path):
            try:
                try:
                    samples = READERS[fmt](rec, where, layers_topk)
                except RolloutError:
                    raise
                except (KeyError, TypeError, ValueError, IndexError) as e:  # a record of the wrong shape
                    raise RolloutError(where, "record", f"not a {fmt} record ({type(e).__name__}: {e})") from None
            except RolloutError as e:
                flush()  # a record we cannot parse is its own group
                fail(e)
                flush()
                continue
            for j, s in enumerate(samples):
                w = f"{where} completion {j}" if len(samples) > 1 else where
                key = s.group if s.group is not None else "prompt:" + s.tokens_T[: max(s.prompt_len, 0)].tobytes().hex()
                if key != current_key:
                    flush()
                    if s.group is not None and key in seen:
                        raise RolloutError(w, "group", f"group {s.group!r} appears again after other groups: "
                                           "samples of one prompt must be contiguous")
                    seen.add(key)
                    current_key = key
                try:
                    if expert_map_XP is not None:
                        s.routes_RXK = to_logical(s.routes_RXK, expert_map_XP, w)
                    validate_sample(s, spec, w)
                except RolloutError as e:
                    fail(e)
                    continue
                pending.append((w, s))
    flush()
    if report.rows == 0:
        raise RolloutError(", ".join(inputs), "rows", "no valid samples to import")
    writer.close(skipped_samples=report.skipped_samples, skipped_groups=report.skipped_groups)
    return report
