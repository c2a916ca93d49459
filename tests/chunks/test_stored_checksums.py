"""An encoded chunk that does not fit a restore's memory budget is verified in the first
pass by the checksum of its stored bytes (``stored_checksums`` in the manifest), so the
second pass decodes it once instead of decoding it in both passes.

What that checksum proves is only that the object is the one its saver stored: a chunk
rewritten since (compaction) or a manifest without the field is verified by decoding, as
before, and a wrong checksum is never taken for damage. Damage to the stored bytes is
refused before any tensor is written (tests/format/test_fast_checksum.py flips every
kind of byte with and without a budget); the one case the first pass no longer covers, a
decoder failing on bytes exactly as stored, leaves a partly written state, said so.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import xxhash

from ckptflow import Checkpointer, PartialRestoreError, StoreUnavailableError
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import codecs, undecodable
from ckptflow.chunks import io as io_module
from ckptflow.chunks.io import ChunkStore
from ckptflow.format.checksum import STORED_FIELD
from ckptflow.format.layout import undecodable_key
from ckptflow.store import open_store
from support.corrupt import chunk_path, flip_byte, reseal_manifest
from support.decode_count import count_decodes
from support.states import DRIFT_CHUNK, assert_tensors_equal, blank_like, drifting_state

RUN = "stored"


def _save(root: str, codec: str, steps=(1, 2)) -> None:
    with Checkpointer(root, RUN, codec=codec, chunk_bytes=DRIFT_CHUNK) as ck:
        for step in steps:
            ck.save(step, drifting_state(step), kind="full" if step == 1 else "incremental")


def _restore_counting(root: str, calls: list[str], *, budget: int, single_pass: bool = False) -> list[str]:
    calls.clear()
    target = blank_like(drifting_state(2))
    with Checkpointer(root, RUN, restore_buffer_bytes=budget) as ck:
        assert ck.restore(target, single_pass=single_pass).step == 2
    assert_tensors_equal(drifting_state(2), target)
    return sorted(calls)


@pytest.mark.parametrize("codec", ["zstd", "auto"])
def test_a_save_records_the_checksum_of_each_encoded_object_it_stored(ckpt_store_dir, codec):
    """Full and incremental saves alike (the incremental reuses most chunks through what
    the previous save of this process stored): every chunk a tensor reads that is stored
    encoded, not as a delta, has the xxh3-128 of its file; raw chunks and deltas have
    none (nor do chunks listed only as a delta's base: no tensor reads them directly)."""
    _save(ckpt_store_dir, codec)
    store = open_store(ckpt_store_dir)
    for step in (1, 2):
        manifest = catalog.read_manifest(store, RUN, step)
        read = {d for item in manifest.items() for d, _ in item.chunks}
        blobs = {d: chunk_path(ckpt_store_dir, d).read_bytes() for d in read}
        encoded = {d for d, blob in blobs.items() if codecs.header_codec(blob) not in ("raw", "delta")}
        assert encoded and set(manifest.stored_checksums) == encoded
        for digest, recorded in manifest.stored_checksums.items():
            assert recorded == xxhash.xxh3_128_hexdigest(blobs[digest])
        if codec == "auto" and step == 2:
            assert manifest.bases and not set(manifest.bases) & set(manifest.stored_checksums)


def test_a_raw_save_records_none(ckpt_store_dir):
    _save(ckpt_store_dir, "raw", steps=(1,))
    manifest = catalog.read_manifest(open_store(ckpt_store_dir), RUN, 1)
    assert not manifest.stored_checksums and STORED_FIELD not in manifest.to_json()


def test_two_passes_decode_each_encoded_chunk_once_whether_or_not_it_fits_the_budget(ckpt_store_dir, monkeypatch):
    _save(ckpt_store_dir, "zstd")
    calls = count_decodes(monkeypatch)
    once = _restore_counting(ckpt_store_dir, calls, budget=0, single_pass=True)  # one decode per place
    assert once
    assert _restore_counting(ckpt_store_dir, calls, budget=0) == once  # verified as stored, decoded in place
    kept = _restore_counting(ckpt_store_dir, calls, budget=64 << 20)  # decoded and kept in pass one
    assert kept == sorted(set(once))  # a chunk in two places is copied from what was kept

    def forget(record: dict) -> None:  # a manifest written before the field existed
        record.pop(STORED_FIELD)

    reseal_manifest(ckpt_store_dir, RUN, 2, forget)
    twice = _restore_counting(ckpt_store_dir, calls, budget=0)
    assert Counter(twice) == Counter(once) + Counter(set(once))  # decoded to verify, then again into place


def test_a_chunk_rewritten_since_its_save_is_verified_by_decoding_it(ckpt_store_dir, monkeypatch):
    """Compaction swaps a chunk's object for another encoding of the same bytes: the
    recorded checksum no longer fits, which is not damage; the chunk is decoded to be
    verified, and restores exactly."""
    _save(ckpt_store_dir, "zstd", steps=(1,))
    store = open_store(ckpt_store_dir)
    manifest = catalog.read_manifest(store, RUN, 1)
    digest = max(manifest.stored_checksums, key=lambda d: manifest.chunks[d])
    before = chunk_path(ckpt_store_dir, digest).read_bytes()
    ChunkStore(store).reencode(digest, manifest.chunks[digest], "zstd", itemsize=1, level=5)
    assert chunk_path(ckpt_store_dir, digest).read_bytes() != before
    calls = count_decodes(monkeypatch)
    target = blank_like(drifting_state(1))
    with Checkpointer(ckpt_store_dir, RUN, restore_buffer_bytes=0) as ck:
        assert ck.restore(target).step == 1
    assert_tensors_equal(drifting_state(1), target)
    places = sum(d == digest for item in manifest.items() for d, _ in item.chunks)
    assert Counter(calls)[digest] == 1 + places  # decoded to verify it, then into each place


def test_a_wrong_recorded_checksum_makes_the_chunk_decoded_never_damaged(ckpt_store_dir):
    _save(ckpt_store_dir, "zstd", steps=(1,))
    manifest = catalog.read_manifest(open_store(ckpt_store_dir), RUN, 1)

    def wrong(record: dict) -> None:
        for digest in record[STORED_FIELD]:
            record[STORED_FIELD][digest] = "0" * 32

    reseal_manifest(ckpt_store_dir, RUN, 1, wrong)
    target = blank_like(drifting_state(1))
    with Checkpointer(ckpt_store_dir, RUN, restore_buffer_bytes=0) as ck:
        assert ck.restore(target).step == 1 and ck.verify(1).ok
    assert_tensors_equal(drifting_state(1), target)
    assert manifest.stored_checksums  # there were checksums to get wrong


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda record, digest: record[STORED_FIELD].__setitem__(digest, "not hex"), "malformed stored checksum"),
        (lambda record, digest: record.__setitem__(STORED_FIELD, ["x"]), "not an object"),
    ],
    ids=["malformed", "not a mapping"],
)
def test_a_malformed_record_of_stored_checksums_is_a_bad_manifest(ckpt_store_dir, mutate, message):
    from ckptflow import ManifestError

    _save(ckpt_store_dir, "zstd", steps=(1,))
    digest = next(iter(catalog.read_manifest(open_store(ckpt_store_dir), RUN, 1).stored_checksums))
    reseal_manifest(ckpt_store_dir, RUN, 1, lambda record: mutate(record, digest))
    with pytest.raises(ManifestError, match=message):
        catalog.read_manifest(open_store(ckpt_store_dir), RUN, 1)


