"""ChunkStore's two-pass read: what ``check`` verified is what ``read_checked`` delivers."""

import os

import pytest

from ckptflow.chunks import codecs
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
