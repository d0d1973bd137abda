"""Metrics never take a job down: a failed TensorBoard write is reported once and training goes on.

A read-only or full events folder made torchtitan's ``TensorBoardLogger.log`` raise in the middle of
a step and lost everything since the last checkpoint. ``GuardedLogger`` wraps any torchtitan logger;
on the first ``OSError`` it logs one line naming the folder and the error, then drops every later
write (a logger that failed once keeps failing; retrying would log every step).
"""

from __future__ import annotations

import logging
from typing import Any

from torchtitan.components.metrics import BaseLogger

logger = logging.getLogger("titan_foremoe")


class GuardedLogger(BaseLogger):
    def __init__(self, inner: BaseLogger, where: str | None):
        self.inner, self.where, self.failed = inner, where, False

    @property
    def writer(self):
        """The TensorBoard writer (``log_heatmap`` writes images through ``add_image``), None once failed."""
        return None if self.failed else getattr(self.inner, "writer", None)

    def _guard(self, fn, *args) -> None:
        if self.failed:
            return
        try:
            fn(*args)
        except OSError as e:
            self.failed = True
            logger.error("metrics: writing TensorBoard events to %s failed (%s: %s); training goes on without "
                         "TensorBoard", self.where, type(e).__name__, e)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._guard(self.inner.log, metrics, step)

    def add_image(self, tag: str, img, step: int) -> None:
        if self.writer is not None:
            self._guard(self.inner.writer.add_image, tag, img, step)

    def close(self) -> None:
        self._guard(self.inner.close)
