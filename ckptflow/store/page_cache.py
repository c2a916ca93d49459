"""How much of a file the page cache holds: Linux's ``cachestat`` (6.5+), else ``mincore``.

Restore asks before it reads a chunk: reading a cached file is CPU work (the kernel's
copy, then checksums), which runs fastest one chunk per core; reading from the disk
waits on it, and wants many reads in flight (``ckptflow.dcp.reader``). ``cachestat``
answers in one system call, without mapping or reading anything. Older kernels get
``mincore`` over a mapping of the file that is never touched (so no page is read, and a
file cut short meanwhile cannot raise ``SIGBUS``): three calls. Where neither works (not
Linux, a seccomp filter), the answer is "unknown" and the caller treats the file as on disk.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import platform
from collections.abc import Callable
from typing import Any

_CACHESTAT = 451  # the same number on every Linux architecture (new system calls share one table)
_UNSUPPORTED = (errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EOPNOTSUPP)
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


def _libc() -> Any:
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    libc.syscall.restype = ctypes.c_long
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


_libc_handle = _libc()


def cached_bytes(fd: int) -> int | None:
    """Bytes of the file open as ``fd`` that are in the page cache (whole pages), or None
    where this kernel cannot say."""
    for ask in tuple(_WAYS):
        answer = ask(fd)
        if answer is not None:
            return answer
        if ctypes.get_errno() not in _UNSUPPORTED:
            return None  # this file, this time (a file cut short, say): ask again next time
        with contextlib.suppress(ValueError):  # not this kernel's, or not allowed: never ask so again
            _WAYS.remove(ask)
    return None


def all_cached(fd: int) -> bool:
    """Whether every byte of the file open as ``fd`` is in the page cache (False where unknown)."""
    cached = cached_bytes(fd)
    return cached is not None and cached >= os.fstat(fd).st_size


def _cachestat(fd: int) -> int | None:
    whole, stat = _Range(0, 0), _Stat()  # a length of 0: to the end of the file
    if _libc_handle.syscall(
        ctypes.c_long(_CACHESTAT), ctypes.c_int(fd), ctypes.byref(whole), ctypes.byref(stat), ctypes.c_uint(0)
    ):
        return None
    return stat.nr_cache * mmap.PAGESIZE


def _mincore(fd: int) -> int | None:
    size = os.fstat(fd).st_size
    if not size:
        return 0
    address = _libc_handle.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, _MAP_FAILED):
        return None
    try:
        pages = -(-size // mmap.PAGESIZE)
        resident = ctypes.create_string_buffer(pages)
        if _libc_handle.mincore(address, size, resident):
            return None
        return resident.raw.translate(_RESIDENT_BIT).count(1) * mmap.PAGESIZE
    finally:
        _libc_handle.munmap(address, size)


_RESIDENT_BIT = bytes(i & 1 for i in range(256))  # mincore's answer is bit 0 of each page's byte
_WAYS: list[Callable[[int], int | None]] = [_cachestat, _mincore] if _libc_handle is not None else []
