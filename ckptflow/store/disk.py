"""Every call the local backend makes that changes what is on disk, and nothing else.

Durability is a matter of the order of these calls: write a temp file, fsync it, link or
rename it into place, fsync the directory, and make every directory a new object needs
durable in its own parent first. Keeping them in one small class lets a crash test swap
in a recorder that replays any prefix of a save or a GC sweep the way a power cut would
leave the disk (tests/support/crashfs.py), so the order is checked, not assumed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable


class Disk:
    def __init__(self, *, fsync: bool = True):
        self.fsync = fsync

    def makedirs(self, path: str, *, sync_dir: Callable[[str], None] | None = None) -> None:
        """Create ``path`` and its missing parents, each fsynced into its parent (by
        ``sync_dir``, where the caller defers such fsyncs), so a file made durable in
        ``path`` cannot vanish with a directory entry that was not."""
        missing = []
        while not os.path.isdir(path):
            missing.append(path)
            path = os.path.dirname(path)
        for directory in reversed(missing):
            try:
                self.mkdir(directory)
            except FileExistsError:  # a concurrent writer made it
                pass
            (sync_dir or self.fsync_dir)(os.path.dirname(directory))

    def mkdir(self, path: str) -> None:
        os.mkdir(path)

    def write_new(self, path: str, parts: Iterable[bytes | memoryview]) -> None:
        """Create ``path`` (it must not exist) with ``parts``, flushed and fsynced. ``parts``
        may be a generator: each part is made only when the one before is written."""
        with open(path, "xb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def claim(self, path: str) -> None:
        """Create an empty file exclusively (``FileExistsError`` if it exists)."""
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))

    def fsync_dir(self, path: str) -> None:
        if not self.fsync:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def touch(self, path: str) -> None:
        os.utime(path)
