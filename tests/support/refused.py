"""Paths the test process may not write, for the tests of what a refused write tells the user.

Run as root here, which permissions do not stop: a directory is made immutable (``chattr +i``)
and a read-only file system is a read-only tmpfs. Where that cannot be done (not root, no
CAP_LINUX_IMMUTABLE or CAP_SYS_ADMIN in a container, ``chattr`` or ``mount`` not installed,
a file system without the flag) the test skips and says why; whatever was done is undone,
however the test ends, so pytest can remove its temporary directory."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _tried(command: list[str]) -> bool:
    """Whether ``command`` ran and succeeded (False if its program is not installed)."""
    try:
        return subprocess.run(command, capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def unwritable(path: Path) -> Iterator[None]:
    """``path`` (a directory) refused to this process's writes: immutable for root, else 0555."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    if not _tried(["chattr", "+i", str(path)]):
        pytest.skip("chattr +i is not available here: root cannot be denied a write otherwise")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@contextlib.contextmanager
def read_only_tmpfs(where: Path) -> Iterator[Path]:
    """``where`` (an empty directory) with a read-only tmpfs mounted on it."""
    if not _tried(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)]):
        pytest.skip("cannot mount a read-only tmpfs here (needs root and the mount program)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
