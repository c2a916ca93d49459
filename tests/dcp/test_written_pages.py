"""The kernel's record of written pages (userfaultfd asynchronous write protection read by
PAGEMAP_SCAN) vouches for a region only where no write of any kind reached it: these
tests write each way a training process can, and free, drop or share the memory."""

import ctypes
import mmap
import os
import resource

import pytest
import torch

from ckptflow.dcp import written_pages
from ckptflow.dcp.written_pages import PAGE, REST_SAVES, WriteTracker, edge_checksum, tracked_span

MiB = 1 << 20


@pytest.fixture
def tracker():
    made = WriteTracker.open()
    if made is None:
        pytest.skip("this kernel cannot track page writes (userfaultfd WP_ASYNC and PAGEMAP_SCAN: Linux 6.7+)")
    yield made
    made.close()


def _pieces(tensor: torch.Tensor, size: int) -> list[tuple[memoryview, int]]:
    raw = (ctypes.c_ubyte * tensor.nbytes).from_address(tensor.data_ptr())
    view = memoryview(raw).cast("B")
    return [(view[off : off + size], tensor.data_ptr() + off) for off in range(0, tensor.nbytes, size)]


def _vouched(tracker: WriteTracker, tensor: torch.Tensor, edges: list[str]) -> list[bool]:
    snapshot = tracker.snapshot([tracked_span(tensor)])
    return [snapshot.unwritten(piece, address, e) for (piece, address), e in zip(_pieces(tensor, MiB), edges)]


