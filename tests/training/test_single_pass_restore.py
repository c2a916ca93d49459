"""Restore's two passes cost one read and one check each, and ``single_pass=True`` trades
the untouched-on-damage guarantee for one read and one decode per chunk.

The default still verifies every chunk before it writes any tensor, then reads raw chunks
into place piece by piece, checking each piece while it is in the CPU cache. The opt-in
single pass verifies as it writes: damage is still never restored as data, but it is
reported as a partly written state (``PartialRestoreError``), never a silent fallback.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from ckptflow import Checkpointer, PartialRestoreError
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import codecs, reads
from ckptflow.chunks.io import ChunkStore
from ckptflow.errors import CorruptChunkError
from ckptflow.format.layout import chunk_key
from ckptflow.store import open_store
from ckptflow.store.local import LocalStore
from support.corrupt import chunk_path, flip_byte, only_in
from support.decode_count import count_decodes
from support.states import DRIFT_CHUNK, assert_tensors_equal, blank_like, drifting_state

RUN = "one"


def _save(root: str, codec: str, steps=(1, 2)) -> None:
    with Checkpointer(root, RUN, codec=codec, chunk_bytes=DRIFT_CHUNK) as ck:
        for step in steps:
            ck.save(step, drifting_state(step), kind="full" if step == 1 else "incremental")


@pytest.mark.parametrize("codec", ["raw", "zstd", "auto"])
def test_single_pass_restores_every_codec_exactly(ckpt_store_dir, codec):
    _save(ckpt_store_dir, codec)
    for step in (1, 2):
        target = blank_like(drifting_state(step))
        with Checkpointer(ckpt_store_dir, RUN) as ck:
            assert ck.restore(target, step=step, single_pass=True).step == step
        assert_tensors_equal(drifting_state(step), target)


def test_single_pass_reads_a_raw_chunk_once_straight_into_place(ckpt_store_dir, monkeypatch):
    _save(ckpt_store_dir, "raw", steps=(1,))
    calls = count_decodes(monkeypatch)
    reads: list[str] = []
    get_into = LocalStore.get_into

    def counting(self, key, buffers, **kwargs):
        reads.append(key)
        return get_into(self, key, buffers, **kwargs)

    monkeypatch.setattr(LocalStore, "get_into", counting)
    target = blank_like(drifting_state(1))
    with Checkpointer(ckpt_store_dir, RUN) as ck:
        ck.restore(target, single_pass=True)
    assert_tensors_equal(drifting_state(1), target)
    items = list(catalog.read_manifest(open_store(ckpt_store_dir), RUN, 1).items())
    packs = {item.chunks[0][0] for item in items if item.packed_at is not None}  # each read once, whole
    places = sum(len(item.chunks) for item in items if item.packed_at is None) + len(packs)
    assert len(reads) == places and not calls  # one read per place, nothing read through ``get``


@pytest.mark.parametrize("codec", ["raw", "zstd", "auto"])
@pytest.mark.parametrize("offset", [-1, codecs.HEADER.size, 5])
def test_single_pass_never_restores_damage_as_data_and_says_the_state_is_partly_written(ckpt_store_dir, codec, offset):
    _save(ckpt_store_dir, codec)
    damaged = only_in(ckpt_store_dir, RUN, 2, 1)[0]
    flip_byte(chunk_path(ckpt_store_dir, damaged), offset)
    target = blank_like(drifting_state(2))
    with Checkpointer(ckpt_store_dir, RUN) as ck:
        with pytest.raises(PartialRestoreError, match="single_pass=True.*restore again without single_pass"):
            ck.restore(target, single_pass=True)
        result = ck.restore(target)  # the default verifies first and falls back past the damage
    assert result.step == 1 and result.skipped[0][0] == 2
    assert_tensors_equal(drifting_state(1), target)


def test_read_verified_refuses_a_flipped_byte_and_a_missing_chunk(tmp_path):
    chunks = ChunkStore(open_store(str(tmp_path / "store")))
    payload = os.urandom(1 << 20)
    digest = chunks.put(memoryview(payload)).digest
    out = bytearray(len(payload))
    chunks.read_verified(digest, len(payload), memoryview(out))
    assert bytes(out) == payload
    flip_byte(tmp_path / "store" / chunk_key(digest), 300_000)
    with pytest.raises(CorruptChunkError, match="does not match its address"):
        chunks.read_verified(digest, len(payload), memoryview(bytearray(len(payload))))
    os.remove(tmp_path / "store" / chunk_key(digest))
    with pytest.raises(CorruptChunkError, match="missing"):
        chunks.read_verified(digest, len(payload), memoryview(bytearray(len(payload))))


def test_the_second_pass_checks_each_piece_as_it_lands_and_reads_no_chunk_twice(tmp_path, monkeypatch):
    """A sound raw chunk costs one scan and one read into place: no read through ``get``,
    and no second trip over the whole chunk to hash it after it landed."""
    from ckptflow.chunks import reads

    chunks = ChunkStore(open_store(str(tmp_path / "store")))
    payload = os.urandom(3 << 20)
    written = chunks.put(memoryview(payload))
    scoped = chunks.scoped({written.digest: len(payload)}, checksums={written.digest: written.checksum})
    checked = scoped.check(written.digest, len(payload))
    monkeypatch.setattr(ChunkStore, "get", lambda *a, **k: pytest.fail("a sound chunk was read again"))
    monkeypatch.setattr(reads, "fast_checksum", lambda *a, **k: pytest.fail("the chunk was hashed again whole"))
    out = bytearray(len(payload))
    scoped.read_checked(checked, memoryview(out))
    assert bytes(out) == payload


def test_local_get_into_hands_over_every_piece_once_in_order_within_its_buffer(tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    data = os.urandom(1000)
    store.put_if_absent("k", data)
    head, body = bytearray(10), bytearray(990)
    pieces: list[bytes] = []
    size, _version = store.get_into("k", [head, body], consume=lambda p: pieces.append(bytes(p)), piece=256)
    assert size == 1000 and bytes(head) + bytes(body) == data
    assert [len(p) for p in pieces] == [10, 256, 256, 256, 222] and b"".join(pieces) == data
    assert store.get_into("k", [bytearray(999)], consume=pieces.append)[0] == 1000  # wrong size: nothing read


def test_a_chunk_damaged_in_place_between_the_passes_is_still_caught(tmp_path):
    """Same file, same version as far as pass two can tell: the piece checks catch it."""
    root = tmp_path / "store"
    chunks = ChunkStore(open_store(str(root)))
    payload = os.urandom(1 << 20)
    written = chunks.put(memoryview(payload))
    scoped = chunks.scoped({written.digest: len(payload)}, checksums={written.digest: written.checksum})
    checked = scoped.check(written.digest, len(payload))
    path = root / chunk_key(written.digest)
    stat = path.stat()
    with open(path, "r+b") as f:  # in place, then the times set back
        f.seek(700_000)
        f.write(b"\0" * 8 if payload[700_000 - codecs.HEADER.size] else b"\1" * 8)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_ino == stat.st_ino and path.stat().st_mtime_ns == stat.st_mtime_ns
    with pytest.raises(CorruptChunkError, match="does not match its address"):
        scoped.read_checked(checked, memoryview(bytearray(len(payload))))


def test_single_pass_into_a_non_contiguous_target_is_exact(make_ck):
    saved = {f"t{i}": torch.randn(64, 64) for i in range(4)}
    make_ck(chunk_bytes=4096, codec="zstd").save(1, saved, rng=False)
    live = {name: torch.zeros(64, 64).t() for name in saved}  # staged, then copied
    make_ck().restore(live, single_pass=True)
    for name, value in saved.items():
        assert torch.equal(live[name], value)


@pytest.mark.parametrize("case", ["cached", "on the disk", "single pass"])
def test_chunks_in_the_page_cache_are_read_one_per_core_at_a_time(tmp_path, monkeypatch, case):
    """Reading a chunk the page cache holds is CPU work, which runs no wider than the cores
    (``reads.CORES``, one here) whatever the pool's width, in either pass and in a single
    pass; chunks that must come from the disk keep the pool's width."""
    root = str(tmp_path / "store")
    _save(root, "raw", steps=(1,))
    monkeypatch.setattr(reads, "CORES", 1)
    if case == "on the disk":
        monkeypatch.setattr(LocalStore, "in_memory", lambda self, key: False)
    elif not LocalStore(root).in_memory(next(k.key for k in LocalStore(root).list("chunks/"))):
        pytest.skip("this kernel does not say what the page cache holds")
    running, widest, lock = [0], [0], threading.Lock()
    for name in ("read_checked", "read_verified"):
        real = getattr(ChunkStore, name)

        def counted(self, *args, _real=real):
            with lock:
                running[0] += 1
                widest[0] = max(widest[0], running[0])
            try:
                time.sleep(0.02)  # long enough for the pool's other threads to start theirs
                return _real(self, *args)
            finally:
                with lock:
                    running[0] -= 1

        monkeypatch.setattr(ChunkStore, name, counted)
    target = blank_like(drifting_state(1))
    with Checkpointer(root, RUN, threads=8) as ck:
        ck.restore(target, single_pass=case == "single pass")
    assert_tensors_equal(target, drifting_state(1))
    assert widest[0] == 1 if case != "on the disk" else widest[0] > 1
