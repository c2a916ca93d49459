"""Content-addressed chunk I/O over any ``Store``.

Chunks are immutable and named by a cryptographic hash of their raw bytes (their
address: ``ckptflow.format.checksum``), so identical data (a frozen embedding, a tensor shared
by two runs) is stored once, and every read can be checked against its own name. A
store scoped to one manifest checks reads against the fast checksum that manifest
records for a chunk instead, and against the manifest's kind of address where it
records none (manifests written before fast checksums).

Reads (verified, bounded, the two passes of a restore) are ``ChunkReader``'s
(``ckptflow.chunks.reads``); ``ChunkStore`` adds what writes chunks: a put that reuses
what is already stored, and the verified rewrites of compaction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from ckptflow.chunks import codecs, damaged
from ckptflow.chunks.budget import MemoryBudget
from ckptflow.chunks.private_copies import PrivateCopies
from ckptflow.chunks.reads import ChunkReader
from ckptflow.errors import CorruptChunkError, ObjectNotFoundError
from ckptflow.format.checksum import (
    address_and_checksum,
    address_of,
    fast_checksum,
    same_content,
    stored_checksum,
)
from ckptflow.format.layout import chunk_key

UNKNOWN_SIZE = -1  # a chunk's stored size where the manifest a restore read does not say it (a stat does)


@dataclass(frozen=True, kw_only=True)
class ChunkWrite:
    digest: str
    raw_bytes: int
    stored_bytes: int  # encoded size in the store, header included (UNKNOWN_SIZE: what a restore loaded)
    written: bool  # False when the chunk was already in the store and left alone
    base: str | None = None  # the delta base its stored encoding needs: every manifest naming it lists this too
    base_bytes: int = 0  # the base's stored size
    checksum: str = ""  # the fast checksum of the raw bytes (``ckptflow.format.checksum``)
    # of the object as this process stored it, if encoded but not a delta (``checksum.stored_checksum``)
    stored_checksum: str = ""


@dataclass(frozen=True)
class Encoded:
    """A chunk's header and payload buffers, and the delta base they need (if any)."""

    parts: list
    base: str | None = None
    base_bytes: int = 0


Encoder = Callable[[memoryview, str], Encoded]  # (raw bytes, their digest) -> how to store them


class _Encoding(NamedTuple):
    """How ``ChunkStore.put`` encodes a chunk it writes."""

    encoder: Encoder | None
    codec: str
    itemsize: int
    floating: bool


def plain_encoding(raw: memoryview, *, itemsize: int = 1, floating: bool = False) -> list:
    """``raw`` as zstd, or as raw where zstd would not shrink it: an encoding that needs no base."""
    parts = codecs.encode(raw, "zstd", itemsize, floating=floating)
    if sum(memoryview(p).nbytes for p in parts) < len(raw) + codecs.HEADER.size:
        return parts
    return codecs.encode(raw, "raw")


def _stored_checksum(encoded: Encoded, raw: memoryview, checksum: str, *, private: bool) -> str:
    """The checksum of an encoding's bytes where a restore may verify the chunk by it
    (``codecs.checkable_as_stored``): only if ``raw`` still has the xxh3-128 its fast
    ``checksum`` records once the encoding is hashed, so the bytes encoded are the bytes
    checksummed (a tensor written to while it was saved gets none, and restore decodes that
    chunk to verify it). Hashed before that check: an encoding may be a view of the tensor
    (a plane stored as it is), and a write after the check then makes the object differ
    from its stored checksum, which sends it to be decoded and verified too. "" for a raw
    chunk or a delta. ``private``: ``raw`` is a private copy ``checksum`` was computed from,
    which nothing writes: no check."""
    header = memoryview(encoded.parts[0]).cast("B")
    if encoded.base is not None or not codecs.checkable_as_stored(header, len(raw)):
        return ""
    stored = stored_checksum(encoded.parts)  # first: a write after the check may change the object, never this
    return stored if private or same_content(raw, checksum) else ""


