"""Durable file writes for ``LocalStore``, and the batches that defer their directory fsyncs.

Split from ``ckptflow.store.local`` so the crash-safety recipe is one unit, apart from
key paths, reads and listing: write a hidden temp file in the target directory, fsync
it, then ``link`` (create-only) or ``rename`` (replace) it into place and fsync the
directory, so a crash at any instant leaves either the old state or the complete new
object, never a torn file. A write that fails removes its temp file.

Within a ``batch`` (a save's chunk writes) the directory fsyncs of chunk directories are
deferred to the batch's end, once per directory instead of once per object, and each
directory below the root is checked for a link once instead of at every path (the
store's path resolution asks ``known_real`` and tells ``note_real``); what a batch wrote
is durable when the batch ends, which is before the save writes its rank record or commits.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

from ckptflow.store.base import Buffers, as_buffers
from ckptflow.store.disk import Disk

TEMP_PREFIX = ".tmp-"
T = TypeVar("T")
PRUNED_RETRIES = 200  # a write whose directory a concurrent delete keeps pruning makes it again, this often
PRUNED_BACKOFF_S = 0.002  # the longest pause before making it again: a random pause in [0, this)
CLAIM_SUFFIX = ".claim"
# a claim lives for one look and one rename: one this old was left by a writer that died, whatever GC's grace
CLAIM_STALE_S = 60.0


def retrying_pruned(make: Callable[[], T]) -> T:
    """``make()``, made again while a concurrent delete keeps pruning a directory it needs
    (a delete removes the directories it leaves empty), up to ``PRUNED_RETRIES`` times.

    From the second retry on, each waits a random pause first: writers and deleters that
    churn one directory in step (threads handing the GIL over at each system call) would
    otherwise meet in the same window again and again; the pause puts them out of step."""
    for attempt in range(PRUNED_RETRIES):
        try:
            return make()
        except FileNotFoundError:
            if attempt == PRUNED_RETRIES - 1:
                raise
            if attempt:
                time.sleep(random.uniform(0, PRUNED_BACKOFF_S))
    raise AssertionError("unreachable")


class DurableWriter:
    """Puts files into place durably through ``disk`` (``ckptflow.store.disk``); the
    directory fsyncs of ``chunk_dirs`` (a prefix: that directory and what is below it)
    wait for the end of the batch in progress."""

    def __init__(self, disk: Disk, chunk_dirs: str):
        self.disk = disk
        self._batch_lock = threading.Lock()
        self._batches = 0  # batches open now (``batch``)
        self._unsynced: set[str] = set()  # directories whose fsync a batch deferred
        self._real_dirs: set[str] = set()  # directories a batch found not to be links
        self._chunk_dirs = chunk_dirs

    def known_real(self, path: str) -> bool:
        """Whether the batch in progress already found ``path`` to be a directory, not a link."""
        return path in self._real_dirs

    def note_real(self, path: str) -> None:
        """``path`` is a directory, not a link: remembered while a batch is open."""
        if self._batches:
            self._real_dirs.add(path)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Writes whose directory fsyncs wait until the batch ends (see the module's
        docstring); batches may overlap, and each one's end makes every deferred
        directory durable before it returns."""
        with self._batch_lock:
            self._batches += 1
        try:
            yield
        except BaseException:
            with contextlib.suppress(OSError):  # the batch's own failure is the one to report
                self._end_batch()
            raise
        self._end_batch()

    def _end_batch(self) -> None:
        with self._batch_lock:
            self._batches -= 1
            directories, self._unsynced = self._unsynced, set()
            if not self._batches:
                self._real_dirs.clear()
        for directory in sorted(directories):
            self.disk.fsync_dir(directory)

    def sync_dir(self, directory: str) -> None:
        """Fsync ``directory`` now, or, for a directory of chunks, at the end of the batch
        in progress: chunks are named by a commit only after the batch that wrote them
        ended, while anything else written meanwhile (a commit, a lease) must be durable
        when its write returns."""
        if not self.deferred(directory):
            self.disk.fsync_dir(directory)

    def deferred(self, directory: str) -> bool:
        """Whether ``directory``, a directory of chunks, is fsynced at the end of the batch
        in progress. A chunk a batch finds already there is one it will name in a commit
        too: another process's batch may have written it and not yet fsynced its
        directory, so ``put_new`` defers that directory's fsync to this batch's end."""
        if not self._batches or not (directory == self._chunk_dirs or directory.startswith(self._chunk_dirs + os.sep)):
            return False
        with self._batch_lock:
            if self._batches:
                self._unsynced.add(directory)
                return True
        return False

    def write_temp(self, directory: str, data: Buffers) -> str:
        tmp = os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}")

        def write() -> str:
            self.disk.makedirs(directory, sync_dir=self.sync_dir)
            self.disk.write_new(tmp, as_buffers(data))
            return tmp

        try:
            return retrying_pruned(write)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                self.disk.unlink(tmp)
            raise

    def put_new(self, path: str, data: Buffers) -> bool:
        """Write ``data`` as the file ``path`` unless that exists (create-only), durably."""
        if os.path.exists(path):
            self.deferred(os.path.dirname(path))
            return False
        tmp = self.write_temp(os.path.dirname(path), data)
        try:
            return self.link_new(tmp, path)
        finally:
            if os.path.exists(tmp):
                self.disk.unlink(tmp)

    def link_new(self, tmp: str, path: str) -> bool:
        """Give the file ``tmp`` the name ``path`` unless that exists (create-only), durably."""
        try:
            self.disk.link(tmp, path)
        except FileExistsError:
            self.deferred(os.path.dirname(path))
            return False
        except OSError as e:  # filesystems without hard links: O_EXCL claim, then rename
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            return self._claim_and_rename(tmp, path)
        self.sync_dir(os.path.dirname(path))
        return True

    def _claim_and_rename(self, tmp: str, path: str) -> bool:
        """Create-only without hard links: an ``O_EXCL`` claim beside ``path`` admits one
        writer to look and rename. Once renamed, the object is in place: a claim gone
        meanwhile (a GC judged it stale: ``CLAIM_STALE_S``) fails nothing."""
        claim = path + CLAIM_SUFFIX
        try:
            self.disk.claim(claim)
        except FileExistsError:
            return False
        try:
            if os.path.exists(path):
                return False
            self.disk.rename(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.disk.unlink(claim)
        self.sync_dir(os.path.dirname(path))
        return True

    def replace_file(self, path: str, data: Buffers) -> None:
        """Write ``data`` as the file ``path``, replacing it atomically, durably."""
        directory = os.path.dirname(path)
        tmp = self.write_temp(directory, data)
        try:
            self.disk.rename(tmp, path)
        except BaseException:
            self.disk.unlink(tmp)
            raise
        self.sync_dir(directory)
