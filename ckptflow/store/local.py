"""Local filesystem backend: plain paths and ``file://`` URLs.

Durability follows the classic recipe: write a hidden temp file in the target
directory, fsync it, then ``link`` (create-only) or ``rename`` (replace) it into
place and fsync the directory, so a crash at any instant leaves either the old state
or the complete new object, never a torn file.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from stat import S_ISDIR

from ckptflow.errors import ObjectNotFoundError, StoreNotFoundError
from ckptflow.store.base import Buffers, ObjectInfo, Store, as_buffers, validate_key

TEMP_PREFIX = ".tmp-"


class LocalStore(Store):
    cheap_reread = True  # the page cache

    def __init__(self, root: str, *, fsync: bool = True, create: bool = True):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = "file://" + self.root
        self.fsync = fsync
        if create:
            os.makedirs(self.root, exist_ok=True)
        elif not os.path.isdir(self.root):
            raise StoreNotFoundError(f"store root {self.root} does not exist or is not a directory; check the path")

    def _path(self, key: str) -> str:
        path = os.path.join(self.root, *validate_key(key).split("/"))
        if os.path.commonpath([self.root, path]) != self.root:  # defence in depth
            raise ValueError(f"key {key!r} resolves outside {self.root}")
        return path

    def _write_temp(self, directory: str, data: Buffers) -> str:
        tmp = os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        for attempt in range(3):
            os.makedirs(directory, exist_ok=True)
            try:
                f = open(tmp, "wb")
                break
            except FileNotFoundError:  # a concurrent delete pruned the empty directory
                if attempt == 2:
                    raise
        with f:
            for part in as_buffers(data):
                f.write(part)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        return tmp

    def _fsync_dir(self, directory: str) -> None:
        if not self.fsync:
            return
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None

    def read_head(self, key: str, size: int) -> bytes:
        try:
            with open(self._path(key), "rb", buffering=0) as f:
                return f.read(size)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None

    def get_into(self, key: str, buffers: Sequence[bytearray | memoryview]) -> tuple[int, tuple]:
        """Scatter-read the object into ``buffers`` (in order): (its size, its version).

        The buffers are filled only when the object's size equals their total size;
        otherwise they are left alone and the caller falls back to ``get``. The version
        (device, inode, size, mtime) names the file actually read: an atomic replace or
        an in-place write changes it, so a caller can tell whether a re-read returns
        the bytes it verified before.
        """
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None
        try:
            st = os.fstat(fd)
            version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            views = [memoryview(b).cast("B") for b in buffers]
            views = [v for v in views if len(v)]
            if st.st_size != sum(len(v) for v in views):
                return st.st_size, version
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

    def scan(self, key: str, buffer: memoryview, consume: Callable[[memoryview], None]) -> tuple[int, tuple]:
        """Stream the object through ``buffer`` piece by piece into ``consume``: (size, version).

        For verifying without keeping the bytes: a small reused buffer stays in the CPU
        cache while it is hashed, and nothing the size of the object is allocated.
        """
        try:
            f = open(self._path(key), "rb", buffering=0)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None
        with f:
            st = os.fstat(f.fileno())
            size = 0
            while n := f.readinto(buffer):
                consume(buffer[:n])
                size += n
        return size, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def put_if_absent(self, key: str, data: Buffers) -> bool:
        path = self._path(key)
        if os.path.exists(path):
            return False
        directory = os.path.dirname(path)
        tmp = self._write_temp(directory, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as e:  # filesystems without hard links: O_EXCL claim, then rename
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            return self._claim_and_rename(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._fsync_dir(directory)
        return True

    def _claim_and_rename(self, tmp: str, path: str) -> bool:
        try:
            os.close(os.open(path + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        try:
            if os.path.exists(path):
                return False
            os.rename(tmp, path)
        finally:
            os.unlink(path + ".claim")
        self._fsync_dir(os.path.dirname(path))
        return True

    def replace(self, key: str, data: Buffers) -> None:
        path = self._path(key)
        directory = os.path.dirname(path)
        tmp = self._write_temp(directory, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        self._fsync_dir(directory)

    def list(self, prefix: str, *, recursive: bool = True) -> Iterator[ObjectInfo]:
        base = self.root if not prefix else self._path(prefix.rstrip("/"))
        if not os.path.isdir(base):
            return
        yield from self._scan(base, prefix.rstrip("/"), recursive)

    def _scan(self, directory: str, key_prefix: str, recursive: bool) -> Iterator[ObjectInfo]:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.name.startswith("."):
                continue
            key = f"{key_prefix}/{entry.name}" if key_prefix else entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    if recursive:
                        yield from self._scan(entry.path, key, True)
                    else:
                        yield ObjectInfo(key + "/", 0, entry.stat().st_mtime)
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat()
                    yield ObjectInfo(key, st.st_size, st.st_mtime)
            except FileNotFoundError:  # deleted while listing
                continue

    def delete(self, key: str) -> None:
        """Remove the file, then the directories it leaves empty (up to the root), so a
        deleted checkpoint's step directory does not linger as an empty candidate."""
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        parent = os.path.dirname(path)
        while parent != self.root:
            try:
                os.rmdir(parent)
            except OSError:  # not empty (or already gone): stop
                break
            parent = os.path.dirname(parent)

    def stat(self, key: str) -> ObjectInfo:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None
        if S_ISDIR(st.st_mode):
            raise ObjectNotFoundError(f"{self.url}/{key} is a directory, not an object")
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def touch(self, key: str) -> None:
        try:
            os.utime(self._path(key))
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None

    def stale_temp_files(self, older_than: float) -> Iterator[ObjectInfo]:
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(TEMP_PREFIX) or name.endswith(".claim"):
                    path = os.path.join(dirpath, name)
                    try:
                        st = os.stat(path)
                    except FileNotFoundError:
                        continue
                    if st.st_mtime < older_than:
                        yield ObjectInfo(os.path.relpath(path, self.root), st.st_size, st.st_mtime)

    def delete_temp(self, name: str) -> None:
        path = os.path.abspath(os.path.join(self.root, name))
        if os.path.commonpath([self.root, path]) == self.root:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