def test_stored_checksums_of_chunks_not_listed_or_listed_as_deltas_are_dropped(ckpt_store_dir):
    """As a ckptflow from before the field leaves them in a copy it makes of the record
    (a lossy archive copy keeps the fields it does not know): the copy stays readable,
    and restores."""
    _save(ckpt_store_dir, "auto")
    manifest = catalog.read_manifest(open_store(ckpt_store_dir), RUN, 2)
    delta = next(iter(manifest.bases))

    def foreign(record: dict) -> None:
        record[STORED_FIELD].update({"f" * 64: "0" * 32, delta: "0" * 32})

    reseal_manifest(ckpt_store_dir, RUN, 2, foreign)
    reread = catalog.read_manifest(open_store(ckpt_store_dir), RUN, 2)
    assert reread.stored_checksums == manifest.stored_checksums
    target = blank_like(drifting_state(2))
    with Checkpointer(ckpt_store_dir, RUN, restore_buffer_bytes=0) as ck:
        assert ck.restore(target).step == 2
    assert_tensors_equal(drifting_state(2), target)


def test_a_decoder_failing_on_bytes_as_stored_says_partly_written_once_then_falls_back(tmp_path, monkeypatch):
    """The stored checksum proves the object is what its saver wrote, not that it decodes
    to the content: within the budget a chunk is decoded in the first pass and the restore
    falls back to the older checkpoint; beyond it, the failure is met while tensors are
    written, said so (naming the chunk) and recorded in the store, so a restore in a new
    process (a restarted job) decodes the chunk first and falls back instead of stopping
    at the same chunk again."""
    root = str(tmp_path / "store")
    for step, codec in ((1, "raw"), (2, "zstd")):
        with Checkpointer(root, RUN, codec=codec, chunk_bytes=4096) as ck:
            ck.save(step, {"model": {"w": torch.arange(4096, dtype=torch.float32) * step}})

    def broken_join(*_args, **_kwargs):
        raise ValueError("decoder defect")

    monkeypatch.setattr("ckptflow.chunks.planes.join", broken_join)
    monkeypatch.setattr(undecodable, "_FOUND", set())  # what this process learnt stays in this test
    target = {"model": {"w": torch.zeros(4096)}}
    with Checkpointer(root, RUN) as ck:
        result = ck.restore(target)
    assert result.step == 1 and "decoder defect" in result.skipped[0][1]
    assert torch.equal(target["model"]["w"], torch.arange(4096, dtype=torch.float32))
    with Checkpointer(root, RUN, restore_buffer_bytes=0) as ck:
        with pytest.raises(PartialRestoreError, match=r"(?s)chunk .*decoder defect.*saved wrongly.*recorded"):
            ck.restore(target)
    found = undecodable._FOUND  # every chunk that pass two met before the restore stopped
    assert found and [i.key for i in open_store(root).list("undecodable/")] == sorted(
        undecodable_key(*f) for f in found
    )
    monkeypatch.setattr(undecodable, "_FOUND", set())  # a new process (a restarted job) knows only the store's record
    with Checkpointer(root, RUN, restore_buffer_bytes=0) as ck:
        again = ck.restore(target)
    assert again.step == 1 and "decoder defect" in again.skipped[0][1]
    assert torch.equal(target["model"]["w"], torch.arange(4096, dtype=torch.float32))