def _in_place(t):
    t[MiB // 4 * 1 + 5].add_(1)


def _through_data(t):
    t.data[MiB // 4 * 1 + 5] = 9.0


def _through_a_view(t):
    t.view(-1, 256)[(MiB // 4 + 5) // 256].fill_(3.0)


def _through_another_tensor_on_its_storage(t):
    alias = torch.empty(0).set_(t.untyped_storage(), 0, t.shape)
    alias[MiB // 4 + 5] = -1.0


def _through_numpy(t):
    t.numpy()[MiB // 4 + 5] = 4.0


def _by_the_kernel_reading_a_file_into_it(t):
    fd = os.open("/proc/self/stat", os.O_RDONLY)
    try:
        target = (ctypes.c_char * 16).from_address(t.data_ptr() + MiB + 20)
        assert ctypes.CDLL(None).pread(fd, target, 16, 0) == 16
    finally:
        os.close(fd)


def _by_memmove(t):
    ctypes.memmove(t.data_ptr() + MiB + 20, b"\x01" * 8, 8)


WRITES = [
    _in_place,
    _through_data,
    _through_a_view,
    _through_another_tensor_on_its_storage,
    _through_numpy,
    _by_the_kernel_reading_a_file_into_it,
    _by_memmove,
]


@pytest.mark.parametrize("write", WRITES, ids=lambda f: f.__name__.strip("_"))
def test_a_write_of_any_kind_unvouches_its_region_and_no_other(tracker, write):
    t = torch.randn(MiB)  # 4 MiB: four 1 MiB regions; every write above lands in the second
    edges = [edge_checksum(piece, address) for piece, address in _pieces(t, MiB)]
    tracker.snapshot([tracked_span(t)])  # registers and protects
    assert _vouched(tracker, t, edges) == [True] * 4  # nothing written since
    write(t)
    assert _vouched(tracker, t, edges) == [True, False, True, True]
    assert _vouched(tracker, t, edges) == [True, True, True, True]  # the next snapshot dates from the last


def test_a_write_beside_a_region_in_its_edge_page_is_compared_by_hash(tracker):
    buffer = mmap.mmap(-1, 8 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer[:] = os.urandom(8 * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    view = memoryview((ctypes.c_ubyte * (8 * PAGE)).from_address(base)).cast("B")
    piece, address = view[100 : 100 + 3 * PAGE], base + 100  # shares its first and last page with other bytes
    edges = edge_checksum(piece, address)
    tracker.snapshot([(base, base + 8 * PAGE)])
    buffer[10] = (buffer[10] + 1) % 256  # in its first page, outside it
    buffer[100 + 3 * PAGE + 7] = (buffer[100 + 3 * PAGE + 7] + 1) % 256  # in its last page, outside it
    assert tracker.snapshot([(base, base + 8 * PAGE)]).unwritten(piece, address, edges)
    buffer[150] = (buffer[150] + 1) % 256  # its own byte in its first page
    assert not tracker.snapshot([(base, base + 8 * PAGE)]).unwritten(piece, address, edges)
    del view, piece


def test_memory_dropped_by_madvise_is_not_vouched(tracker):
    """Zapped anonymous pages read as zeros afterwards: the kernel must not call them unwritten."""
    buffer = mmap.mmap(-1, 16 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer[:] = b"\x07" * (16 * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    piece = memoryview((ctypes.c_ubyte * (16 * PAGE)).from_address(base)).cast("B")
    span = (base, base + 16 * PAGE)
    edges = edge_checksum(piece, base)
    tracker.snapshot([span])
    assert tracker.snapshot([span]).unwritten(piece, base, edges)
    buffer.madvise(mmap.MADV_DONTNEED, 4 * PAGE, PAGE)
    assert buffer[4 * PAGE] == 0
    assert not tracker.snapshot([span]).unwritten(piece, base, edges)
    del piece


def test_memory_unmapped_and_mapped_again_at_the_same_address_is_not_vouched(tracker):
    """What an allocator does with a freed tensor: the new mapping reads as zeros, never written."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size, flags = 64 * PAGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    protection = mmap.PROT_READ | mmap.PROT_WRITE
    base = libc.mmap(None, size, protection, flags, -1, 0)
    ctypes.memset(base, 7, size)
    piece = memoryview((ctypes.c_ubyte * size).from_address(base)).cast("B")
    edges = edge_checksum(piece, base)
    tracker.snapshot([(base, base + size)])
    assert libc.munmap(ctypes.c_void_p(base), ctypes.c_size_t(size)) == 0
    fixed_noreplace = 0x100000
    assert libc.mmap(base, size, protection, flags | fixed_noreplace, -1, 0) == base
    assert piece[0] == 0
    assert not tracker.snapshot([(base, base + size)]).unwritten(piece, base, edges)
    del piece
    libc.munmap(ctypes.c_void_p(base), ctypes.c_size_t(size))


def test_shared_and_pinned_or_small_memory_is_not_tracked(tracker):
    shared = torch.randn(MiB).share_memory_()  # another process may write it through its own page tables
    assert tracked_span(shared) is None
    span = (shared.data_ptr(), shared.data_ptr() + shared.nbytes)  # asked anyway: the kernel registers shmem
    (piece, address), *_ = _pieces(shared, MiB)
    edges = edge_checksum(piece, address)
    tracker.snapshot([span])
    assert not tracker.snapshot([span]).unwritten(piece, address, edges)  # unwritten here, yet never clean
    assert tracked_span(torch.randn(1000)) is None
    assert tracked_span(torch.randn(1024, 1024).t()) is None  # not contiguous: a save reads a copy


def test_a_kernel_without_the_interface_means_no_tracker(monkeypatch):
    monkeypatch.setattr(written_pages.platform, "machine", lambda: "sparc64")
    assert WriteTracker.open() is None


def test_a_closed_tracker_takes_no_snapshot_and_lifts_its_protection(tracker):
    t = torch.randn(MiB)
    tracker.snapshot([tracked_span(t)])
    tracker.close()
    assert tracker.snapshot([tracked_span(t)]) is None
    t.add_(1)  # no longer protected: a plain write


def _faults(write) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    write()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_span_written_all_over_between_saves_is_left_unprotected_for_a_while(tracker):
    """A tensor trained every interval would pay a fault per page per interval for nothing
    (its regions are read anyway): after one such interval it is left unprotected, then
    watched again, so a layer frozen later is skipped again."""
    t = torch.randn(MiB)  # 1,024 pages
    address, span = t.data_ptr(), tracked_span(t)
    tracker.snapshot([span])
    assert _faults(lambda: t.add_(1)) >= 1000  # protected: the first write to each page faults
    assert not tracker.snapshot([span]).covers(address, t.nbytes)
    assert _faults(lambda: t.add_(1)) < 100  # left unprotected
    for _ in range(REST_SAVES - 1):
        assert not tracker.snapshot([span]).covers(address, t.nbytes)
    assert tracker.snapshot([span]).covers(address, t.nbytes)  # watched again
    assert _faults(lambda: t.add_(1)) >= 1000


def _anonymous(pages: int, at: int | None = None) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (0x100000 if at else 0)  # MAP_FIXED_NOREPLACE
    address = libc.mmap(at, pages * PAGE, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    assert at is None or address == at
    ctypes.memset(address, 1, pages * PAGE)
    return address


def _unmap(address: int, pages: int) -> None:
    assert ctypes.CDLL(None).munmap(ctypes.c_void_p(address), ctypes.c_size_t(pages * PAGE)) == 0


def test_a_span_partly_mapped_anew_since_is_scanned_once_and_its_written_pages_stay_written(tracker):
    """Half of a span is unmapped and mapped again (an allocator reusing a freed tensor's
    address beside a tracked one): the scan stops where registration ends, after protecting
    the pages before it; a second scan of them would find them protected and call them clean."""
    base = _anonymous(16)
    span = (base, base + 16 * PAGE)
    tracker.snapshot([span])
    tracker.snapshot([span])
    ctypes.memset(base, 2, 1)  # page 0 written
    _unmap(base + 8 * PAGE, 8)
    _anonymous(8, at=base + 8 * PAGE)
    snapshot = tracker.snapshot([span])
    piece = memoryview((ctypes.c_ubyte * PAGE).from_address(base)).cast("B")
    assert not snapshot.unwritten(piece, base, "")  # page 0 is not vouched for
    assert all(start >= base + PAGE for start, _end in snapshot.clean)
    _unmap(base, 16)


def test_memory_another_tracker_holds_is_not_scanned_by_this_one(tracker):
    """Two Checkpointers in one process: a span the first once tracked, freed and now held
    by the second, must not be scanned (and protected again) by the first."""
    other = WriteTracker.open()
    base = _anonymous(8)
    span = (base, base + 8 * PAGE)
    other.snapshot([span])
    _unmap(base, 8)
    _anonymous(8, at=base)  # another tensor in its place, tracked by this tracker
    tracker.snapshot([span])
    tracker.snapshot([span])
    ctypes.memset(base + 3 * PAGE, 9, 1)
    assert not other.snapshot([span]).covers(base, 8 * PAGE)  # refused: this tracker holds it
    snapshot = tracker.snapshot([span])
    assert (base + 3 * PAGE, base + 4 * PAGE) not in [(s, e) for s, e in snapshot.clean]
    assert not any(s <= base + 3 * PAGE < e for s, e in snapshot.clean)
    other.close()
    _unmap(base, 8)


def test_a_forked_child_takes_no_snapshot(tracker):
    """/proc/self/pagemap, opened by the parent, still reads the parent's memory in a child."""
    t = torch.randn(MiB)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if tracker.snapshot([tracked_span(t)]) is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert tracker.snapshot([tracked_span(t)]) is not None
