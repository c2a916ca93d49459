"""Which pages of the saved tensors were written since the previous save, as the kernel saw it.

To find what changed, an incremental save reads and hashes every byte of the state
(``CheckpointWriter``). For a frozen backbone or a LoRA fine-tune that is ~100x the bytes
that changed. Linux (6.7+) can say instead: a save write-protects each tracked tensor's
pages with userfaultfd in asynchronous mode (``UFFD_FEATURE_WP_ASYNC``: no handler
thread; the kernel itself lifts the protection of a page on its first write and marks it
written) and the next save reads which pages were written and protects them again, in one
``PAGEMAP_SCAN`` ioctl of ``/proc/self/pagemap`` per span. A write by any thread through
any alias (``.data``, a view, another tensor or a numpy array sharing the storage, a
``read()`` into it, ``process_vm_writev``) goes through this process's page tables and is
seen; a page that was unmapped, freed to the kernel, swapped out or never populated since is
not "present and unwritten", so it counts as changed. A region whose pages all stayed
unwritten holds the bytes its previous save hashed, and that save's chunk is reused
without reading them.

What this process's page tables do not see, and so is never vouched for: file mappings
and shared memory (tensors memory-mapped from a file by torch, safetensors or ``np.memmap``,
``share_memory_()``: another process or a rewrite of the file changes them; only anonymous
pages count as clean), memory a device writes by DMA (pinned tensors are left out; memory
pinned for RDMA by other means cannot be told apart: pass ``track_writes=False``).
Every full save still reads every byte, and if one finds a region changed that this
module said was not, tracking is switched off for the process with a warning.

Cost, measured on this machine (1 GiB of fp32): protecting or scanning 1 GiB ~3-7 ms; the
first write to each protected page after a save takes a minor fault, ~0.11 s per GiB
written (once per save interval, not per step), which a tensor written all over between
saves stops paying: it is left unprotected for the next ``REST_SAVES`` saves.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import logging
import mmap
import os
import platform
import sys
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import xxhash

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
MIN_TRACKED_BYTES = 64 << 10  # smaller tensors are hashed: cheap, and they share pages with Python objects

_USERFAULTFD = {"x86_64": 323, "aarch64": 282}  # syscall numbers
_USER_MODE_ONLY = 1  # open flag: usable without privileges; asynchronous write faults are resolved anyway
_API = 0xAA
_FEATURES = (1 << 13) | (1 << 15)  # UFFD_FEATURE_WP_UNPOPULATED | UFFD_FEATURE_WP_ASYNC
_REGISTER_MODE_WP = 1 << 1
_WP_MATCHING, _CHECK_WPASYNC = 1 << 0, 1 << 1  # PAGEMAP_SCAN flags
_WRITTEN, _PRESENT = 1 << 1, 1 << 3  # PAGEMAP_SCAN page categories
_REGIONS = 64  # page regions one PAGEMAP_SCAN call reports; it is called again from where it stopped
REST_SAVES = 8  # saves a span found mostly written is left unprotected for (no faults), then watched again


def _iowr(kind: int, number: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | number


_UFFDIO_API = _iowr(0xAA, 0x3F, 24)
_UFFDIO_REGISTER = _iowr(0xAA, 0x00, 32)
_UFFDIO_WRITEPROTECT = _iowr(0xAA, 0x06, 24)
_PAGEMAP_SCAN = _iowr(ord("f"), 16, 96)

Span = tuple[int, int]  # [start, end) addresses


def tracked_span(tensor: torch.Tensor) -> Span | None:
    """The page-aligned memory of ``tensor`` a save may track: a contiguous CPU tensor of
    at least ``MIN_TRACKED_BYTES``, neither pinned nor shared (a save reads any other
    through a copy, or a device or another process may write it without our page tables)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.nbytes < MIN_TRACKED_BYTES:
        return None
    if tensor.is_sparse or tensor.is_pinned() or tensor.is_shared():
        return None
    start = tensor.data_ptr()
    return start - start % PAGE, -(-(start + tensor.nbytes) // PAGE) * PAGE


@dataclass(frozen=True)
class Snapshot:
    """What one save's scan found: ``clean`` (sorted, disjoint spans) were not written
    since snapshot ``since`` protected them; ``covered`` are protected from now on, so
    what this save reads there (its ``epoch``) the next snapshot can vouch for."""

    epoch: int
    since: int
    clean: tuple[Span, ...]
    covered: tuple[Span, ...]

    def unwritten(self, piece: memoryview, address: int, edges: str) -> bool:
        """Whether ``piece`` (at ``address``) holds what it held when the snapshot
        ``since`` protected it, and its edge bytes hashed ``edges``: none of its pages was
        written since, except perhaps its first and last, which it may share with other
        memory (malloc's bookkeeping, a neighbouring tensor or region): those bytes of
        ``piece`` are compared by hash."""
        first, last = _page(address), _page(address + len(piece) - 1)
        unclean = _gaps(self.clean, first, last + PAGE)
        if not unclean:
            return True
        written = (page for start, end in unclean for page in range(start, min(end, start + 3 * PAGE), PAGE))
        if any(page not in (first, last) for page in written):
            return False
        return edge_checksum(piece, address) == edges

    def covers(self, address: int, length: int) -> bool:
        """Whether the pages of [address, address + length) are protected from now on, but
        for its first and last: those ``unwritten`` compares by hash when they are not."""
        return not _gaps(self.covered, _page(address) + PAGE, _page(address + max(length, 1) - 1))


def edge_checksum(piece: memoryview, address: int) -> str:
    """xxh3-128 of the bytes of ``piece`` (at ``address``) in its first and last page."""
    head = min(len(piece), _page(address) + PAGE - address)
    tail = max(head, _page(address + len(piece) - 1) - address)
    hasher = xxhash.xxh3_128(piece[:head])
    hasher.update(piece[tail:])
    return hasher.hexdigest()


def _page(address: int) -> int:
    return address - address % PAGE


def _gaps(spans: tuple[Span, ...], start: int, end: int) -> list[Span]:
    """The parts of [start, end) outside ``spans`` (sorted, disjoint)."""
    gaps: list[Span] = []
    at = start
    for span_start, span_end in spans[max(0, bisect.bisect_right(spans, (start, sys.maxsize)) - 1) :]:
        if span_start >= end:
            break
        if span_start > at:
            gaps.append((at, span_start))
        at = max(at, span_end)
        if at >= end:
            break
    if at < end:
        gaps.append((at, end))
    return gaps


class WriteTracker:
    """One userfaultfd (and ``/proc/self/pagemap``) of this process, for one Checkpointer."""

    def __init__(self, uffd: int, pagemap: int):
        self._fds = (uffd, pagemap)
        self._epoch = 0
        self._watched: set[Span] = set()  # spans the previous snapshot left protected
        self._pid = os.getpid()  # /proc/self/pagemap, opened here, stays this process's after a fork
        self._resting: dict[Span, int] = {}  # span -> snapshots it is still left out of
        self._lock = threading.Lock()
        self._closed = weakref.finalize(self, _close_fds, self._fds)

    @classmethod
    def open(cls) -> WriteTracker | None:
        """A tracker, or None where this kernel cannot track writes (not Linux 6.7+ on
        x86_64/aarch64, userfaultfd disallowed, e.g. by a container's seccomp profile):
        saves then hash every byte, as without one."""
        number = _USERFAULTFD.get(platform.machine())
        if sys.platform != "linux" or number is None:
            return None
        libc = _libc()
        uffd = libc.syscall(number, os.O_CLOEXEC | os.O_NONBLOCK | _USER_MODE_ONLY)
        if uffd < 0:
            log.info("no write tracking for incremental saves: userfaultfd: %s", os.strerror(ctypes.get_errno()))
            return None
        api = (ctypes.c_uint64 * 3)(_API, _FEATURES, 0)
        if libc.ioctl(uffd, _UFFDIO_API, api) < 0 or api[1] & _FEATURES != _FEATURES:
            log.info("no write tracking for incremental saves: this kernel has no asynchronous write protection")
            os.close(uffd)
            return None
        try:
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            log.info("no write tracking for incremental saves: /proc/self/pagemap: %s", e.strerror)
            os.close(uffd)
            return None
        tracker = cls(uffd, pagemap)
        # PAGEMAP_SCAN exists (Linux 6.7+): asked of one private page of our own
        probe = mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = ctypes.c_char.from_buffer(probe)
        span = (ctypes.addressof(view), ctypes.addressof(view) + PAGE)
        works = tracker._register(span) and tracker._scan(span) is not None
        del view
        probe.close()
        if not works:
            log.info("no write tracking for incremental saves: this kernel has no PAGEMAP_SCAN")
            tracker.close()
            return None
        return tracker

    @property
    def closed(self) -> bool:
        return not self._closed.alive

    def close(self) -> None:
        """Stop tracking: closing the userfaultfd lifts every protection it set."""
        with self._lock:
            self._closed()

    def distrust(self, why: str) -> None:
        log.warning("incremental saves stop trusting page write tracking and hash every byte: %s", why)
        self.close()

    def snapshot(self, spans: Iterable[Span]) -> Snapshot | None:
        """Read which pages of ``spans`` (one per tensor) were written since the previous
        snapshot and protect all of them again, before the save reads any (a write after
        this is seen by the next snapshot). None once closed.

        A tensor's span found mostly written (a tensor trained every interval) is left
        unprotected for the next ``REST_SAVES`` snapshots instead: protecting it would cost
        the training loop a fault per page per interval, ~0.11 s per GiB, for nothing, since
        its regions are read anyway. Then it is watched again (a layer frozen later is
        skipped again)."""
        with self._lock:
            if self.closed or os.getpid() != self._pid:
                return None
            resting: dict[Span, int] = {}
            active: list[Span] = []
            for span in set(spans):
                left = self._resting.get(span, 0)
                if left > 1:
                    resting[span] = left - 1
                else:
                    active.append(span)
            clean: list[Span] = []
            scanned: list[Span] = []
            private = _private_anonymous()
            for span in _merged(active):
                if _gaps(private, *span):
                    continue  # file mappings, shared memory: see the module's docstring
                # registered every time: a span unmapped and mapped again since is registered
                # anew, and memory another tracker holds is refused (EBUSY). Scanned once only:
                # a scan that fails midway has protected what it walked, so a second one would
                # call written pages clean
                found = self._scan(span) if self._register(span) else None
                if found is not None:
                    clean.extend(found)  # vouched for now, whether protected from here on or not
                    scanned.append(span)
            vouched, protected = tuple(clean), tuple(scanned)
            rested = [
                span
                for span in active
                if span in self._watched
                and 2 * _clean_bytes(vouched, *span) < span[1] - span[0]
                and self._unprotect(span)
            ]
            resting.update(dict.fromkeys(rested, REST_SAVES))
            self._watched = {s for s in active if s not in resting and not _gaps(protected, *s)}
            self._resting = resting
            covered = _minus(protected, rested)
            self._epoch += 1
            return Snapshot(self._epoch, self._epoch - 1, vouched, covered)

    def _unprotect(self, span: Span) -> bool:
        protect = (ctypes.c_uint64 * 3)(span[0], span[1] - span[0], 0)
        return _libc().ioctl(self._fds[0], _UFFDIO_WRITEPROTECT, protect) == 0

    def _register(self, span: Span) -> bool:
        """Register ``span`` for write protection (again: a no-op where it already is)."""
        register = (ctypes.c_uint64 * 4)(span[0], span[1] - span[0], _REGISTER_MODE_WP, 0)
        return _libc().ioctl(self._fds[0], _UFFDIO_REGISTER, register) == 0

    def _scan(self, span: Span) -> list[Span] | None:
        """The spans of pages of ``span`` (private anonymous memory) present and unwritten
        since they were last protected, protecting every page of it; None if any of it is
        not tracked. A page not present is never clean (unmapped, dropped, swapped out or
        never populated since: a swapped-out page costs one read more)."""
        regions = (ctypes.c_uint64 * (3 * _REGIONS))()
        unclean: list[Span] = []
        at, end = span
        while at < end:
            # only pages written or not present are reported and protected (again): a clean
            # page is left as it is
            arg = (ctypes.c_uint64 * 12)(
                96, _WP_MATCHING | _CHECK_WPASYNC, at, end, 0, ctypes.addressof(regions), _REGIONS,
                0, _PRESENT, 0, _WRITTEN | _PRESENT, 0,
            )  # fmt: skip
            count = _libc().ioctl(self._fds[1], _PAGEMAP_SCAN, arg)
            if count < 0 or arg[4] <= at:
                return None
            unclean.extend((regions[3 * i], regions[3 * i + 1]) for i in range(count))
            at = arg[4]  # where the walk ended: the report was full
        return _gaps(tuple(unclean), *span)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _private_anonymous() -> tuple[Span, ...]:
    """This process's private anonymous memory (``/proc/self/maps``), merged.

    Only such memory is tracked. A page of a file mapping or of shared memory (shmem, memfd)
    shows what the file holds, which another process, a ``pwrite`` or a rewrite of the file
    changes without a write through these page tables, and where the kernel drops one that
    was protected it leaves a marker the scan reports like a swapped-out page (the kernel
    registers such memory too). Asking this of each page instead (``PAGE_IS_FILE``) makes
    the scan 5x slower: 18 ms a GiB here against 3.5."""
    spans: list[Span] = []
    with open("/proc/self/maps", "rb") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or fields[1][3:4] != b"p" or fields[4] != b"0":
                continue  # shared, or backed by a file (inode)
            name = fields[5].strip() if len(fields) == 6 else b""
            if name and not name.startswith((b"[heap]", b"[anon:")):
                continue  # the stack, vdso, vvar
            start, end = fields[0].split(b"-")
            spans.append((int(start, 16), int(end, 16)))
    return tuple(_merged(spans))


def _clean_bytes(clean: tuple[Span, ...], start: int, end: int) -> int:
    return (end - start) - sum(gap_end - gap_start for gap_start, gap_end in _gaps(clean, start, end))


def _minus(spans: tuple[Span, ...], holes: Iterable[Span]) -> tuple[Span, ...]:
    """``spans`` (sorted, disjoint) without the bytes of ``holes``."""
    merged = tuple(_merged(holes))
    return tuple(gap for start, end in spans for gap in _gaps(merged, start, end))


def _merged(spans: Iterable[Span]) -> list[Span]:
    """Overlapping or touching spans as one: each page is scanned once per snapshot (a
    second scan of a page would find it just protected by the first, and call it clean)."""
    merged: list[Span] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _close_fds(fds: tuple[int, int]) -> None:
    for fd in fds:
        os.close(fd)
