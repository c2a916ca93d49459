"""Verified chunk reads: what restore, verify and export read chunks with.

Split from ``ckptflow.chunks.io`` (whose ``ChunkStore`` adds writes on top of this
``ChunkReader``) because reading is its own protocol: a chunk is verified against its
address, the fast checksum the manifest records, or (an encoded chunk beyond the memory
budget) the checksum of its stored bytes, before anything is written from it (restore's
first pass, ``check``), then read or decoded into place and checked there
(``read_checked``), or read and verified in one pass (``read_verified``); delta bases are
resolved only among the chunks of the manifest being read, and decoded bytes are bounded
by the restore's memory budget.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import xxhash

from ckptflow.chunks import codecs, damaged, undecodable
from ckptflow.chunks.budget import MemoryBudget
from ckptflow.chunks.streaming import CheckedChunk, FirstPass, NotRaw, PayloadHash, Skipping
from ckptflow.errors import CorruptChunkError, ObjectNotFoundError, ObjectTooLargeError
from ckptflow.format.checksum import ADDRESS, ADDRESSES, FastChecksum, address_hasher, fast_checksum, matches_address
from ckptflow.format.layout import chunk_key
from ckptflow.store.base import Store

SCAN_PIECE = 1 << 20  # stays in L2 between read and hash; 8 threads hold 8 MiB of them in all
SCRATCH_MAX = 16 << 20  # the largest chunk a thread decodes into a buffer it keeps for the next
# Decoding is CPU work: a restore's I/O threads outnumber the cores, and more of them decoding
# at once than there are cores only evict each other's planes from the cache (1 GiB of zstd
# chunks on 2 cores: 2.9 s with 8 threads decoding, 1.6 s with 2). Held for the decode and
# its check only, never across a read (a delta's base is fetched first), never nested.
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_DECODING = threading.BoundedSemaphore(CORES)


class ChunkReader:
    """Get verified chunks. Thread-safe; callers parallelise across chunks."""

    def __init__(
        self,
        store: Store,
        *,
        scope: Mapping[str, int] | None = None,
        checksums: Mapping[str, str] | None = None,
        stored_checksums: Mapping[str, str] | None = None,
        address: str | None = None,
        budget: MemoryBudget | None = None,
    ):
        self.store = store
        self.budget = budget  # bounds the decoded chunks a two-pass read holds (``ckptflow.chunks.budget``)
        self.scope = scope  # the chunks of one manifest: the only delta bases a read may use
        self.checksums = checksums or {}  # digest -> fast checksum: what reads are checked against
        self.stored_checksums = stored_checksums or {}  # digest -> checksum of the object as stored (first pass)
        self.address = address  # the manifest's kind of address: tried first (``checksum.matches_address``)
        self._local = threading.local()  # per-thread scratch buffers for ``check``
        self._saved_wrongly = undecodable.Listing(store)  # listed on first need

    def get(self, digest: str, size: int) -> memoryview:
        """Raw bytes of a chunk the manifest says holds ``size`` raw bytes, verified against
        its address. The object's size and its header are checked against ``size`` before
        it is read or decompressed, so a damaged or hostile chunk cannot make the reader
        allocate more than the manifest promised."""
        return self._decoded(digest, self._fetch(digest, size), size)

    def read_stored(self, digest: str, size: int) -> tuple[bytes, memoryview]:
        """A chunk as stored and its raw bytes, verified as ``get`` verifies them: what a
        copy into another tier uploads, once it is known to be sound."""
        blob = self._fetch(digest, size)
        return blob, self._decoded(digest, blob, size)

    def _fetch(self, digest: str, size: int) -> bytes:
        key = chunk_key(digest)
        try:
            return self.store.get_bounded(key, codecs.max_encoded_size(size))
        except ObjectNotFoundError:
            raise self._missing(digest, key) from None
        except ObjectTooLargeError as e:
            raise self._too_large(digest, e, size) from None

    def _too_large(self, digest: str, error: ObjectTooLargeError, size: int) -> CorruptChunkError:
        return self._damage(digest, f"chunk {error} (the manifest says {size} raw bytes)")

    def _damage(self, digest: str, message: str) -> CorruptChunkError:
        """``message``, the damage of chunk object ``digest``, once noted (``damaged``)."""
        damaged.note(self.store, digest, message)
        return CorruptChunkError(message)

    def _decoded(self, digest: str, blob: bytes, size: int, *, out: memoryview | None = None) -> memoryview:
        """``blob`` decoded (into ``out`` if given) and verified against ``digest``. An
        object refused here is noted and recorded (``damaged``), so no save reuses it."""
        try:
            return self._decode_verified(digest, blob, size, out)
        except CorruptChunkError as e:
            damaged.note(self.store, digest, str(e))
            raise

    def _decode_verified(self, digest: str, blob: bytes, size: int, out: memoryview | None) -> memoryview:
        key = chunk_key(digest)
        # checked as it is decoded, each piece while it is in the CPU cache (``codecs.decode``)
        check = FastChecksum() if digest in self.checksums else None
        try:
            named = codecs.delta_base(blob)
            bases = {named: self._base_blob(named, size)} if named is not None else {}
            with _DECODING:
                raw = codecs.decode(
                    blob,
                    expected=size,
                    base=lambda d, n: bases.get(d) or self._base_blob(d, n),
                    out=out,
                    consume=check.update if check else None,
                )
        except CorruptChunkError as e:
            raise CorruptChunkError(f"chunk {self.store.url}/{key}: {e}") from None
        if len(raw) != size:
            raise CorruptChunkError(f"chunk {self.store.url}/{key} holds {len(raw)} bytes, the manifest expects {size}")
        try:
            with _DECODING:
                self._verify(digest, key, raw, computed=check.hexdigest() if check else None)
        except CorruptChunkError:
            base = codecs.delta_base(blob)
            if base is not None:  # a bad base makes bad bytes: say so if that is the cause
                try:
                    self.base_raw(base, len(raw))
                except CorruptChunkError as e:
                    raise CorruptChunkError(f"chunk {self.store.url}/{key}: {e}") from None
            raise
        return raw

    def _base_blob(self, digest: str, size: int) -> bytes:
        """A delta's base as stored: listed by the manifest being read (if scoped), present.
        Its bytes are checked through the delta's own address (``codecs.decode``)."""
        if self.scope is not None and self.scope.get(digest) != size:
            raise CorruptChunkError(
                f"its delta base {digest[:16]}… ({size} bytes) is not among the chunks the manifest lists"
            )
        try:
            return self.store.get_bounded(chunk_key(digest), codecs.max_encoded_size(size))
        except ObjectNotFoundError:
            raise CorruptChunkError(f"its delta base {self.store.url}/{chunk_key(digest)} is missing") from None
        except ObjectTooLargeError as e:
            raise self._damage(digest, f"its delta base {e} (the delta needs {size} raw bytes)") from None

    def base_raw(self, digest: str, size: int) -> tuple[memoryview, int]:
        """A delta base's raw bytes, verified, and its stored size: what a delta is computed
        against. A base is never itself a delta: it is decoded without a base reader, so
        a delta there is refused. A base refused is noted (``damaged``), whoever asked: a
        restore whose delta it broke, or a save computing a delta on it."""
        key = chunk_key(digest)
        blob = self._base_blob(digest, size)
        try:
            raw = codecs.decode(blob, expected=size)
            if len(raw) != size:
                raise CorruptChunkError(f"holds {len(raw)} bytes, the delta needs {size}")
            self._verify(digest, key, raw)
        except CorruptChunkError as e:
            damaged.note(self.store, digest, str(e))
            raise CorruptChunkError(f"its delta base is unusable: {e}") from None
        return raw, len(blob)

    def check(self, digest: str, size: int) -> CheckedChunk:
        """Verify a chunk before anything is written from it (restore's first pass).

        A raw chunk on a store that re-reads cheaply (``Store.cheap_reread``) is streamed
        through a small per-thread buffer into its payload's fast checksum; only its file
        version is kept. Any other chunk is decoded and verified, and kept decoded for the
        second pass while it fits the memory budget; one that does not fit is checked
        against the checksum of its stored bytes the manifest records, streamed past on
        such a store, as fetched on others (not decoded: the second pass decodes it once,
        into place, and checks it there), else decoded and dropped (decoded again there). Stored bytes that match
        yet do not decode to their content were saved wrongly: the second pass raises and
        records it in the store (``ckptflow.chunks.undecodable``), and every restore after
        it decodes that chunk here, so it falls back past it. Any anomaly goes through ``get``, which names it.
        """
        kept = None  # whether the budget has room to keep this chunk decoded (None: not asked yet)
        try:
            if self.store.cheap_reread:
                stored = self.stored_checksums.get(digest)
                if stored is not None:
                    kept = self._keep(size)
                # an encoded chunk decoded now (kept, or found saved wrongly: one that does not
                # decode rejects the checkpoint cleanly) is fetched once, not streamed past first
                if stored is None or not (kept or self._decode_first(digest, stored)):
                    checked = self._scan_check(digest, size, stored)
                    if checked is not None:
                        return checked
            with self._room(size):
                if kept is None:
                    kept = self._keep(size)
                if kept:
                    return CheckedChunk(digest, size, data=self.get(digest, size))
                blob = self._fetch(digest, size)
                if not self.store.cheap_reread and self._as_stored(digest, size, blob):
                    return CheckedChunk(digest, size, again=True, as_stored=True)  # decoded once, in pass two
                # not kept: decoded into a reused buffer, verified, and decoded again in pass two
                self._decoded(digest, blob, size, out=self._decode_buffer(size))
            return CheckedChunk(digest, size, again=True)
        except BaseException:
            if kept:
                self._release(size)
            raise

    def _scan_check(self, digest: str, size: int, stored: str | None) -> CheckedChunk | None:
        """``check`` of a chunk streamed past (``FirstPass``): a raw chunk by its payload's
        fast checksum, an encoded one by ``stored``, the checksum of its stored bytes; None
        for any other chunk, or any mismatch (decoding it then decides)."""
        scan = FirstPass(size, self._hasher(digest), stored)
        try:
            got, version = self.store.scan(
                chunk_key(digest), self._scratch(SCAN_PIECE), scan.update, limit=codecs.max_encoded_size(size)
            )
        except ObjectNotFoundError:
            raise self._missing(digest, chunk_key(digest)) from None
        except ObjectTooLargeError as e:
            raise self._too_large(digest, e, size) from None
        except NotRaw:
            return None
        if scan.as_stored is not None:
            return (
                CheckedChunk(digest, size, again=True, as_stored=True) if scan.as_stored.hexdigest() == stored else None
            )
        if (
            got == codecs.HEADER.size + size
            and codecs.raw_length(scan.header) == size
            and scan.payload.hexdigest() == self.checksums.get(digest, digest)
        ):
            return CheckedChunk(digest, size, version=version)
        return None

    def _as_stored(self, digest: str, size: int, blob: bytes) -> bool:
        """Whether a fetched chunk is, byte for byte, the object its saver stored (the
        manifest's stored checksum; never for a chunk this process found saved wrongly)."""
        stored = self.stored_checksums.get(digest)
        if (
            stored is None
            or self._decode_first(digest, stored)
            or not codecs.checkable_as_stored(blob[: codecs.HEADER.size], size)
        ):
            return False
        return xxhash.xxh3_128_hexdigest(blob) == stored

    def _decode_first(self, digest: str, stored: str) -> bool:
        """Whether this chunk object was found saved wrongly (``undecodable``): then it is
        decoded in pass one. The store's records are listed once per reader; a listing that
        failed (an outage: the restore stops) is not tried again for every chunk."""
        return (digest, stored) in self._saved_wrongly

    def _keep(self, size: int) -> bool:
        return self.budget is None or self.budget.keep(size)

    def _release(self, size: int) -> None:
        if self.budget is not None:
            self.budget.release(size)

    def _decode_buffer(self, size: int) -> memoryview:
        """Where a chunk that is verified and then dropped is decoded: this thread's buffer
        (no fresh pages to fault in per chunk), or a new one for a chunk over ``SCRATCH_MAX``
        (a thread never holds more than that between chunks)."""
        if size > SCRATCH_MAX:
            return memoryview(bytearray(size))
        buf = getattr(self._local, "decode", None)
        if buf is None or len(buf) < size:
            buf = self._local.decode = bytearray(size)
        return memoryview(buf)[:size]

    def _room(self, size: int) -> Any:
        """Room in the memory budget for one chunk of ``size`` raw bytes being decoded."""
        return self.budget.in_flight(size) if self.budget is not None else nullcontext()

    def read_checked(self, checked: CheckedChunk, out: memoryview) -> None:
        """Fill ``out`` with a chunk ``check`` verified.

        A raw chunk is read straight into ``out`` piece by piece, and each piece is
        checked while it is still in the CPU cache against the xxh3-128 half of the fast
        checksum the manifest records (``check`` verified the file against the whole of
        it), so this pass costs about one read of the bytes, not a read and a second trip
        to memory. A file changed since (another version), or bytes that do not match,
        are read again through ``get``, which verifies them in full or raises. A chunk
        kept decoded is copied; any other is decoded into ``out`` and verified there."""
        out = memoryview(out).cast("B")
        if checked.data is not None:
            out[:] = checked.data
            return
        if checked.as_stored:
            self._decode_as_stored(checked.digest, out)
            return
        if checked.again:
            self._get_into(checked.digest, out)
            return
        expected = self.checksums.get(checked.digest)
        content = PayloadHash(codecs.HEADER.size) if expected is not None else None
        whole, version = self._raw_into(checked.digest, out, content.update if content else None)
        if version != checked.version or not whole or (content is not None and not content.matches(expected)):
            self._get_into(checked.digest, out)  # replaced or damaged since: verify again

    def read_verified(self, digest: str, size: int, out: memoryview) -> None:
        """Fill ``out`` with a chunk no first pass has checked, verifying it as it lands
        (a single-pass restore): a raw chunk on a store that re-reads cheaply is read
        straight into ``out``, each piece checked with the whole fast checksum (or the
        address) while it is in the CPU cache; anything else is decoded into ``out`` and
        verified there (``get``'s checks). Damage raises ``CorruptChunkError`` with
        ``out`` already (partly) overwritten: that is what a single pass gives up."""
        out = memoryview(out).cast("B")
        if len(out) != size:
            raise ValueError(f"chunk {digest[:16]}… holds {size} bytes, not the {len(out)} to fill")
        if self.store.cheap_reread:
            hasher = Skipping(codecs.HEADER.size, self._hasher(digest))
            whole, _version = self._raw_into(digest, out, hasher.update)
            if whole and hasher.inner.hexdigest() == self.checksums.get(digest, digest):
                return
        self._get_into(digest, out)  # encoded, remote, or not what was expected: decode, verify or raise

    def _raw_into(self, digest: str, out: memoryview, consume: Any) -> tuple[bool, Any]:
        """Read chunk ``digest`` straight into ``out`` as a raw chunk, its header aside, each
        piece passed to ``consume``: whether it was one whole raw chunk of ``len(out)``
        bytes, and the file version read. An I/O error answers (False, None): the caller
        reads it again through ``get``; a missing chunk is damage."""
        header = bytearray(codecs.HEADER.size)
        try:
            got, version = self.store.get_into(chunk_key(digest), [header, out], consume=consume)
        except ObjectNotFoundError:
            raise self._missing(digest, chunk_key(digest)) from None
        except OSError:
            return False, None
        return got == len(header) + len(out) and codecs.raw_length(header) == len(out), version

    def _decode_as_stored(self, digest: str, out: memoryview) -> None:
        """Decode into ``out`` a chunk pass one checked by its stored bytes, and verify it.
        If the bytes fetched now are still those its saver stored, yet do not decode to the
        content, they were saved wrongly: that is recorded (``undecodable.record``), and every
        restore after it decodes that object in pass one, so it falls back past it. Bytes
        changed since pass one (damage, a rewrite) are refused or accepted by their content,
        as any chunk's."""
        stored = self.stored_checksums.get(digest, "")
        with self._room(len(out)):
            blob = self._fetch(digest, len(out))
            try:
                self._decoded(digest, blob, len(out), out=out)
            except CorruptChunkError as e:
                if xxhash.xxh3_128_hexdigest(blob) != stored:  # changed since pass one: reported as it is
                    raise
                undecodable.record(self.store, digest, stored, str(e))
                raise CorruptChunkError(
                    f"{e}; its stored bytes are as they were saved, so they were saved wrongly "
                    "(recorded: a restore again decodes it before writing anything, and falls back past it)"
                ) from None

    def _get_into(self, digest: str, out: memoryview) -> None:
        """``out`` filled as ``get`` fills a buffer, decoded straight into it and verified
        there, within the memory budget. Only the second pass calls this: a chunk that
        fails here leaves ``out`` partly written, as that pass's failures do."""
        with self._room(len(out)):
            self._decoded(digest, self._fetch(digest, len(out)), len(out), out=out)

    def _scratch(self, size: int) -> memoryview:
        buf = getattr(self._local, "scratch", None)
        if buf is None or len(buf) < size:
            buf = self._local.scratch = bytearray(size)
        return memoryview(buf)[:size]

    def _missing(self, digest: str, key: str) -> CorruptChunkError:
        return CorruptChunkError(f"chunk {digest[:16]}… is missing from {self.store.url}/{key}")

    def _hasher(self, digest: str) -> Any:
        """What a read of ``digest`` is checked with: its fast checksum if the manifest
        records one, else its address (``hexdigest`` compares to either)."""
        return FastChecksum() if digest in self.checksums else address_hasher(self.address or ADDRESS)

    def _verify(self, digest: str, key: str, raw: memoryview | bytes, *, computed: str | None = None) -> None:
        """Raise unless ``raw`` is chunk ``digest``: by the fast checksum its manifest records
        (``computed`` if its caller computed it as the bytes were decoded), else its address."""
        expected = self.checksums.get(digest)
        if expected is not None:
            actual = computed if computed is not None else fast_checksum(raw)
            if actual != expected:
                raise CorruptChunkError(
                    f"chunk {self.store.url}/{key} does not match its address (its content fails the fast "
                    f"checksum the manifest records: {actual[:16]}…, expected {expected[:16]}…)"
                )
            return
        if not matches_address(digest, raw, self.address):
            raise CorruptChunkError(
                f"chunk {self.store.url}/{key} does not match its address (neither the "
                f"{' nor the '.join(ADDRESSES)} of its content)"
            )
