"""Power cuts, simulated: record the disk calls of the real local backend, then rebuild
what a disk would hold if power failed after any one of them.

``RecordingDisk`` performs every call for real (so the code under test runs as usual)
and logs it. ``durable_after`` replays a prefix of the log on a model that keeps only
what was made durable: a file's data once the file was fsynced, a directory's entries
once the directory was fsynced (a new directory is durable in its parent once the
parent was). Data never fsynced comes back as an empty file, entries never fsynced are
gone: the pessimistic reading POSIX allows, so the store is checked against the worst
disk it may meet.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ckptflow.store.disk import Disk


class RecordingDisk(Disk):
    def __init__(self) -> None:
        super().__init__(fsync=True)
        self.ops: list[tuple] = []
        self._lock = threading.Lock()

    def _log(self, *op) -> None:
        with self._lock:
            self.ops.append(op)

    def mkdir(self, path: str) -> None:
        super().mkdir(path)
        self._log("mkdir", path)

    def write_new(self, path, parts) -> None:
        super().write_new(path, parts)
        data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        self._log("create", path, data)  # a cut may fall between the write and its fsync
        self._log("fsync", path)

    def link(self, src: str, dst: str) -> None:
        super().link(src, dst)
        self._log("link", src, dst)

    def rename(self, src: str, dst: str) -> None:
        super().rename(src, dst)
        self._log("rename", src, dst)

    def unlink(self, path: str) -> None:
        super().unlink(path)
        self._log("unlink", path)

    def rmdir(self, path: str) -> None:
        super().rmdir(path)
        self._log("rmdir", path)

    def claim(self, path: str) -> None:
        super().claim(path)
        self._log("create", path, b"")

    def fsync_dir(self, path: str) -> None:
        super().fsync_dir(path)
        self._log("fsync_dir", path)


@dataclass
class _Model:
    """Directory entries as the page cache sees them (``live``) and as the disk holds them
    (``durable``); file contents likewise, per inode."""

    live: dict[str, dict[str, tuple[str, object]]] = field(default_factory=dict)
    durable: dict[str, dict[str, tuple[str, object]]] = field(default_factory=dict)
    data: dict[int, bytes] = field(default_factory=dict)
    synced: dict[int, bytes] = field(default_factory=dict)

    def entry(self, path: str) -> tuple[str, object]:
        return self.live[os.path.dirname(path)][os.path.basename(path)]

    def put(self, path: str, node: tuple[str, object]) -> None:
        self.live[os.path.dirname(path)][os.path.basename(path)] = node

    def drop(self, path: str) -> tuple[str, object]:
        return self.live[os.path.dirname(path)].pop(os.path.basename(path))


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) under ``root``, all durable, by absolute path."""
    return {str(p): None if p.is_dir() else p.read_bytes() for p in root.rglob("*") if not p.is_symlink()}


def durable_after(root: Path, initial: dict[str, bytes | None], ops: list[tuple], cut: int, target: Path) -> None:
    """Write into ``target`` what ``root`` holds on disk after a power cut following the
    first ``cut`` recorded operations, starting from ``initial`` (all durable)."""
    model = _Model()
    inode = 0

    def ensure_dir(path: str) -> None:
        if path in model.live:
            return
        parent = os.path.dirname(path)
        ensure_dir(parent)
        model.live[parent][os.path.basename(path)] = ("dir", path)
        model.durable[parent][os.path.basename(path)] = ("dir", path)
        model.live[path], model.durable[path] = {}, {}

    model.live[str(root)], model.durable[str(root)] = {}, {}
    model.live[os.path.dirname(str(root))] = {os.path.basename(str(root)): ("dir", str(root))}
    model.durable[os.path.dirname(str(root))] = dict(model.live[os.path.dirname(str(root))])
    for path, content in sorted(initial.items()):
        if content is None:
            ensure_dir(path)
            continue
        ensure_dir(os.path.dirname(path))
        inode += 1
        model.data[inode] = model.synced[inode] = content
        model.put(path, ("file", inode))
        model.durable[os.path.dirname(path)][os.path.basename(path)] = ("file", inode)
    for op in ops[:cut]:
        kind, path = op[0], op[1]
        if kind == "mkdir":
            model.put(path, ("dir", path))
            model.live[path], model.durable[path] = {}, {}
        elif kind == "create":
            inode += 1
            model.data[inode] = op[2]
            model.put(path, ("file", inode))
        elif kind == "fsync":
            node = model.entry(path)
            model.synced[node[1]] = model.data[node[1]]  # type: ignore[index]
        elif kind == "link":
            model.put(op[2], model.entry(path))
        elif kind == "rename":
            model.put(op[2], model.drop(path))
        elif kind in ("unlink", "rmdir"):
            model.drop(path)
        elif kind == "fsync_dir":
            model.durable[path] = dict(model.live[path])
    _materialize(model, str(root), target)


def _materialize(model: _Model, directory: str, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name, (kind, ref) in model.durable.get(directory, {}).items():
        if kind == "dir":
            _materialize(model, str(ref), target / name)
        else:
            (target / name).write_bytes(model.synced.get(ref, b""))  # type: ignore[arg-type]
