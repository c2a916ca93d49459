"""What ``Checkpointer.save`` returns: the result of a save, or the handle of one in flight."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from ckptflow.catalog.checkpoints import CheckpointInfo
from ckptflow.dcp.failures import own_errors
from ckptflow.dcp.writer import CheckpointWriter
from ckptflow.format.manifest import Manifest


@dataclass(frozen=True)
class SaveResult:
    step: int
    kind: str
    info: CheckpointInfo | None  # on the coordinator rank; None elsewhere


class SaveHandle:
    """An async save in flight. ``wait()`` returns its ``SaveResult`` or raises its error."""

    def __init__(self, future: Future, writer: CheckpointWriter, blocked_s: float):
        self._future, self._writer = future, writer
        self.step, self.kind = writer.spec.step, writer.spec.kind
        self.blocked_s = blocked_s  # how long the caller was held (host copy, and any wait for the previous save)
        self.error_reported = False

    def done(self) -> bool:
        """Whether the save has finished (committed or failed): ``wait()`` would not block."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        try:
            with own_errors():
                self._future.result(timeout)
        except BaseException:
            if self._future.done():  # the save's own failure (not a wait timeout): reported now,
                self.error_reported = True  # so Checkpointer.wait() must not raise it again
            raise
        manifest = self.manifest
        return SaveResult(
            step=self.step, kind=self.kind, info=CheckpointInfo.from_manifest(manifest) if manifest else None
        )

    @property
    def writer(self) -> CheckpointWriter:
        """The save's writer: what it found in each chunk region, for the next save."""
        return self._writer

    @property
    def manifest(self) -> Manifest | None:
        """What the save committed (on the coordinator rank, once it has)."""
        return self._writer.manifest