def test_a_chunk_changed_while_it_was_encoded_gets_no_stored_checksum_and_is_refused_cleanly(tmp_path, monkeypatch):
    """Memory the writer stores without a private copy of its own (an async save's staging
    buffer; a blocking save copies each chunk first: test_concurrent_writes.py) written to
    while it is saved: the bytes encoded are not those checksummed. The saver sees it (the
    bytes no longer have their checksum after encoding) and records no stored checksum, so
    restore decodes that chunk before writing anything, finds the content wrong and falls
    back."""
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN, codec="raw", chunk_bytes=4096) as ck:
        ck.save(1, {"model": {"w": torch.arange(4096, dtype=torch.float32)}})
    encode = codecs.encode

    def racing(raw, codec="raw", *args, **kwargs):
        if codec == "zstd":
            memoryview(raw).cast("B")[100] ^= 0x40  # another thread writes the tensor meanwhile
        return encode(raw, codec, *args, **kwargs)

    monkeypatch.setattr(codecs, "encode", racing)
    with Checkpointer(root, RUN, codec="zstd", chunk_bytes=4096) as ck:
        ck.save(2, {"model": {"w": torch.arange(4096, dtype=torch.float32) * 2}}, blocking=False).wait()
    monkeypatch.undo()
    manifest = catalog.read_manifest(open_store(root), RUN, 2)
    assert len(manifest.chunks) == 4 and len(manifest.stored_checksums) == 0
    target = {"model": {"w": torch.zeros(4096)}}
    with Checkpointer(root, RUN, restore_buffer_bytes=0) as ck:
        result = ck.restore(target)
    assert result.step == 1 and result.skipped and result.skipped[0][0] == 2
    assert torch.equal(target["model"]["w"], torch.arange(4096, dtype=torch.float32))


def test_on_s3_a_chunk_beyond_the_budget_is_checked_as_fetched_and_decoded_once(s3_store_url, monkeypatch):
    """S3 cannot re-read cheaply, so pass one fetches each chunk whole; one that does not fit
    the budget is checked against its stored checksum as fetched (not decoded) and decoded
    once, in pass two. A damaged object is still refused before anything is written."""
    _save(s3_store_url, "zstd")
    calls = count_decodes(monkeypatch)
    once = _restore_counting(s3_store_url, calls, budget=0, single_pass=True)
    assert once and _restore_counting(s3_store_url, calls, budget=0) == once
    store = open_store(s3_store_url)
    manifest = catalog.read_manifest(store, RUN, 2)
    digest = next(d for d in manifest.stored_checksums if d not in catalog.read_manifest(store, RUN, 1).chunks)
    key = f"chunks/{digest[:2]}/{digest}"
    blob = bytearray(store.get(key))
    blob[-1] ^= 0xFF
    store.replace(key, bytes(blob))
    target = blank_like(drifting_state(2))
    with Checkpointer(s3_store_url, RUN, restore_buffer_bytes=0) as ck:
        result = ck.restore(target)
    assert result.step == 1 and result.skipped[0][0] == 2
    assert_tensors_equal(drifting_state(1), target)


