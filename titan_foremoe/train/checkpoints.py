"""torchtitan's DCP checkpointer, with checkpoints as an atomic, linear history.

- **Atomic.** A save writes ``step-N.saving/`` (DCP's shards, ``.metadata``, our side files), every rank hashes
  the files it wrote (``config/checksums.py``), rank 0 records them and renames the folder to ``step-N``
  after a barrier: a ``step-N`` folder is complete or absent, whatever point a crash hits (a leftover
  ``step-N.saving`` is never loaded and is cleared by the next save of that step). torchtitan saves in place,
  so a crash during the save of a step that already existed left old ``.metadata`` over new shards.
- **Linear.** A resume from an older step (``--checkpoint.load_step`` below the newest) sets the newer steps
  aside (``step-M.abandoned-<time>``) before its first save, in one line: they are another history, and a later
  plain resume must not take them over the new branch.
- **One rule for "the latest complete step"**: ``preflight.latest_complete_step``, for torchtitan's load as for
  the pre-flight and the launcher.

Cost: two barriers and one gather of ~100 bytes per rank per save, the hashing (``checksums.py``), one
``rename`` (atomic on POSIX file systems; on NFS / Lustre a directory rename is atomic on the server).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time

from torchtitan.components.checkpointer import CheckpointManager

from ..config import checksums
from ..config.preflight import latest_complete_step
from ..distributed import collectives

logger = logging.getLogger("titan_foremoe")

STAGING_SUFFIX = ".saving"


def set_aside(path: str, why: str = "abandoned") -> str:
    """Rename ``path`` to ``<path>.<why>-<time>`` (a free name); returns the new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    new, n = f"{path}.{why}-{stamp}", 1
    while os.path.exists(new):
        n += 1
        new = f"{path}.{why}-{stamp}-{n}"
    os.rename(path, new)
    return new


def newer_steps(folder: str, step: int) -> list[int]:
    """The ``step-M`` folders (complete or not) with M > ``step``."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(folder)
                  if (m := re.fullmatch(r"step-(\d+)", name)) and int(m.group(1)) > step)


def abandon_newer(folder: str, step: int) -> list[str]:
    """Set every ``step-M`` with M > ``step`` aside; the new names."""
    return [set_aside(os.path.join(folder, f"step-{m}")) for m in newer_steps(folder, step)]


class AtomicCheckpointManager(CheckpointManager):
    """``CheckpointManager`` saving through ``step-N.saving`` (``begin`` / ``commit`` around torchtitan's ``save``)."""

    def __init__(self, *args, rank: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rank = rank
        self._staging: int | None = None

    def step_folder(self, step: int) -> str:
        """Where ``step``'s files go: its staging folder while it is being saved, else ``step-N``."""
        final = os.path.join(self.folder, f"step-{step}")
        return final + STAGING_SUFFIX if self._staging == step else final

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        if not folder and step == self._staging:
            return self.step_folder(step)
        return super()._create_checkpoint_id(step, folder)

    def _find_load_step(self, folder: str = "") -> int:
        return latest_complete_step(folder or self.folder)

    def _purge_stale_checkpoints(self) -> None:
        """Called by torchtitan inside ``save``, before the step is committed: ``commit`` purges instead."""

    def begin(self, step: int) -> None:
        """Start the save of ``step`` (every rank): rank 0 clears a staging folder a crash left, then all wait."""
        if self.rank == 0:
            staging = os.path.join(self.folder, f"step-{step}{STAGING_SUFFIX}")
            if os.path.isdir(staging):
                shutil.rmtree(staging)
            os.makedirs(staging)
        collectives.barrier()
        self._staging = step

    def commit(self, step: int) -> str:
        """Finish the save of ``step`` (every rank): hash, record, rename into place; returns ``step-N``."""
        staging = self.step_folder(step)
        mine = checksums.records(staging, checksums.owned_files(staging, self.rank))
        every = collectives.all_gather_objects(mine)
        final = os.path.join(self.folder, f"step-{step}")
        if self.rank == 0:
            checksums.write_checksums(staging, {k: v for part in every for k, v in part.items()})
            if os.path.exists(final):  # an incomplete folder from an older version, or another history
                logger.warning("checkpoint: %s already existed; set aside as %s", final, set_aside(final))
            os.rename(staging, final)
            _fsync_dir(self.folder)
            self._purge()
        self._staging = None
        collectives.barrier()
        return final

    def abort(self) -> None:
        """A save that raised: forget its staging folder (left on disk, never loaded, cleared by the next save)."""
        self._staging = None

    def _purge(self) -> None:
        """Keep the newest ``keep_latest_k`` complete steps (torchtitan's rule, on ``step-N`` folders only)."""
        if self.keep_latest_k <= 0 or self.purge_thread is None:
            return
        steps = sorted(int(m.group(1)) for name in os.listdir(self.folder)
                       if (m := re.fullmatch(r"step-(\d+)", name)))
        for step in steps[: -self.keep_latest_k]:
            self.purge_queue.put(os.path.join(self.folder, f"step-{step}"))


def _fsync_dir(path: str) -> None:
    """Make a rename durable (a crash of the host right after it would otherwise lose it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
