"""ChunkStore's two-pass read: what ``check`` verified is what ``read_checked`` delivers."""

import os

import pytest

from ckptflow.chunks import codecs
from ckptflow.chunks.budget import MemoryBudget
from ckptflow.chunks.io import ChunkStore
from ckptflow.errors import CorruptChunkError
from ckptflow.format.layout import chunk_key
from ckptflow.store import open_store


@pytest.fixture
def chunks(tmp_path):
    return ChunkStore(open_store(str(tmp_path / "store")))


def _put(chunks: ChunkStore, payload: bytes) -> str:
    return chunks.put(memoryview(payload)).digest


def test_local_raw_chunk_is_checked_without_keeping_its_bytes(chunks):
    payload = os.urandom(1 << 16)
    checked = chunks.check(_put(chunks, payload), len(payload))
    assert checked.data is None and checked.version is not None
    out = bytearray(len(payload))
    chunks.read_checked(checked, memoryview(out))
    assert bytes(out) == payload


def test_chunk_corrupted_between_the_passes_is_caught(chunks, tmp_path):
    payload = os.urandom(1 << 16)
    digest = _put(chunks, payload)
    checked = chunks.check(digest, len(payload))
    bad = bytearray(b"".join(bytes(p) for p in codecs.encode(payload)))
    bad[-1] ^= 0xFF
    chunks.store.replace(chunk_key(digest), bytes(bad))  # a new file: its version differs
    with pytest.raises(CorruptChunkError, match="does not match its address"):
        chunks.read_checked(checked, memoryview(bytearray(len(payload))))


def test_chunk_reencoded_between_the_passes_still_reads(chunks):
    payload = bytes(range(256)) * 256
    digest = _put(chunks, payload)
    checked = chunks.check(digest, len(payload))
    chunks.reencode(digest, len(payload), "zstd")
    out = bytearray(len(payload))
    chunks.read_checked(checked, memoryview(out))
    assert bytes(out) == payload


def test_encoded_chunk_keeps_its_verified_bytes_for_the_second_pass(chunks):
    payload = bytes(1 << 16)
    digest = chunks.put(memoryview(payload), codec="zstd").digest
    checked = chunks.check(digest, len(payload))
    assert checked.data is not None and bytes(checked.data) == payload


def test_check_fails_on_a_flipped_byte(chunks, tmp_path):
    payload = os.urandom(4096)
    digest = _put(chunks, payload)
    path = tmp_path / "store" / chunk_key(digest)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 1
    path.write_bytes(bytes(blob))
    with pytest.raises(CorruptChunkError):
        chunks.check(digest, len(payload))


def _budgeted(chunks: ChunkStore, total: int) -> ChunkStore:
    return chunks.scoped({}, budget=MemoryBudget(total))


def test_encoded_chunks_beyond_the_budget_are_dropped_and_decoded_again(chunks):
    payloads = [bytes([i]) * (1 << 16) for i in range(4)]
    digests = [chunks.put(memoryview(p), codec="zstd").digest for p in payloads]
    budgeted = _budgeted(chunks, 2 * (1 << 16))  # keeps one 64 KiB chunk
    checked = [budgeted.check(d, 1 << 16) for d in digests]
    assert [c.data is not None for c in checked] == [True, False, False, False]
    assert all(c.again for c in checked[1:])
    for c, payload in zip(checked, payloads):
        out = bytearray(1 << 16)
        budgeted.read_checked(c, memoryview(out))
        assert bytes(out) == payload
    assert budgeted.budget is not None and budgeted.budget.peak <= 2 * (1 << 16)


def test_a_dropped_chunk_damaged_before_the_second_pass_is_caught(chunks):
    payload = bytes(range(256)) * 256
    digest = chunks.put(memoryview(payload), codec="zstd").digest
    checked = _budgeted(chunks, 0).check(digest, len(payload))
    assert checked.again and checked.data is None
    bad = bytearray(b"".join(bytes(p) for p in codecs.encode(payload)))
    bad[-1] ^= 0xFF
    chunks.store.replace(chunk_key(digest), bytes(bad))
    with pytest.raises(CorruptChunkError, match="does not match its address"):
        _budgeted(chunks, 0).read_checked(checked, memoryview(bytearray(len(payload))))


def test_a_chunk_a_save_trusted_but_must_write_anew_is_stored_under_the_hash_of_its_bytes(chunks):
    """An incremental save passes the previous save's digest for bytes it did not read (the
    kernel vouched for them). Where the chunk must be written after all (gone since), the
    bytes written are hashed: an address only ever names bytes that hash to it."""
    before, now = os.urandom(4096), os.urandom(4096)
    known = chunks.put(memoryview(before))
    chunks.store.delete(chunk_key(known.digest))  # gone since (GC, or a user)
    written = chunks.put(memoryview(now), digest=known.digest, checksum=known.checksum, known=known)
    assert written.written and written.digest != known.digest
    assert bytes(chunks.get(written.digest, len(now))) == now
    assert not chunks.store.exists(chunk_key(known.digest))
