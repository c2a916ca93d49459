"""How much of a file the page cache holds: Linux's ``cachestat`` (6.5+), else ``mincore``.

Restore asks before it reads a chunk: reading a cached file is CPU work (the kernel's
copy, then checksums), which runs fastest one chunk per core; reading from the disk
waits on it, and wants many reads in flight (``ckptflow.dcp.reader``). ``cachestat``
answers in one system call, without mapping or reading anything. Older kernels get
``mincore`` over a mapping of the file that is never touched (so no page is read, and a
file cut short meanwhile cannot raise ``SIGBUS``): three calls. Both answer only for a
file the process owns or may write (Linux keeps other users' page cache private:
``cachestat`` refuses, ``mincore`` reports every page resident), so for any other file,
and where neither works (not Linux, a seccomp filter), the answer is "unknown" and the
caller treats the file as on disk.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import stat
from collections.abc import Callable
from typing import Any

# cachestat's number in the table most architectures share; Alpha and MIPS number it apart
_CACHESTAT = None if platform.machine().lower().startswith(("alpha", "mips")) else 451
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
_UNASKED: Any = object()
_way: Any = _UNASKED  # how this process asks: ``_cachestat``, ``_mincore`` or None (chosen on first use)


def cached_bytes(fd: int) -> int | None:
    """Bytes of the file open as ``fd`` that are in the page cache (whole pages), or None
    where this process cannot know (another user's file, a kernel that cannot say)."""
    global _way
    if _way is _UNASKED:
        _way = _choose()
    return None if _way is None else _way(fd)


def all_cached(fd: int) -> bool:
    """Whether ``fd`` is a regular file whose every byte is in the page cache (False where unknown)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return False
    cached = cached_bytes(fd)
    return cached is not None and cached >= st.st_size


def _choose() -> Callable[[int], int | None] | None:
    """The first way that answers for a file of this process's own (a memfd): so a kernel
    or filter refusing ``cachestat`` is told apart from a file this process may not ask about."""
    if _libc_handle is None or not hasattr(os, "memfd_create"):
        return None
    try:
        probe = os.memfd_create("ckptflow-page-cache-probe")
    except OSError:
        return None
    try:
        os.write(probe, b"\0")
        for way in (_cachestat, _mincore):
            if way(probe) is not None:
                return way
        return None
    finally:
        os.close(probe)


def _cachestat(fd: int) -> int | None:
    if _CACHESTAT is None:
        return None
    whole, counts = _Range(0, 0), _Stat()  # a length of 0: to the end of the file
    if _libc_handle.syscall(
        ctypes.c_long(_CACHESTAT), ctypes.c_int(fd), ctypes.byref(whole), ctypes.byref(counts), ctypes.c_uint(0)
    ):
        return None
    return counts.nr_cache * mmap.PAGESIZE


def _mincore(fd: int) -> int | None:
    st = os.fstat(fd)
    if not _answers_for(fd, st):
        return None
    if not st.st_size:
        return 0
    address = _libc_handle.mmap(None, st.st_size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, _MAP_FAILED):
        return None
    try:
        resident = ctypes.create_string_buffer(-(-st.st_size // mmap.PAGESIZE))
        if _libc_handle.mincore(address, st.st_size, resident):
            return None
        return resident.raw.translate(_RESIDENT_BIT).count(1) * mmap.PAGESIZE
    finally:
        _libc_handle.munmap(address, st.st_size)


def _answers_for(fd: int, st: os.stat_result) -> bool:
    """Whether ``mincore`` tells this process the truth about the file: it owns it, may
    write it, or is root; for any other file it reports every page resident."""
    euid = os.geteuid()
    if euid == 0 or st.st_uid == euid:
        return True
    try:
        return os.access(f"/proc/self/fd/{fd}", os.W_OK, effective_ids=os.access in os.supports_effective_ids)
    except OSError:
        return False


_RESIDENT_BIT = bytes(i & 1 for i in range(256))  # mincore's answer is bit 0 of each page's byte
