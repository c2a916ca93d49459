"""Local filesystem backend: plain paths and ``file://`` URLs.

Durability follows the classic recipe (temp file, fsync, link or rename, directory
fsync), so a crash at any instant leaves either the old state or the complete new
object, never a torn file; within a ``batch`` (a save's chunk writes) the directory
fsyncs are deferred to the batch's end. Both are ``DurableWriter``'s
(``ckptflow.store.local_writes``). A full disk says which object and how many bytes it
needed. The conditional writes (``locked``, ``get_versioned``, ``replace_if``,
``delete_if``: a lock file per key, the sha256 of the bytes as the version) are
``LocalCompareAndSwap``'s, the base class (``ckptflow.store.local_cas``).

Symbolic links below the root are never followed, for any operation: listing skips
nothing and reading follows nothing, so GC (which lists) and restore (which reads)
can never disagree about what a store holds, and a save can never write through a
link out of the root. A link is reported as ``SymlinkError`` naming it; the root
itself may be a link (it is resolved once, when the store is opened).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable, Iterator, Sequence
from stat import S_ISDIR, S_ISLNK, S_ISREG

from ckptflow.errors import (
    InvalidNameError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreFullError,
    StoreNotFoundError,
    SymlinkError,
)
from ckptflow.store import page_cache
from ckptflow.store.base import Buffers, ObjectInfo, as_buffers, validate_key
from ckptflow.store.disk import Disk
from ckptflow.store.local_cas import LocalCompareAndSwap
from ckptflow.store.local_writes import CLAIM_STALE_S, CLAIM_SUFFIX, TEMP_PREFIX, DurableWriter

READ_PIECE = 256 << 10  # ``get_into`` with a consumer: a piece is checked while it is in L2


def _info(key: str, st: os.stat_result) -> ObjectInfo:
    """A file's ``ObjectInfo``. Its version is what no write can keep: a replace makes a new
    inode, and writing in place or setting the times back moves the change time."""
    return ObjectInfo(key, st.st_size, st.st_mtime, f"{st.st_dev}:{st.st_ino}:{st.st_ctime_ns}")


def resolved_root(root: str) -> str:
    """The directory a local store given as ``root`` is: ``~`` expanded and every symbolic
    link resolved, once, when the store is opened. One rule, so whatever judges a path to be
    in the store (the CLI's error texts) judges it as the store's own paths are."""
    return os.path.realpath(os.path.expanduser(root))


class LocalStore(LocalCompareAndSwap):  # its conditional writes (compare_and_swap): ``local_cas``
    cheap_reread = True  # the page cache

    def __init__(self, root: str, *, fsync: bool = True, create: bool = True, disk: Disk | None = None):
        self.root = resolved_root(root)
        self.url = "file://" + self.root
        self.disk = disk or Disk(fsync=fsync)
        # durable writes; the fsyncs of ``chunks`` and the directories below it wait for a batch's end
        self._writer = DurableWriter(self.disk, os.path.join(self.root, "chunks"))
        if create:
            try:
                os.makedirs(self.root, exist_ok=True)
            except (FileExistsError, NotADirectoryError):
                raise StoreNotFoundError(
                    f"store root {self.root} (or a directory above it) is a file, not a directory; give the path of "
                    "a store directory (one is created if missing)"
                ) from None
        elif not os.path.isdir(self.root):
            raise StoreNotFoundError(f"store root {self.root} does not exist or is not a directory; check the path")

    def _path(self, key: str) -> str:
        """The file of ``key``, refusing a symbolic link at any level below the root."""
        path = self.root
        parts = validate_key(key).split("/")
        for depth, part in enumerate(parts, start=1):
            path = os.path.join(path, part)
            if depth < len(parts) and self._writer.known_real(path):
                continue
            try:
                mode = os.lstat(path).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return os.path.join(self.root, *key.split("/"))  # the rest does not exist yet
            if S_ISLNK(mode):
                raise self._link(os.path.relpath(path, self.root))
            if depth < len(parts) and S_ISDIR(mode):
                self._writer.note_real(path)
        return path

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """Writes whose directory fsyncs wait until the batch ends (``DurableWriter.batch``)."""
        return self._writer.batch()

    def _link(self, relpath: str) -> SymlinkError:
        return SymlinkError(
            f"{self.url}/{relpath} is a symbolic link; ckptflow never follows links inside a store (GC, which "
            "lists, and restore, which reads, would disagree about what the store holds): move the data into "
            f"the store, or make the whole store root ({self.root}) the link"
        )

    @contextlib.contextmanager
    def _writing(self, key: str, data: Buffers) -> Iterator[None]:
        """A full filesystem or quota, anywhere in a write, as ``StoreFullError`` naming the object."""
        try:
            yield
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            needed = sum(len(memoryview(p).cast("B")) for p in as_buffers(data))
            raise StoreFullError(
                f"no space left on the filesystem of {self.url} writing {key} ({needed} bytes): {e.strerror}; "
                "free space or move the store",
                needed=needed,
            ) from e

    def get(self, key: str) -> bytes:
        return self.get_bounded(key, None)

    def get_bounded(self, key: str, limit: int | None) -> bytes:
        fd, st = self._open(key)
        with os.fdopen(fd, "rb") as f:
            size = st.st_size
            if limit is not None and size > limit:
                raise ObjectTooLargeError(f"{self.url}/{key} holds {size} bytes, more than the {limit} expected")
            return f.read()

    def _open(self, key: str) -> tuple[int, os.stat_result]:
        """A read-only descriptor of the object ``key``, and its stat. Opened without
        blocking (a FIFO where an object belongs would wait for a writer forever), and only
        a regular file is an object: anything else there (a FIFO, a device, a directory) is none."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None
        st = os.fstat(fd)
        if S_ISREG(st.st_mode):
            return fd, st
        os.close(fd)
        raise ObjectNotFoundError(f"{self.url}/{key} is not a regular file (a FIFO, a device?): no object is there")

    def in_memory(self, key: str) -> bool:
        """Only a hint for scheduling a read, which checks the path (links, what is there)
        itself: so no ``_path`` lstat of every segment, a link at the end is not followed, a
        FIFO does not block, and whatever goes wrong answers False instead of raising."""
        try:
            path = os.path.join(self.root, *validate_key(key).split("/"))
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (OSError, InvalidNameError):
            return False
        try:
            return page_cache.all_cached(fd)
        except Exception:  # a hint that fails (an NFS error, no memory) is "on the disk": read it wide
            return False
        finally:
            os.close(fd)

    def read_head(self, key: str, size: int) -> bytes:
        with os.fdopen(self._open(key)[0], "rb", buffering=0) as f:
            return f.read(size)

    def get_into(
        self,
        key: str,
        buffers: Sequence[bytearray | memoryview],
        *,
        consume: Callable[[memoryview], None] | None = None,
        piece: int = READ_PIECE,
    ) -> tuple[int, tuple]:
        """Scatter-read the object into ``buffers`` (in order): (its size, its version).

        The buffers are filled only when the object's size equals their total size;
        otherwise they are left alone and the caller falls back to ``get``. The version
        (device, inode, size, mtime) names the file actually read: an atomic replace or
        an in-place write changes it, so a caller can tell whether a re-read returns
        the bytes it verified before. With ``consume``, the buffers are filled ``piece``
        bytes at a time and each piece is handed to it as soon as it lands, while it is
        still in the CPU cache: a check of what was read costs no second trip to memory.
        """
        fd, st = self._open(key)
        try:
            version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            views = [memoryview(b).cast("B") for b in buffers]
            views = [v for v in views if len(v)]
            if st.st_size != sum(len(v) for v in views):
                return st.st_size, version
            if consume is not None:
                return _read_pieces(fd, views, consume, max(1, piece)), version
            done = 0
            while views:
                n = os.readv(fd, views)
                if n == 0:  # truncated under us: report what was there
                    return done, version
                done += n
                while views and n >= len(views[0]):
                    n -= len(views.pop(0))
                if n:
                    views[0] = views[0][n:]
            return st.st_size, version
        finally:
            os.close(fd)

    def scan(
        self, key: str, buffer: memoryview, consume: Callable[[memoryview], None], *, limit: int | None = None
    ) -> tuple[int, tuple]:
        """Stream the object through ``buffer`` piece by piece into ``consume``: (size, version).

        For verifying without keeping the bytes: a small reused buffer stays in the CPU
        cache while it is hashed, and nothing the size of the object is allocated.
        """
        fd, st = self._open(key)
        with os.fdopen(fd, "rb", buffering=0) as f:
            if limit is not None and st.st_size > limit:
                raise ObjectTooLargeError(f"{self.url}/{key} holds {st.st_size} bytes, more than the {limit} expected")
            size = 0
            while n := f.readinto(buffer):
                consume(buffer[:n])
                size += n
        return size, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def put_if_absent(self, key: str, data: Buffers) -> bool:
        with self._writing(key, data):
            return self._writer.put_new(self._path(key), data)

    def replace(self, key: str, data: Buffers) -> None:
        with self._writing(key, data):
            self._writer.replace_file(self._path(key), data)

    def list(self, prefix: str, *, recursive: bool = True) -> Iterator[ObjectInfo]:
        base = self.root if not prefix else self._path(prefix.rstrip("/"))
        if not os.path.isdir(base):
            return
        yield from self._scan(base, prefix.rstrip("/"), recursive=recursive)

    def _scan(self, directory: str, key_prefix: str, *, recursive: bool) -> Iterator[ObjectInfo]:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.name.startswith("."):
                continue
            key = f"{key_prefix}/{entry.name}" if key_prefix else entry.name
            try:
                if entry.is_symlink():
                    if recursive:
                        raise self._link(key)  # what lies behind it would be invisible to GC
                    # one that points nowhere (its disk not mounted) may still hold a run's data: listed as a
                    # directory, so that what lists below it meets the link and refuses, as for a live one
                    folder = entry.is_dir() or not os.path.exists(entry.path)
                    yield ObjectInfo(key + "/" if folder else key, 0, entry.stat(follow_symlinks=False).st_mtime)
                elif entry.is_dir(follow_symlinks=False):
                    if recursive:
                        yield from self._scan(entry.path, key, recursive=True)
                    else:
                        yield ObjectInfo(key + "/", 0, entry.stat().st_mtime)
                elif entry.is_file(follow_symlinks=False):
                    yield _info(key, entry.stat())
            except FileNotFoundError:  # deleted while listing
                continue

    def delete(self, key: str) -> None:
        """Remove the file, then the directories it leaves empty (up to the root), so a
        deleted checkpoint's step directory does not linger as an empty candidate. Not
        fsynced: a power cut may bring a deleted object back, which loses nothing."""
        path = self._path(key)
        try:
            self.disk.unlink(path)
        except FileNotFoundError:
            pass
        self._prune(os.path.dirname(path))

    def _prune(self, directory: str) -> None:
        """Remove ``directory`` and the parents it leaves empty, up to the root."""
        while directory != self.root:
            try:
                self.disk.rmdir(directory)
            except OSError:  # not empty (or already gone): stop
                break
            directory = os.path.dirname(directory)

    def stat(self, key: str) -> ObjectInfo:
        try:
            st = os.lstat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None
        if not S_ISREG(st.st_mode):  # as reads (``_open``) and listings see it
            raise ObjectNotFoundError(f"{self.url}/{key} is not a regular file (a directory, a FIFO?): no object")
        return _info(key, st)

    def touch(self, key: str) -> None:
        try:
            self.disk.touch(self._path(key))
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None

    def stale_temp_files(self, older_than: float) -> Iterator[ObjectInfo]:
        """Temp files and claims, and empty directories (key ending in "/"): a writer killed
        between making a step's directory and writing its first file there leaves one, which
        every restore would skip as an uncommitted checkpoint. A claim younger than
        ``CLAIM_STALE_S`` is live whatever ``older_than`` says: taken from its writer, a second
        writer could claim the same key and both would rename, the second over the first."""
        claims_before = min(older_than, time.time() - CLAIM_STALE_S)
        for dirpath, dirs, files in os.walk(self.root):
            if not dirs and not files and dirpath != self.root:
                try:
                    mtime = os.stat(dirpath).st_mtime
                except FileNotFoundError:
                    continue
                if mtime < older_than:
                    yield ObjectInfo(os.path.relpath(dirpath, self.root) + "/", 0, mtime)
            for name in files:
                if name.startswith(TEMP_PREFIX) or name.endswith(CLAIM_SUFFIX):
                    path = os.path.join(dirpath, name)
                    try:
                        st = os.stat(path)
                    except FileNotFoundError:
                        continue
                    if st.st_mtime < (claims_before if name.endswith(CLAIM_SUFFIX) else older_than):
                        yield ObjectInfo(os.path.relpath(path, self.root), st.st_size, st.st_mtime)

    def delete_temp(self, name: str) -> None:
        """Remove a dead writer's temp file, and the directories it leaves empty, as ``delete``
        does: a step directory holding nothing but a killed commit's temp file would otherwise
        stay behind empty, and every restore would skip it as an uncommitted checkpoint."""
        path = os.path.abspath(os.path.join(self.root, name))
        if os.path.commonpath([self.root, path]) != self.root:
            return
        if name.endswith("/"):  # an empty directory: removed unless a writer filled it meanwhile
            self._prune(path)
            return
        try:
            self.disk.unlink(path)
        except FileNotFoundError:
            pass
        self._prune(os.path.dirname(path))


def _read_pieces(fd: int, views: list[memoryview], consume: Callable[[memoryview], None], piece: int) -> int:
    """Fill ``views`` from ``fd`` (from offset 0) ``piece`` bytes at a time, handing each
    piece to ``consume`` once it is whole; the bytes read (short: the file was truncated)."""
    done = 0
    for view in views:
        for start in range(0, len(view), piece):
            part = view[start : start + piece]
            got = 0
            while got < len(part):
                n = os.preadv(fd, [part[got:]], done + got)
                if n == 0:  # truncated under us: report what was there
                    return done + got
                got += n
            consume(part)
            done += got
    return done
