"""Damage records: a chunk object a reader refused is recorded in the store, so that saves
in any process write it anew instead of keeping it (``ckptflow.chunks.damaged``)."""

import logging
import os

import pytest
import torch

from ckptflow import Checkpointer, gc
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import damaged
from ckptflow.chunks.io import ChunkStore, ChunkWrite
from ckptflow.errors import CorruptChunkError, StoreUnavailableError
from ckptflow.format import layout as fmt
from ckptflow.store import open_store
from support.corrupt import chunk_path, flip_byte


@pytest.fixture
def chunks(tmp_path):
    return ChunkStore(open_store(str(tmp_path / "store")))


def _rotten(chunks: ChunkStore, tmp_path, payload: bytes) -> ChunkWrite:
    write = chunks.put(memoryview(payload))
    flip_byte(chunk_path(tmp_path / "store", write.digest), -1)
    return write


def test_a_refused_chunk_is_recorded_and_a_save_that_reuses_it_repairs_it(chunks, tmp_path):
    payload = os.urandom(4096)
    write = _rotten(chunks, tmp_path, payload)
    with pytest.raises(CorruptChunkError):
        chunks.get(write.digest, len(payload))
    assert set(damaged.records(chunks.store)) == {write.digest}
    saver = ChunkStore(open_store(str(tmp_path / "store")))
    damaged.load(saver.store)
    again = saver.put(memoryview(payload), known=write)  # an incremental save's reuse, as it would be
    assert again.written and bytes(saver.get(write.digest, len(payload))) == payload
    assert damaged.records(saver.store) == {}
    assert not damaged.known(saver.store.url, write.digest)


def test_a_store_that_cannot_take_the_record_still_gets_the_damage_reported(chunks, tmp_path, caplog, monkeypatch):
    payload = os.urandom(4096)
    write = _rotten(chunks, tmp_path, payload)

    def refuse(key, data):
        raise StoreUnavailableError(f"{key}: read-only credentials")

    monkeypatch.setattr(chunks.store, "put_if_absent", refuse)
    with caplog.at_level(logging.WARNING, logger="ckptflow"), pytest.raises(CorruptChunkError, match="address"):
        chunks.get(write.digest, len(payload))
    assert "could not record it" in caplog.text and "read-only credentials" in caplog.text
    assert damaged.known(chunks.store.url, write.digest)  # this process still writes it anew


def test_gc_deletes_the_records_of_chunks_no_longer_stored_and_keeps_those_awaiting_repair(chunks, tmp_path):
    with Checkpointer(str(tmp_path / "store"), "r", chunk_bytes=1024) as ck:
        ck.save(1, {"w": torch.randn(1024)}, rng=False)
        referenced = sorted(catalog.read_manifest(ck.store, "r", 1).chunks)[0]
    flip_byte(chunk_path(tmp_path / "store", referenced), -1)
    gone = os.urandom(4096)
    swept = _rotten(chunks, tmp_path, gone)
    for digest, size in ((referenced, 1024), (swept.digest, len(gone))):
        with pytest.raises(CorruptChunkError):
            chunks.get(digest, size)
    os.remove(chunk_path(tmp_path / "store", swept.digest))
    report = gc(chunks.store, grace=0)
    assert {key for key, _ in report.deleted} == {fmt.damaged_key(swept.digest)}
    assert set(damaged.records(chunks.store)) == {referenced}  # still damaged: the next save of it repairs it
