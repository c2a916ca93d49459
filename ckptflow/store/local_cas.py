"""Conditional writes of ``LocalStore``: ``locked``, ``get_versioned``, ``replace_if`` and
``delete_if``, split from ``ckptflow.store.local``.

A lock file per key (``.<name>.lock`` beside it, hidden: never listed) serializes the
writers of that key, threads and processes alike; an object's version is the sha256 of
its bytes. ``LocalCompareAndSwap`` is ``LocalStore``'s base: it uses the store's path
resolution (``_path``, which refuses links), its disk and its durable writer.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import time
import uuid
from abc import abstractmethod
from collections.abc import Collection, Iterator
from typing import BinaryIO

from ckptflow.errors import ObjectNotFoundError, StoreError
from ckptflow.store.base import Buffers, SettledDeletes, Store
from ckptflow.store.disk import Disk
from ckptflow.store.local_writes import DurableWriter, retrying_pruned

log = logging.getLogger("ckptflow")


class LocalCompareAndSwap(Store):
    """Compare-and-swap over a local filesystem: a lock file per key; the content's sha256
    is its version."""

    compare_and_swap = True
    locks_exclude = True
    root: str
    disk: Disk
    _writer: DurableWriter

    @abstractmethod
    def _path(self, key: str) -> str:
        """The file of ``key`` (``LocalStore._path``)."""

    @contextlib.contextmanager
    def _flock(self, path: str) -> Iterator[None]:
        """An exclusive ``flock`` on ``.<name>.lock`` beside ``path`` (hidden: never listed),
        held per open file, so threads and processes both queue on it; the kernel drops it
        when its holder dies, so a killed holder never blocks anyone."""
        directory = os.path.dirname(path)

        def open_lock() -> BinaryIO:
            self.disk.makedirs(directory)
            return open(os.path.join(directory, f".{os.path.basename(path)}.lock"), "ab")

        with retrying_pruned(open_lock) as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
            yield

    @contextlib.contextmanager
    def locked(self, name: str) -> Iterator[None]:
        with self._flock(self._path(name)):
            yield

    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str]:
        data = self.get_bounded(key, limit)
        return data, hashlib.sha256(data).hexdigest()

    def version_and_size(self, key: str) -> tuple[str, int]:
        try:
            return _sha256_and_size(self._path(key))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None

    def replace_if(self, key: str, data: Buffers, expected: str | None) -> bool:
        """Check and replace under the key's lock (``_flock``); the replace itself is the
        usual temp file + rename. A version is the sha256 of the bytes, so an object
        rewritten with identical bytes still matches (same state)."""
        path = self._path(key)
        with self._flock(path):
            try:
                current: str | None = _sha256_file(path)
            except FileNotFoundError:
                current = None
            if current != expected:
                return False
            self.replace(key, data)
            return True

    def delete_if(self, key: str, expected: str) -> bool:
        """Compare, then take the file aside with one rename (which takes exactly one file
        whatever other writers do) and compare what was taken: the expected version is
        deleted; another (deleted and created again since the check) is linked back,
        create-only. So no new object is ever deleted in the old one's place, and one that
        differs at the check stays in place (taken aside, readers would miss it a moment).

        The aside name says which version was to go (``_aside_name``), never a temp file's:
        a process killed between the rename and the link back leaves the other version
        there, which ``settle_interrupted_deletes`` puts back and GC never sweeps."""
        path = self._path(key)
        aside = os.path.join(os.path.dirname(path), _aside_name(os.path.basename(path), expected))
        try:
            if _sha256_file(path) != expected:
                return False
            self.disk.rename(path, aside)
        except (FileNotFoundError, NotADirectoryError):
            return False
        matches = _sha256_file(aside) == expected
        if not matches and not self._writer.link_new(aside, path):
            raise StoreError(
                f"{self.url}/{key} was replaced while it was being deleted and then created a third time at once; "
                f"the version taken is kept in {aside}: compare the two and keep the right one"
            )
        if os.path.exists(aside):
            self.disk.unlink(aside)
        return matches

    def settle_interrupted_deletes(self, *, locks: Collection[str] = (), dry_run: bool = False) -> SettledDeletes:
        """See ``Store.settle_interrupted_deletes``. Only files taken aside at least
        ``ASIDE_SETTLED_S`` ago (their ctime: the rename) are settled: a younger one may be a
        live ``delete_if``'s, between its rename and its compare, and is left ``pending``;
        a young lock is left too, yet not ``pending``: it is never put back, so it hides no
        commit and need stop no GC. A lock's holder renews it every few seconds
        (``leases.HEARTBEAT``), far less than that, so it has found its lock gone and given
        it up: the lock goes, never back (the GC that settles holds its own: the aside was
        kept, and warned of, at every GC).
        Chunks are never deleted conditionally, so their directory is not walked."""
        settled = SettledDeletes()
        for dirpath, dirs, files in os.walk(self.root):
            if dirpath == self.root and "chunks" in dirs:
                dirs.remove("chunks")
            for name in files:
                found = _ASIDE.fullmatch(name)
                if found is None:
                    continue
                aside = os.path.join(dirpath, name)
                original = os.path.join(dirpath, found["name"])
                key = os.path.relpath(original, self.root).replace(os.sep, "/")
                try:
                    if time.time() - os.stat(aside).st_ctime < ASIDE_SETTLED_S:
                        if key not in locks:  # a lock is left for a later settle: it holds no data
                            settled.pending.append(key)
                        continue
                    if (
                        key not in locks
                        and _sha256_file(aside) != found["version"]
                        and not _linked_back(aside, original)
                    ):
                        if dry_run:
                            if not os.path.lexists(original):
                                settled.restored.append(key)
                            continue
                        if not self._writer.link_new(aside, original):  # not the version to delete: it goes back
                            log.warning(
                                "%s/%s was taken aside by a delete that was killed, and created again since; the "
                                "version taken is kept in %s: compare the two",
                                self.url, key, aside,
                            )  # fmt: skip
                            continue
                        settled.restored.append(key)
                    if not dry_run:
                        self.disk.unlink(aside)
                except FileNotFoundError:  # settled meanwhile
                    continue
        return settled


ASIDE_SETTLED_S = 60.0  # a live delete_if holds a file aside for a compare: microseconds
_ASIDE = re.compile(r"\.(?P<name>.+)\.aside-(?P<version>[0-9a-f]{64})-[0-9a-f]{32}")


def _linked_back(aside: str, original: str) -> bool:
    """Whether ``original`` is the very file taken ``aside``: the delete was killed after its
    link back, before it removed the aside name."""
    try:
        return os.path.samefile(aside, original)
    except FileNotFoundError:
        return False


def _aside_name(name: str, expected: str) -> str:
    """Hidden (never listed) and never a temp file's name (GC sweeps those): the name, the
    version to delete, and a unique tail (two deletes of one key never share it)."""
    return f".{name}.aside-{expected}-{uuid.uuid4().hex}"


def _sha256_file(path: str) -> str:
    return _sha256_and_size(path)[0]


def _sha256_and_size(path: str) -> tuple[str, int]:
    """The sha256 and length of one read of the file: both of the same version."""
    digest, size = hashlib.sha256(), 0
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:  # a FIFO reads empty, never blocks
        while block := f.read(1 << 20):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size
