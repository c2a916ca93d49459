"""Dropping a file from the page cache, so that a test can tell a read from memory from a read from the disk."""

from __future__ import annotations

import os


def evict(path: str) -> None:
    """Drop ``path``'s pages from the page cache (written back first, so they can be dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
