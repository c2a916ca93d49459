"""How much of a file the page cache holds: Linux's ``cachestat`` (6.5+), one system call.

Restore asks before it reads a chunk: reading a cached file is CPU work (the kernel's
copy, then checksums), which runs fastest one chunk per core; reading from the disk
waits on it, and wants many reads in flight (``ckptflow.dcp.reader``). ``cachestat``
answers without reading or mapping anything, unlike ``mincore`` (a mapping) or an
``RWF_NOWAIT`` read (a copy). Where the kernel lacks it (older kernels, a seccomp
filter), the answer is "unknown" and the caller treats the file as on disk.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform

_CACHESTAT = 451  # the same number on every Linux architecture (new system calls share one table)
_UNSUPPORTED = (errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EINVAL, errno.EOPNOTSUPP)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


def _syscall() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if platform.system() != "Linux":
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_long
    return function


_call = _syscall()


def cached_bytes(fd: int) -> int | None:
    """Bytes of the file open as ``fd`` that are in the page cache (whole pages), or None
    where this kernel cannot say."""
    global _call
    if _call is None:
        return None
    whole, stat = _Range(0, 0), _Stat()  # a length of 0: to the end of the file
    if _call(ctypes.c_long(_CACHESTAT), ctypes.c_int(fd), ctypes.byref(whole), ctypes.byref(stat), ctypes.c_uint(0)):
        if ctypes.get_errno() in _UNSUPPORTED:
            _call = None  # not this kernel's, or not allowed: do not ask again
        return None
    return stat.nr_cache * mmap.PAGESIZE


def all_cached(fd: int) -> bool:
    """Whether every byte of the file open as ``fd`` is in the page cache (False where unknown)."""
    cached = cached_bytes(fd)
    return cached is not None and cached >= os.fstat(fd).st_size
