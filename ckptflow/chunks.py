"""Content-addressed chunk I/O over any ``Store``.

Chunks are immutable and named by the sha256 of their raw bytes, so identical data
(a frozen embedding, a tensor shared by two runs) is stored once, and every read can
be checked against its own name.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

from ckptflow import codecs
from ckptflow.errors import CorruptChunkError, ObjectNotFoundError, ObjectTooLargeError
from ckptflow.format import chunk_key
from ckptflow.store.base import Store

SCAN_PIECE = 1 << 20  # small enough to stay in cache between read and hash


@dataclass(frozen=True)
class CheckedChunk:
    """A chunk that passed verification: its bytes, or the version of the file holding them."""

    digest: str
    size: int
    version: tuple | None = None
    data: memoryview | None = None


@dataclass(frozen=True)
class ChunkWrite:
    digest: str
    raw_bytes: int
    stored_bytes: int  # encoded size in the store, header included
    written: bool  # False when the chunk was already in the store and left alone


def sha256(raw: memoryview | bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


class ChunkStore:
    """Put and get verified chunks. Thread-safe; callers parallelise across chunks."""

    def __init__(self, store: Store):
        self.store = store
        self._local = threading.local()  # per-thread scratch buffers for ``check``

    def put(
        self,
        raw: memoryview,
        *,
        digest: str | None = None,
        codec: str = "raw",
        itemsize: int = 1,
        rewrite: bool = False,
    ) -> ChunkWrite:
        """Store ``raw``. ``rewrite`` replaces an existing copy instead of trusting it."""
        digest = digest or sha256(raw)
        key = chunk_key(digest)
        if not rewrite:
            try:
                existing = self.store.stat(key)
            except ObjectNotFoundError:
                pass
            else:
                self.store.touch(key)  # restart GC's grace period: this save now uses it
                return ChunkWrite(digest, len(raw), existing.size, False)
        parts = codecs.encode(raw, codec, itemsize)
        size = sum(len(p) for p in parts)
        if rewrite:
            self.store.replace(key, parts)
            return ChunkWrite(digest, len(raw), size, True)
        written = self.store.put_if_absent(key, parts)
        return ChunkWrite(digest, len(raw), size, written)

    def get(self, digest: str, size: int) -> memoryview:
        """Raw bytes of a chunk the manifest says holds ``size`` raw bytes, verified against
        its address. The object's size and its header are checked against ``size`` before
        it is read or decompressed, so a damaged or hostile chunk cannot make the reader
        allocate more than the manifest promised."""
        return self._decoded(digest, self._fetch(digest, size), size)

    def _fetch(self, digest: str, size: int) -> bytes:
        key = chunk_key(digest)
        try:
            return self.store.get_bounded(key, codecs.max_encoded_size(size))
        except ObjectNotFoundError:
            raise self._missing(digest, key) from None
        except ObjectTooLargeError as e:
            raise CorruptChunkError(f"chunk {e} (the manifest says {size} raw bytes)") from None

    def _decoded(self, digest: str, blob: bytes, size: int) -> memoryview:
        key = chunk_key(digest)
        try:
            raw = codecs.decode(blob, expected=size)
        except CorruptChunkError as e:
            raise CorruptChunkError(f"chunk {self.store.url}/{key}: {e}") from None
        if len(raw) != size:
            raise CorruptChunkError(f"chunk {self.store.url}/{key} holds {len(raw)} bytes, the manifest expects {size}")
        self._verify(digest, key, raw)
        return raw

    def check(self, digest: str, size: int) -> CheckedChunk:
        """Verify a chunk before anything is written from it (restore's first pass).

        A raw chunk on a store that can re-read cheaply (``Store.cheap_reread``) is
        streamed through a small per-thread buffer into the hash, and only its file
        version is kept; anything else keeps the verified bytes, so the second pass
        never fetches twice. Any anomaly goes through ``get``, which names the problem.
        """
        if self.store.cheap_reread:
            header, hasher = bytearray(), hashlib.sha256()

            def consume(piece: memoryview) -> None:
                if len(header) < codecs.HEADER.size:
                    take = codecs.HEADER.size - len(header)
                    header.extend(piece[:take])
                    piece = piece[take:]
                hasher.update(piece)

            try:
                got, version = self.store.scan(
                    chunk_key(digest), self._scratch(SCAN_PIECE), consume, limit=codecs.max_encoded_size(size)
                )
            except ObjectNotFoundError:
                raise self._missing(digest, chunk_key(digest)) from None
            except ObjectTooLargeError as e:
                raise CorruptChunkError(f"chunk {e} (the manifest says {size} raw bytes)") from None
            if got == codecs.HEADER.size + size and codecs.raw_length(header) == size and hasher.hexdigest() == digest:
                return CheckedChunk(digest, size, version=version)
        return CheckedChunk(digest, size, data=self.get(digest, size))

    def read_checked(self, checked: CheckedChunk, out: memoryview) -> None:
        """Fill ``out`` with a chunk ``check`` verified; re-verify if the file changed since."""
        out = memoryview(out).cast("B")
        if checked.data is not None:
            out[:] = checked.data
            return
        header = bytearray(codecs.HEADER.size)
        try:
            got, version = self.store.get_into(chunk_key(checked.digest), [header, out])
        except ObjectNotFoundError:
            raise self._missing(checked.digest, chunk_key(checked.digest)) from None
        if version != checked.version or got != len(header) + len(out) or codecs.raw_length(header) != len(out):
            out[:] = self.get(checked.digest, len(out))  # replaced since: verify again

    def _scratch(self, size: int) -> memoryview:
        buf = getattr(self._local, "scratch", None)
        if buf is None or len(buf) < size:
            buf = self._local.scratch = bytearray(size)
        return memoryview(buf)[:size]

    def _missing(self, digest: str, key: str) -> CorruptChunkError:
        return CorruptChunkError(f"chunk {digest[:16]}… is missing from {self.store.url}/{key}")

    def _verify(self, digest: str, key: str, raw: memoryview | bytes) -> None:
        actual = sha256(raw)
        if actual != digest:
            raise CorruptChunkError(
                f"chunk {self.store.url}/{key} does not match its address (content hashes to {actual[:16]}…)"
            )

    def reencode(
        self, digest: str, size: int, codec: str, itemsize: int = 1, level: int = 3, *, only_if_smaller: bool = False
    ) -> tuple[int, int]:
        """Verify then rewrite a chunk with another codec; (bytes before, bytes after).

        With ``only_if_smaller`` a chunk already in ``codec``, or one the codec would not
        shrink, is left alone (after == before): what compaction of a store wants.
        """
        blob = self._fetch(digest, size)
        if only_if_smaller and codecs.header_codec(blob) == codec:
            return len(blob), len(blob)
        parts = codecs.encode(self._decoded(digest, blob, size), codec, itemsize, level)
        after = sum(len(p) for p in parts)
        if only_if_smaller and after >= len(blob):
            return len(blob), len(blob)
        self.store.replace(chunk_key(digest), parts)
        return len(blob), after
