"""What a read computes while a chunk's bytes stream past (``ckptflow.chunks.reads``), piece
by piece, each piece hashed while it is still in the CPU cache: restore's first pass
(``FirstPass``) and what it hands the second (``CheckedChunk``), the check of what its second
pass reads into place (``PayloadHash``), and a single-pass read's check (``Skipping`` a hasher
past the header).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xxhash

from ckptflow.chunks import codecs

SUM_HEX = 16  # a fast checksum ends with the 64-bit word sum (``ckptflow.format.checksum``)


class Skipping:
    """Feeds ``inner`` (a hasher) the bytes after the first ``skip`` (a chunk's header)."""

    def __init__(self, skip: int, inner: Any):
        self.skip, self.inner = skip, inner

    def update(self, piece: memoryview) -> None:
        if self.skip:
            cut = min(self.skip, len(piece))
            self.skip -= cut
            piece = piece[cut:]
        self.inner.update(piece)


class PayloadHash(Skipping):
    """xxh3-128 of the bytes after the first ``skip`` (a chunk's header): what the second
    pass of a restore checks each piece it reads into place with."""

    def __init__(self, skip: int):
        super().__init__(skip, xxhash.xxh3_128())

    def matches(self, checksum: str | None) -> bool:
        """Whether the bytes have the xxh3-128 that the fast ``checksum`` records first."""
        return checksum is not None and self.inner.hexdigest() == checksum[: len(checksum) - SUM_HEX]


class NotRaw(Exception):
    """Stops a verifying scan at the header of a chunk it cannot verify as it streams past."""


class FirstPass:
    """What restore's first pass computes while a chunk streams past (``ChunkReader.check``):
    the fast checksum (``payload``) of a raw chunk's payload, or, for an encoded chunk
    whose manifest records the checksum of its stored bytes (``stored``), the xxh3-128 of
    those bytes (``as_stored``). Any other chunk stops the scan (``NotRaw``)."""

    def __init__(self, size: int, payload: Any, stored: str | None):
        self.size, self.payload, self.stored = size, payload, stored
        self.header = bytearray()
        self.as_stored: Any = None

    def update(self, piece: memoryview) -> None:
        if len(self.header) < codecs.HEADER.size:
            take = codecs.HEADER.size - len(self.header)
            self.header.extend(piece[:take])
            piece = piece[take:]
            if len(self.header) == codecs.HEADER.size and codecs.raw_length(self.header) is None:
                if self.stored is None or not codecs.checkable_as_stored(self.header, self.size):
                    raise NotRaw  # decode it instead
                self.as_stored = xxhash.xxh3_128(self.header)
        (self.payload if self.as_stored is None else self.as_stored).update(piece)


@dataclass(frozen=True)
class CheckedChunk:
    """A chunk that passed verification: its bytes, or the version of the file holding them,
    or neither (``again``: the second pass fetches, decodes and verifies it (once more):
    its stored bytes were verified without decoding, or its decoded bytes did not fit the
    restore's memory budget)."""

    digest: str
    size: int
    version: tuple | None = None
    data: memoryview | None = None
    again: bool = False
    as_stored: bool = False  # only its stored bytes were checked (against the manifest's stored checksum)
