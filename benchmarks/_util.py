"""Timing and file helpers for the benchmarks: clocks, fsync, disk usage, state copies."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from _states import StateDict


def now() -> float:
    return time.perf_counter()


def disk_usage(path: Path) -> int:
    """Bytes allocated on disk under ``path`` (like ``du``)."""
    if path.is_file():
        return path.stat().st_blocks * 512
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _malloc_trim() -> Callable[[], None]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return lambda: None
    return lambda: trim(0) and None


trim_heap = _malloc_trim()


def fresh(path: Path) -> Path:
    """An empty output directory, with the machine in the same state for every method."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    os.sync()  # no dirty pages from earlier work
    # Give freed memory back to the OS, so a method that allocates (a stager's host copy,
    # restore buffers) pays for fresh pages whichever method happened to run before it.
    gc.collect()
    trim_heap()
    return path


def drop_page_cache(path: Path) -> None:
    """Evict the files under ``path`` from the page cache, so the next read comes from the
    disk, as a restore on another node (or after a reboot) does. No root needed: the files'
    dirty pages are written back first (``sync``), and ``POSIX_FADV_DONTNEED`` then drops the
    clean ones of each file (what ``echo 1 > /proc/sys/vm/drop_caches`` does for all)."""
    os.sync()
    files = [path] if path.is_file() else [Path(d) / f for d, _dirs, names in os.walk(path) for f in names]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def copy_into(target: StateDict, loaded: StateDict) -> None:
    """What ``load_state_dict`` does after torch.load / load_file: copy into live tensors."""
    for name, tensor in target.items():
        tensor.copy_(loaded[name])


def check_equal(expected: StateDict, actual: StateDict, method: str) -> None:
    if expected.keys() != actual.keys():
        raise AssertionError(f"{method}: restored keys differ")
    for name, tensor in expected.items():
        if not torch.equal(tensor, actual[name]):
            raise AssertionError(f"{method}: tensor {name!r} restored with different values")


def clear(target: StateDict) -> None:
    for tensor in target.values():
        tensor.zero_()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Clock:
    """Wall and process-CPU time since ``start()``."""

    def start(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def lap(self) -> float:
        return time.perf_counter() - self.wall

    def cpu_used(self) -> float:
        return time.process_time() - self.cpu


class PeakRss:
    """The peak resident memory of this process inside a ``with`` block, beyond its RSS
    when the block began (``bytes``; None where /proc cannot reset the peak: not Linux)."""

    def __enter__(self) -> PeakRss:
        self.bytes: int | None = None
        self._before = _status_bytes("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
        except OSError:
            self._before = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._before is not None:
            peak = _status_bytes("VmHWM")
            self.bytes = None if peak is None else max(0, peak - self._before)


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