class ChunkStore(ChunkReader):
    """Put and get verified chunks. Thread-safe; callers parallelise across chunks."""

    def scoped(
        self,
        chunks: Mapping[str, int],
        *,
        checksums: Mapping[str, str] | None = None,
        stored_checksums: Mapping[str, str] | None = None,
        address: str | None = None,
        budget: MemoryBudget | None = None,
    ) -> ChunkStore:
        """This store, reading for one manifest: a delta chunk whose base that manifest
        does not list is refused, so a checkpoint never needs more than its own list.
        With the manifest's ``checksums``, reads are checked against them (fast) instead
        of re-hashing the ``address`` (the manifest's kind); without (``verify --deep``),
        the address. ``stored_checksums`` (the manifest's) let ``check`` verify encoded
        chunks without decoding them. ``budget`` bounds the decoded bytes ``check`` keeps
        and decodes at once."""
        return ChunkStore(
            self.store,
            scope=chunks,
            checksums=checksums,
            stored_checksums=stored_checksums,
            address=address,
            budget=budget,
        )

    def put(
        self,
        raw: memoryview,
        *,
        digest: str | None = None,
        checksum: str | None = None,
        codec: str = "raw",
        itemsize: int = 1,
        rewrite: bool = False,
        floating: bool = False,
        encoder: Encoder | None = None,
        known: ChunkWrite | None = None,
        copies: PrivateCopies | None = None,
    ) -> ChunkWrite:
        """Store ``raw`` (with ``encoder`` if given, else ``codec``). ``rewrite`` replaces
        an existing copy instead of trusting it. ``digest`` and ``checksum``, where the
        caller already knows them for these bytes, are not computed again.

        ``known``: what an earlier put of this run returned for the same digest (an
        incremental save's previous save of the same region, or the restore it resumed
        from: ``ckptflow.dcp.regions``). The chunk is then reused without asking the store
        whether it exists (a ``stat``: on S3 a HEAD): its header is read and it is touched
        as always, and where it has gone since, it is stored anew. Its stored size is taken
        from ``known`` (a statistic only; a restore does not know it: then it is a ``stat``).
        Where ``known`` is a plain (not delta) chunk a save of this process stored or kept,
        its header is not read either: only the touch remains.

        A reused chunk may be stored as a delta: its base is looked up (a read of its
        header), checked to exist and touched with it, and returned, so the manifest of
        every checkpoint that references the chunk also lists its base. An existing copy
        is never replaced by a delta (it is stored plainly instead): another save may be
        committing a reference to the chunk that lists no such base.

        ``copies``: ``raw`` is live memory another thread may write (a blocking save's
        tensors); a chunk written is stored from a private copy, addressed by what was
        copied (``ckptflow.chunks.private_copies``).
        """
        how = _Encoding(encoder, codec, itemsize, floating)
        if digest is None and copies is not None:  # hashed from a copy: the address and checksum name one content
            with copies.copy(raw, address=True) as (copy, digest, checksum):
                reused, rewrite = self._lookup(copy, digest, checksum, known=known, rewrite=rewrite)
                return reused or self._store(copy, digest, checksum, how, rewrite=rewrite, private=True)
        if digest is None:
            digest, checksum = address_and_checksum(raw)
        elif checksum is None:
            checksum = fast_checksum(raw)
        reused, rewrite = self._lookup(raw, digest, checksum, known=known, rewrite=rewrite)
        if reused is not None:
            return reused
        if copies is None:
            return self._store(raw, digest, checksum, how, rewrite=rewrite, recheck=known is not None)
        with copies.copy(raw, address=False) as (copy, _, copied):
            if known is not None or copied != checksum:  # ``digest`` vouched for by xxh3, or written to since
                digest, checksum = address_of(copy), copied  # what is stored under an address hashes to it
                rewrite = rewrite or damaged.known(self.store.url, digest)
            return self._store(copy, digest, checksum, how, rewrite=rewrite, private=True)

    def _lookup(
        self, raw: memoryview, digest: str, checksum: str, *, known: ChunkWrite | None, rewrite: bool
    ) -> tuple[ChunkWrite | None, bool]:
        """The stored chunk ``digest`` kept for ``raw`` (None: it must be written), and
        whether a write must replace what is stored under its name."""
        key = chunk_key(digest)
        rewrite = rewrite or damaged.known(self.store.url, digest)  # never keep an object a read refused
        if not rewrite and known is not None and known.digest == digest:
            try:
                # a save of ours stored it plainly, and a stored chunk is never replaced by a delta: no
                # header to read (unless it was swept and stored again as a delta since: docs/storage.md)
                if known.stored_bytes != UNKNOWN_SIZE and known.base is None:
                    self.store.touch(key)
                    return replace(known, written=False, base_bytes=0, checksum=checksum), rewrite
                size = self.store.stat(key).size if known.stored_bytes == UNKNOWN_SIZE else known.stored_bytes
                reused = self._reuse(digest, size, len(raw), checksum, known.stored_checksum)
            except ObjectNotFoundError:
                pass  # gone since: look again below
            else:
                if reused is not None:
                    return reused, rewrite
                rewrite = True  # a delta whose base is gone or damaged: store it anew
        if not rewrite:
            try:
                existing = self.store.stat(key)
            except ObjectNotFoundError:
                pass
            else:
                reused = self._reuse(digest, existing.size, len(raw), checksum)
                if reused is not None:
                    return reused, rewrite
                rewrite = True  # a delta whose base is gone or damaged: store it anew
        return None, rewrite

    def _store(
        self,
        raw: memoryview,
        digest: str,
        checksum: str,
        how: _Encoding,
        *,
        rewrite: bool,
        recheck: bool = False,
        private: bool = False,
    ) -> ChunkWrite:
        """Write ``raw`` as the chunk ``digest`` (hashed again first where ``recheck``: the
        bytes may not be those it names). ``private``: ``raw`` is a private copy that
        ``digest`` and ``checksum`` were hashed from, which nothing else writes."""
        if recheck:  # written anew after all (gone, damaged): what is stored under an address hashes to it
            digest, checksum = address_and_checksum(raw)
            rewrite = rewrite or damaged.known(self.store.url, digest)
        key = chunk_key(digest)
        if how.encoder:
            encoded = how.encoder(raw, digest)
        else:
            encoded = Encoded(codecs.encode(raw, how.codec, how.itemsize, floating=how.floating))
        if rewrite and encoded.base is not None:
            encoded = Encoded(plain_encoding(raw, itemsize=how.itemsize, floating=how.floating))
        size = sum(memoryview(p).nbytes for p in encoded.parts)
        written = ChunkWrite(
            digest=digest,
            raw_bytes=len(raw),
            stored_bytes=size,
            written=True,
            base=encoded.base,
            base_bytes=encoded.base_bytes,
            checksum=checksum,
            stored_checksum=_stored_checksum(encoded, raw, checksum, private=private),
        )
        if rewrite:
            self.store.replace(key, encoded.parts)
            damaged.repaired(self.store, digest)
            return written
        if self.store.put_if_absent(key, encoded.parts):
            return written
        return self._reuse(digest, self.store.stat(key).size, len(raw), checksum) or self._store(
            raw, digest, checksum, how, rewrite=True, private=private
        )

    def _reuse(self, digest: str, size: int, raw_len: int, checksum: str, stored: str = "") -> ChunkWrite | None:
        """Keep a stored chunk (touching it and any delta base so GC's grace period
        restarts for both); None if it is a delta whose base no longer exists or was proved
        damaged (``damaged``: this save cannot repair a base whose content it may no longer
        hold, but it need not depend on it). ``stored``: the checksum of the object as this
        process stored it (a read checks it still is)."""
        key = chunk_key(digest)
        base = codecs.delta_base(self.store.read_head(key, codecs.HEAD_BYTES))
        base_bytes = 0
        if base is not None:
            if damaged.known(self.store.url, base):
                return None
            try:
                base_bytes = self.store.stat(chunk_key(base)).size
                self.store.touch(chunk_key(base))
            except ObjectNotFoundError:
                return None
        self.store.touch(key)  # restart GC's grace period: this save now uses it
        return ChunkWrite(
            digest=digest,
            raw_bytes=raw_len,
            stored_bytes=size,
            written=False,
            base=base,
            base_bytes=base_bytes,
            checksum=checksum,
            stored_checksum=stored if base is None else "",
        )

    def replace_verified(self, digest: str, size: int, parts: list) -> int:
        """Put ``parts`` (a plain encoding of the chunk's ``size`` raw bytes) in place of
        whatever is stored as ``digest``; their stored size.

        This is how an existing chunk object is rewritten (compaction; a tier that holds
        a chunk in an encoding a checkpoint cannot use): ``parts`` are decoded without a
        base reader, so a delta is refused, and checked against the chunk's address
        before the object is swapped atomically (``Store.replace``). The address is the
        hash of the raw bytes, so every checkpoint sharing the chunk reads the same bytes
        after, and one that needed a base for it merely needs it no longer.
        """
        key = chunk_key(digest)
        blob = b"".join(memoryview(p).cast("B") for p in parts)
        try:
            self._verify(digest, key, codecs.decode(blob, expected=size))
        except CorruptChunkError as e:
            raise CorruptChunkError(
                f"a new encoding of chunk {self.store.url}/{key} does not decode to its content ({e}); "
                "the stored copy was left as it is"
            ) from None
        self.store.replace(key, blob)
        damaged.repaired(self.store, digest)
        return len(blob)

    def reencode(
        self,
        digest: str,
        size: int,
        codec: str,
        *,
        itemsize: int = 1,
        level: int = 3,
        only_if_smaller: bool = False,
        floating: bool = False,
    ) -> tuple[int, int]:
        """Verify then rewrite a chunk with another codec; (bytes before, bytes after).

        With ``only_if_smaller`` a chunk already in ``codec``, or one the codec would not
        shrink, is left alone (after == before): what compaction of a store wants; it is
        verified all the same (a compaction that passed vouches for every chunk). Only
        plain codecs are written here, so compaction never turns a chunk (a base above
        all) into a delta; a delta it rewrites plainly stops needing its base, whose
        reference in the manifests then merely keeps it a little longer.
        """
        blob = self._fetch(digest, size)
        content = self._decoded(digest, blob, size)
        if only_if_smaller and codecs.header_codec(blob) == codec:
            return len(blob), len(blob)
        parts = codecs.encode(content, codec, itemsize, level=level, floating=floating)
        after = sum(len(memoryview(p).cast("B")) for p in parts)
        if only_if_smaller and after >= len(blob):
            return len(blob), len(blob)
        return len(blob), self.replace_verified(digest, size, parts)
