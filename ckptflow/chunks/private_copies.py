"""Private copies of live tensor memory, so that what a save stores is what it hashed.

A blocking save reads the caller's own tensors. Another thread (a training loop that goes
on, a Hogwild worker, a signal handler's save) may write them meanwhile, and a chunk stored
straight from that memory could then differ from the address and fast checksum hashed from
it a moment before: a committed checkpoint that fails its own verification, and an object
in the content-addressed store whose bytes do not hash to its name, which later saves of the
true bytes would have reused. Measured before this module, with one thread adding to 8 MiB
of tensors while 20 blocking saves ran: 18 of 20 committed checkpoints failed ``verify``.

So a chunk that is written from live memory is first copied into a private buffer, piece by
piece, its fast checksum computed over each piece while it is in cache, and the copy is what
gets encoded and stored. Where that checksum differs from the one the save was given (hashed
from the live memory first, or a full save's previous checksum for the region), the bytes
changed in between: the chunk is addressed by what was copied. A checkpoint taken
while its state is written may still mix values from before and after (as DCP's can), but
each of its chunks holds the bytes its manifest names.

Only written chunks are copied (an incremental save reuses unchanged ones without it), and
the copies are bounded: buffers of at most ``COPY_BYTES`` in all (or one per I/O thread,
for larger chunks), reused within one save and released when it ends.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from ckptflow.format.checksum import ADDRESS, PIECE, FastChecksum, address_hasher

COPY_BYTES = 256 << 20  # private copies one save holds at once (more only for chunks over 1/32 of it: private_copies)


class PrivateCopies:
    """Reusable buffers for one save's private copies of live chunks. Thread-safe: a
    writer waits for a free buffer rather than allocating past ``limit`` bytes."""

    def __init__(self, chunk_bytes: int, *, limit: int = COPY_BYTES):
        self.chunk_bytes = chunk_bytes
        self.slots = max(1, limit // max(1, chunk_bytes))
        self._free: list[np.ndarray] = []
        self._taken = 0
        self._cond = threading.Condition()

    @contextmanager
    def copy(self, raw: memoryview, *, address: bool) -> Iterator[tuple[memoryview, str, str]]:
        """A private copy of ``raw``, its address (with ``address``; else "") and its fast
        checksum, all hashed from the copy; held until the ``with`` ends (the store's write
        must be done by then)."""
        buffer = self._take(len(raw))
        try:
            view = buffer.data.cast("B")[: len(raw)]
            yield view, *copy_and_hash(raw, view, address=address)
        finally:
            self._give(buffer)

    def _take(self, nbytes: int) -> np.ndarray:
        with self._cond:
            while self._taken >= self.slots:
                self._cond.wait()
            self._taken += 1
            if nbytes <= self.chunk_bytes and self._free:
                return self._free.pop()
        try:  # never touched before it is copied into: a small chunk faults in only its own pages
            return np.empty(max(nbytes, self.chunk_bytes), dtype=np.uint8)
        except BaseException:  # MemoryError: the slot goes back, or every later writer would wait for it
            with self._cond:
                self._taken -= 1
                self._cond.notify()
            raise

    def _give(self, buffer: np.ndarray) -> None:
        with self._cond:
            self._taken -= 1
            if len(buffer) == self.chunk_bytes:
                self._free.append(buffer)
            self._cond.notify()


def private_copies(chunk_bytes: int, *, writers: int) -> PrivateCopies:
    """Copies for one save whose chunks ``writers`` threads store at once: ``COPY_BYTES``
    of buffers, or one per writer where chunks are so large that fewer would hold writes back."""
    return PrivateCopies(chunk_bytes, limit=max(COPY_BYTES, writers * chunk_bytes))


def copy_and_hash(raw: memoryview, into: memoryview, *, address: bool) -> tuple[str, str]:
    """Copy ``raw`` into ``into`` (as long as it): (address or "", fast checksum) of the
    copy, each piece hashed while it is still in cache. Both come from the copy, so they
    name the same bytes however ``raw`` changes meanwhile."""
    source = memoryview(raw).cast("B")
    hasher = address_hasher(ADDRESS) if address else None
    check = FastChecksum()
    for start in range(0, len(source), PIECE):
        piece = into[start : start + PIECE]
        piece[:] = source[start : start + PIECE]
        if hasher is not None:
            hasher.update(piece)
        check.update(piece)
    return (hasher.hexdigest() if hasher is not None else ""), check.hexdigest()
