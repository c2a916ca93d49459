"""How much host memory a verified restore may hold beyond the state it restores into.

Restore verifies every chunk before it writes any (``ckptflow.dcp.reader``). A chunk that
cannot be re-read cheaply and checked in small pieces (an encoded chunk, any chunk on S3)
has to be decoded whole to be verified; keeping every decoded chunk until the second pass
would hold a second copy of the state in memory (a zstd restore of 1 GiB peaked at +1.1 GiB).
A ``MemoryBudget`` bounds that: half of it is for chunks in flight (fetched and decoding,
in either pass: threads wait for room rather than each holding a chunk), half for verified
chunks kept for the second pass. A chunk that does not fit in the kept half is dropped once
verified and fetched and decoded again, and verified again, in the second pass: a second
decode (or, on S3, a second GET) of what does not fit, in exchange for memory that does not
grow with the state. Where the manifest records the checksum of a local chunk's stored
bytes, a chunk that does not fit is not decoded in the first pass at all: its stored bytes
are checked against that checksum, and the second pass decodes it once
(``ckptflow.chunks.reads.ChunkReader.check``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

DEFAULT_RESTORE_BUFFER = 256 << 20
IN_FLIGHT_FACTOR = 2  # a chunk being decoded holds its stored blob and its raw bytes


class MemoryBudget:
    """Bytes of host memory a restore may hold for chunks: in flight, and kept verified."""

    def __init__(self, total: int = DEFAULT_RESTORE_BUFFER):
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"a restore's memory budget must be a number of bytes >= 0, got {total!r}")
        self.total = total
        self.in_flight_cap = max(1, total // 2)
        self.keep_cap = total - total // 2
        self._in_flight = 0
        self._kept = 0
        self._peak = 0
        self._cond = threading.Condition()

    @contextmanager
    def in_flight(self, raw_bytes: int) -> Iterator[None]:
        """Hold room for decoding a chunk of ``raw_bytes``; waits until there is room.
        A chunk larger than the whole in-flight half still proceeds, alone."""
        need = min(self.in_flight_cap, IN_FLIGHT_FACTOR * raw_bytes)
        with self._cond:
            while self._in_flight and self._in_flight + need > self.in_flight_cap:
                self._cond.wait()
            self._in_flight += need
            self._peak = max(self._peak, self._in_flight + self._kept)
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= need
                self._cond.notify_all()

    def keep(self, raw_bytes: int) -> bool:
        """Whether a verified chunk of ``raw_bytes`` may be kept for the second pass (and
        is now counted as kept); False: drop it and decode it again there."""
        with self._cond:
            if self._kept + raw_bytes > self.keep_cap:
                return False
            self._kept += raw_bytes
            self._peak = max(self._peak, self._in_flight + self._kept)
            return True

    def room_to_keep(self, raw_bytes: int) -> bool:
        """Whether ``keep`` would keep a chunk of ``raw_bytes`` now (nothing is counted)."""
        with self._cond:
            return self._kept + raw_bytes <= self.keep_cap

    def release(self, raw_bytes: int) -> None:
        """A kept chunk was used (or dropped): its room is free again."""
        with self._cond:
            self._kept -= raw_bytes

    @property
    def peak(self) -> int:
        """The most bytes counted at once (in flight and kept): what tests check the bound by."""
        return self._peak
