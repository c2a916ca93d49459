"""Damage records: a chunk object a reader refused is recorded in the store, so that saves
in any process write it anew instead of keeping it (``ckptflow.chunks.damaged``)."""

import logging
import os

import pytest
import torch

from ckptflow import Checkpointer, gc, lifecycle
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


def _refused(chunks: ChunkStore, digest: str, size: int) -> None:
    """A read of the chunk, which refuses it (and records that)."""
    with pytest.raises(CorruptChunkError):
        chunks.get(digest, size)


def test_a_refused_chunk_is_recorded_and_a_save_that_reuses_it_repairs_it(chunks, tmp_path):
    payload = os.urandom(4096)
    write = _rotten(chunks, tmp_path, payload)
    _refused(chunks, write.digest, len(payload))
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

    monkeypatch.setattr(chunks.store, "replace", refuse)
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
        _refused(chunks, digest, size)
    os.remove(chunk_path(tmp_path / "store", swept.digest))
    report = gc(chunks.store, grace=0)
    assert {key for key, _ in report.deleted} == {fmt.damaged_key(swept.digest)}
    assert set(damaged.records(chunks.store)) == {referenced}  # still damaged: the next save of it repairs it


def test_a_record_the_saver_may_not_delete_costs_one_rewrite_until_the_chunk_is_found_damaged_again(
    chunks, tmp_path, monkeypatch
):
    payload = os.urandom(4096)
    write = _rotten(chunks, tmp_path, payload)
    _refused(chunks, write.digest, len(payload))  # another user's verify: its record
    saver = ChunkStore(open_store(str(tmp_path / "store")))

    def denied(key):
        raise PermissionError(13, "Permission denied", key)

    monkeypatch.setattr(saver.store, "delete", denied)
    damaged.load(saver.store)
    assert saver.put(memoryview(payload), known=write).written  # repaired; the record stays
    damaged.load(saver.store)
    assert not saver.put(memoryview(payload), known=write).written  # not for that record again
    flip_byte(chunk_path(tmp_path / "store", write.digest), -1)
    _refused(chunks, write.digest, len(payload))  # rotten again, found again: the record is renewed
    damaged.load(saver.store)
    assert saver.put(memoryview(payload), known=write).written
    assert bytes(saver.get(write.digest, len(payload))) == payload


def test_a_save_whose_store_hides_the_records_goes_on_and_says_why(tmp_path, caplog, monkeypatch):
    root = str(tmp_path / "store")
    with Checkpointer(root, "r", chunk_bytes=1024) as ck:
        real_list = ck.store.list

        def denied(prefix, **kwargs):
            if prefix == fmt.DAMAGED_PREFIX:
                raise PermissionError(13, "Permission denied", os.path.join(root, prefix))
            return real_list(prefix, **kwargs)

        monkeypatch.setattr(ck.store, "list", denied)
        with caplog.at_level(logging.WARNING, logger="ckptflow"):
            ck.save(1, {"w": torch.randn(1024)}, rng=False)
    assert "damage records" in caplog.text and "cannot be listed" in caplog.text and "Permission denied" in caplog.text
    assert Checkpointer(root, "r").verify(1, deep=True).ok


def test_scrub_keeps_what_it_found_when_the_records_cannot_be_counted(tmp_path, monkeypatch):
    root = str(tmp_path / "store")
    with Checkpointer(root, "r", chunk_bytes=1024) as ck:
        ck.save(1, {"w": torch.randn(1024)}, rng=False)
        victim = sorted(catalog.read_manifest(ck.store, "r", 1).chunks)[0]
    flip_byte(chunk_path(root, victim), -1)
    store = open_store(root)
    real_list = store.list

    def outage(prefix, **kwargs):
        if prefix == fmt.DAMAGED_PREFIX:
            raise StoreUnavailableError("ListObjectsV2 damaged/: SlowDown, retries exhausted")
        return real_list(prefix, **kwargs)

    monkeypatch.setattr(store, "list", outage)
    report = lifecycle.scrub(store, older_than_s=0)
    assert [(run, step) for run, step, _ in report.corrupt] == [("r", 1)]
    assert report.damaged_chunks is None and "SlowDown" in report.records_error
    assert report.unreadable == []  # every checkpoint was read: nothing to retry


def test_a_save_forgets_a_record_another_process_repaired_and_deleted(chunks, tmp_path):
    payload = os.urandom(4096)
    write = _rotten(chunks, tmp_path, payload)
    _refused(chunks, write.digest, len(payload))
    trainer = open_store(str(tmp_path / "store"))
    damaged.load(trainer)
    assert damaged.known(trainer.url, write.digest)
    trainer.delete(fmt.damaged_key(write.digest))  # another process repaired the chunk, and the record went
    damaged.load(trainer)
    assert not damaged.known(trainer.url, write.digest)  # no second rewrite for it here
