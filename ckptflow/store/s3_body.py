"""What an S3 upload sends: an object's buffers as one seekable stream, and the checksum
S3 checks them against.

A chunk arrives as a header and a payload that is a view of the tensor's own memory;
joining them would copy every byte once more before it is sent, so the body is a reader
over the buffers as they are (seekable, so a retry or a signer can rewind it).

The checksum is what S3 verifies the received bytes against and refuses the upload on a
mismatch: the protection is against damage on the way, not forgery (a chunk's address,
BLAKE3, is what dedup and ``verify --deep`` trust). So an object of chunk size carries a
CRC32 (zlib's, about twice the speed of SHA-256 here, and supported by S3 and the
S3-compatible stores alike); a small object (a manifest, a rank record) keeps SHA-256,
which costs nothing at that size and is what a lost commit response is compared by
(``S3Store.put_if_absent``).
"""

from __future__ import annotations

import base64
import hashlib
import io
import zlib
from collections.abc import Sequence

STRONG_BELOW = 1 << 20  # objects smaller than this carry SHA-256, larger ones CRC32


class BuffersReader(io.RawIOBase):
    """The concatenation of ``views`` as a readable, seekable stream, without a copy."""

    def __init__(self, views: Sequence[memoryview]):
        super().__init__()
        self._views = [v for v in views if len(v)]
        self.size = sum(len(v) for v in self._views)
        self._pos = 0
        self._index = 0  # the view holding ``_pos``
        self._start = 0  # where that view starts in the stream

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = min(max(0, base + offset), self.size)
        self._index = self._start = 0
        while self._index < len(self._views) and self._start + len(self._views[self._index]) <= self._pos:
            self._start += len(self._views[self._index])
            self._index += 1
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        out = memoryview(buffer).cast("B")
        done = 0
        while done < len(out) and self._index < len(self._views):
            view = self._views[self._index]
            offset = self._pos - self._start
            take = min(len(view) - offset, len(out) - done)
            out[done : done + take] = view[offset : offset + take]
            done += take
            self._pos += take
            if offset + take == len(view):
                self._start += len(view)
                self._index += 1
        return done


def checksum_header(views: Sequence[memoryview]) -> dict[str, str]:
    """The ``Checksum*`` argument of a PutObject / UploadPart of these bytes."""
    if sum(len(v) for v in views) < STRONG_BELOW:
        return {"ChecksumSHA256": sha256_b64(views)}
    return {"ChecksumCRC32": crc32_b64(views)}


def sha256_b64(views: Sequence[memoryview]) -> str:
    h = hashlib.sha256()
    for view in views:
        h.update(view)
    return base64.b64encode(h.digest()).decode()


def crc32_b64(views: Sequence[memoryview]) -> str:
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    return base64.b64encode(crc.to_bytes(4, "big")).decode()