def test_a_tensor_written_right_after_its_check_leaves_an_object_its_stored_checksum_refuses(tmp_path, monkeypatch):
    """An int8 chunk zstd cannot shrink is stored as a view of the memory it was given (an
    async save's staging buffer, not copied again): a write after the saver's check still
    reaches the object. The stored checksum was hashed before
    the check, so it no longer fits: restore decodes the chunk before writing anything,
    finds its content wrong, and falls back."""
    root = str(tmp_path / "store")
    noise = torch.randint(-128, 128, (16384,), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    with Checkpointer(root, RUN, codec="raw", chunk_bytes=4096) as ck:
        ck.save(1, {"model": {"w": noise.clone()}})
    checked = io_module.same_content

    def written_right_after(raw, checksum):
        same = checked(raw, checksum)
        memoryview(raw).cast("B")[7] ^= 0x01  # another thread writes the tensor just then
        return same

    monkeypatch.setattr(io_module, "same_content", written_right_after)
    with Checkpointer(root, RUN, codec="zstd", chunk_bytes=4096) as ck:
        ck.save(2, {"model": {"w": noise.clone() + 1}}, blocking=False).wait()
    monkeypatch.undo()
    assert catalog.read_manifest(open_store(root), RUN, 2).stored_checksums  # recorded: the race came after
    target = {"model": {"w": torch.zeros(16384, dtype=torch.int8)}}
    with Checkpointer(root, RUN, restore_buffer_bytes=0) as ck:
        result = ck.restore(target)
    assert result.step == 1 and result.skipped[0][0] == 2
    assert torch.equal(target["model"]["w"], noise)


def test_a_chunk_damaged_between_the_passes_is_not_called_saved_wrongly(ckpt_store_dir, monkeypatch):
    _save(ckpt_store_dir, "zstd")
    monkeypatch.setattr(undecodable, "_FOUND", set())
    store = open_store(ckpt_store_dir)
    one, two = (catalog.read_manifest(store, RUN, step) for step in (1, 2))
    victim = next(d for d in sorted(two.stored_checksums) if d not in one.chunks)
    check = ChunkStore.check

    def damage_after_check(self, digest, size):
        result = check(self, digest, size)
        if digest == victim:
            assert result.as_stored  # checked by its stored bytes: pass two decodes it
            flip_byte(chunk_path(ckpt_store_dir, digest), -1)
        return result

    monkeypatch.setattr(ChunkStore, "check", damage_after_check)
    target = blank_like(drifting_state(2))
    with Checkpointer(ckpt_store_dir, RUN, restore_buffer_bytes=0) as ck:
        with pytest.raises(PartialRestoreError) as raised:
            ck.restore(target, step=2)
    assert victim in str(raised.value) and "saved wrongly" not in str(raised.value)
    assert not undecodable._FOUND and not list(store.list("undecodable/"))


def test_records_that_cannot_be_listed_stop_the_restore_as_an_outage_asked_once(ckpt_store_dir, monkeypatch):
    """The records of chunks saved wrongly cannot be read: that proves nothing about the
    checkpoint, so the restore stops (no fallback) and leaves the state as it was, and the
    listing is not tried again for every chunk."""
    _save(ckpt_store_dir, "zstd")
    from ckptflow.store.local import LocalStore

    listed: list[str] = []
    real_list = LocalStore.list

    def failing_list(self, prefix, **kwargs):
        if prefix.startswith("undecodable/"):
            listed.append(prefix)
            raise StoreUnavailableError(f"{self.url}: listing {prefix} timed out")
        return real_list(self, prefix, **kwargs)

    monkeypatch.setattr(LocalStore, "list", failing_list)
    target = blank_like(drifting_state(2))
    with Checkpointer(ckpt_store_dir, RUN, restore_buffer_bytes=0) as ck:
        with pytest.raises(StoreUnavailableError, match="listing undecodable/ timed out"):
            ck.restore(target)
    assert listed == ["undecodable/"]
    assert_tensors_equal(blank_like(drifting_state(2)), target)
