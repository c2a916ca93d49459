"""How chunk bytes are checked: their address, and the fast checksum restore uses.

A chunk's **address** names it in the store and is what dedup, GC, scrub and ``verify
--deep`` trust, so it must be cryptographic: with a weak hash, anyone who can choose the
bytes of one chunk (a public frozen embedding, say) could make a later chunk dedup onto
theirs. Manifests of format 2 address chunks by BLAKE3 (7.6 GB/s per core here, against
2.0 GB/s for sha256, which was a third of a save's CPU); manifests of format 1 name
sha256, and are read as they are. Both digests are 32 bytes, so the two kinds of chunk
share one namespace, and a chunk is accepted under either (``matches_address``).

Restore has a narrower question, "are these the bytes the saver had?", and asks it of
every byte it loads, so it gets a cheaper answer: at save, the same pass over each
in-cache piece that feeds the address also computes

* xxh3-128 of the raw bytes (30+ GB/s per core here), which misses random damage of
  any extent with probability about 2**-128, and
* the sum of the raw bytes as little-endian 64-bit words, modulo 2**64 (the last word
  zero-padded), which misses no damage confined to one word: such damage changes that
  word by some d with 0 < |d| < 2**64, and the sum by d mod 2**64, never 0. So any
  damaged byte, or burst within one word, is caught for certain, not by probability.

The two are stored together as 48 hex digits in the manifest (``fast_checksums``: digest
-> checksum), which is itself sealed by a sha256. Neither is a defence against someone
who can write the store (xxh3 is not cryptographic); a deliberate forgery needs the
address, which ``verify --deep`` and scrub re-hash.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import blake3
import numpy as np
import xxhash

ADDRESS = "blake3"  # what new chunks are addressed by (manifest field ``address``)
ADDRESSES = ("blake3", "sha256")  # what a reader accepts; sha256: manifests of format 1
FIELD = "fast_checksums"  # the manifest field; another algorithm would get another field
STORED_FIELD = "stored_checksums"  # digest -> xxh3-128 of the chunk object's bytes (``stored_checksum``)
STORED_HEX_DIGITS = 32
HEX_DIGITS = 48
PIECE = 1 << 20  # hashed piece by piece while each stays in cache
_WORD = 8
_MASK = (1 << 64) - 1
_HEX = re.compile(f"[0-9a-f]{{{HEX_DIGITS}}}")
_STORED_HEX = re.compile(f"[0-9a-f]{{{STORED_HEX_DIGITS}}}")


class FastChecksum:
    """Streaming xxh3-128 + 64-bit word sum of bytes fed in any pieces."""

    def __init__(self) -> None:
        self._xxh = xxhash.xxh3_128()
        self._sum = 0
        self._carry = b""  # the bytes of a word split across two pieces

    def update(self, piece: bytes | bytearray | memoryview) -> None:
        piece = memoryview(piece).cast("B")
        self._xxh.update(piece)
        if self._carry:
            take = _WORD - len(self._carry)
            self._carry += bytes(piece[:take])
            piece = piece[take:]
            if len(self._carry) < _WORD:
                return
            self._sum += int.from_bytes(self._carry, "little")
            self._carry = b""
        whole = len(piece) // _WORD * _WORD
        if whole:
            self._sum += int(np.add.reduce(np.frombuffer(piece[:whole], dtype="<u8"), dtype=np.uint64))
        self._carry = bytes(piece[whole:])

    def hexdigest(self) -> str:
        total = (self._sum + int.from_bytes(self._carry.ljust(_WORD, b"\0"), "little")) & _MASK
        return self._xxh.hexdigest() + f"{total:016x}"


def fast_checksum(raw: bytes | bytearray | memoryview) -> str:
    """Piece by piece, so both sums read each piece from cache, not memory."""
    view = memoryview(raw).cast("B")
    check = FastChecksum()
    for start in range(0, len(view), PIECE):
        check.update(view[start : start + PIECE])
    return check.hexdigest()


def same_content(raw: bytes | bytearray | memoryview, checksum: str) -> bool:
    """Whether ``raw`` has the xxh3-128 that the fast ``checksum`` of some bytes records:
    how an incremental save tells whether a region of its own tensor changed since its
    previous save, at xxh3's speed (the word sum is skipped: a miss is 2**-128 per chunk,
    and on a match the previous bytes' checksum is the one recorded)."""
    return xxhash.xxh3_128_hexdigest(memoryview(raw).cast("B")) == checksum[:32]


def address_hasher(address: str) -> Any:
    """A streaming hasher for chunk addresses of kind ``address`` (``ADDRESSES``)."""
    if address == "blake3":
        return blake3.blake3()
    if address == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown chunk address hash {address!r}; this ckptflow knows {ADDRESSES}")


def address_of(raw: bytes | bytearray | memoryview, address: str = ADDRESS) -> str:
    hasher = address_hasher(address)
    hasher.update(raw)
    return hasher.hexdigest()


def matches_address(digest: str, raw: bytes | bytearray | memoryview, first: str | None = None) -> bool:
    """Whether ``raw`` is what ``digest`` names, under either kind of address, ``first``
    (the reading manifest's kind) tried first. Either is accepted because a format-2
    manifest may list a format-1 chunk as a delta base, and compaction or thaw read
    chunks outside any manifest; both kinds are cryptographic, so neither is a weak link."""
    kinds = sorted(ADDRESSES, key=lambda kind: kind != (first or ADDRESS))
    return any(address_of(raw, kind) == digest for kind in kinds)


def address_and_checksum(raw: bytes | bytearray | memoryview) -> tuple[str, str]:
    """(address, fast checksum) of ``raw`` in one pass: each piece is read from memory
    once and hashed twice while it sits in cache."""
    view = memoryview(raw).cast("B")
    address, check = address_hasher(ADDRESS), FastChecksum()
    for start in range(0, len(view), PIECE):
        piece = view[start : start + PIECE]
        address.update(piece)
        check.update(piece)
    return address.hexdigest(), check.hexdigest()


def is_checksum(value: object) -> bool:
    return isinstance(value, str) and _HEX.fullmatch(value) is not None


def stored_checksum(parts: list) -> str:
    """xxh3-128 of a chunk object's bytes as stored (header and encoded payload).

    Recorded for chunks stored encoded but not as deltas, so restore's first pass can
    prove an object holds the bytes the saver stored at xxh3's speed, without decoding
    it; the second pass decodes it once, into place, and checks the fast checksum of what
    it decoded. It speaks only for the object as written: a chunk rewritten since
    (compaction, another tier) no longer matches, and is then verified by decoding it.
    """
    hasher = xxhash.xxh3_128()
    for part in parts:
        hasher.update(memoryview(part).cast("B"))
    return hasher.hexdigest()


def is_stored_checksum(value: object) -> bool:
    return isinstance(value, str) and _STORED_HEX.fullmatch(value) is not None
