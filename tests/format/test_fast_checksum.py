"""Restore checks every chunk with the fast checksum its manifest records, and still
refuses every damaged byte: one byte flipped at a time at many positions of raw, zstd
and delta chunks (header, delta base name, payload start, middle, end) is never
restored as data. ``verify --deep`` re-hashes the sha256 addresses instead."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from blake3 import blake3

from ckptflow import Checkpointer, ManifestError, NoValidCheckpointError, PartialRestoreError
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import codecs
from ckptflow.format import layout as fmt
from ckptflow.format.checksum import FastChecksum, address_and_checksum, fast_checksum, same_content
from ckptflow.store import open_store
from support.cli import run_cli
from support.corrupt import chunk_path, flip_byte, reseal_manifest
from support.states import assert_tensors_equal, blank_like

RUN = "fast"
CHUNK = 4096
ELEMENT_SIZE_BYTE = 5  # header: magic (4), codec id (1), element size (1), raw length (8)


def state(step: int) -> dict:
    """Weights that drift (deltas), a counter (zstd), hash bytes (raw), one odd length."""
    i = torch.arange(4096, dtype=torch.float32)
    noise = bytearray(b"".join(hashlib.sha256(f"{step}-{k}".encode()).digest() for k in range(256)))
    return {
        "w": torch.sin(i * 0.37) * 0.02 + torch.cos(i * 1.3) * 1e-5 * step,
        "count": torch.arange(2048, dtype=torch.int64) * step,
        "noise": torch.frombuffer(noise, dtype=torch.uint8),
        "odd": torch.arange(1001, dtype=torch.int8) + step,
    }


@pytest.fixture
def saved(ckpt_store_dir) -> str:
    with Checkpointer(ckpt_store_dir, RUN, codec="auto", chunk_bytes=CHUNK) as ck:
        ck.save(1, state(1), kind="full")
        ck.save(2, state(2), kind="incremental")
    return ckpt_store_dir


def _own_chunks(root: str) -> dict[str, str]:
    """Chunks of step 2 that step 1 does not use, by codec (first of each)."""
    store = open_store(root)
    one, two = (catalog.read_manifest(store, RUN, s) for s in (1, 2))
    own: dict[str, str] = {}
    for item in two.items():
        for digest, _ in item.chunks:
            if digest not in one.chunks:
                own.setdefault(codecs.header_codec(store.get(fmt.chunk_key(digest))), digest)
    return own


def _positions(codec: str, size: int) -> list[int]:
    header = list(range(codecs.HEADER.size))  # magic, codec id, element size, raw length
    base_name = list(range(codecs.HEADER.size, codecs.HEAD_BYTES)) if codec == "delta" else []
    payload = codecs.HEAD_BYTES if codec == "delta" else codecs.HEADER.size
    spread = [payload, payload + 1, payload + 7, payload + 8, (payload + size) // 2, size - 9, size - 8, size - 1]
    return sorted(set(header + base_name[::5] + base_name[-1:] + spread + list(range(payload, size, 97))))


def test_the_manifest_records_a_fast_checksum_of_every_chunk_a_tensor_reads(saved):
    store = open_store(saved)
    manifest = catalog.read_manifest(store, RUN, 2)
    read = {d for item in manifest.items() for d, _ in item.chunks}
    assert set(manifest.fast_checksums) == read
    for item in manifest.items():
        raw = state(2)[item.fqn].reshape(-1).view(torch.uint8).numpy().tobytes()
        offset = 0
        for digest, size in item.chunks:
            assert manifest.fast_checksums[digest] == fast_checksum(raw[offset : offset + size])
            offset += size


@pytest.mark.parametrize("budget", [None, 0], ids=["kept decoded", "checked as stored first"])
def test_every_flipped_byte_of_raw_zstd_and_delta_chunks_is_refused(saved, budget):
    """Refused, with the state untouched and the older step restored instead; the one
    exception is the element-size byte of an encoded chunk whose payload is a single
    plane, which no decoder reads: those flips must restore exactly the saved bytes.
    With a zero memory budget the zstd chunk is first checked against the checksum of its
    stored bytes; a flip makes that mismatch, which sends it to be decoded and verified in
    the first pass as with the default budget: the outcome must be the same."""
    own = _own_chunks(saved)
    assert set(own) == {"raw", "zstd", "delta"}
    flips = 0
    for codec, digest in sorted(own.items()):
        path = chunk_path(saved, digest)
        for position in _positions(codec, path.stat().st_size):
            flip_byte(path, position)
            try:
                _assert_refused_or_exact(saved, codec, position, budget)
            finally:
                flip_byte(path, position)  # XOR again: the chunk as it was
            flips += 1
    assert flips > 100
    target = blank_like(state(2))
    with Checkpointer(saved, RUN) as ck:
        assert ck.restore(target).step == 2
    assert_tensors_equal(state(2), target)


def _assert_refused_or_exact(root: str, codec: str, position: int, budget: int | None) -> None:
    target = blank_like(state(2))
    with Checkpointer(root, RUN, **({} if budget is None else {"restore_buffer_bytes": budget})) as ck:
        try:
            ck.restore(target, step=2)  # an explicit step never falls back
        except NoValidCheckpointError:
            assert_tensors_equal(blank_like(state(2)), target)  # untouched
            assert ck.restore(target).step == 1  # the newest valid one: the older step
            assert_tensors_equal(state(1), target)
            return
    assert codec != "raw" and position == ELEMENT_SIZE_BYTE, f"{codec} byte {position} flipped went unnoticed"
    assert_tensors_equal(state(2), target)


def test_a_chunk_damaged_between_verification_and_the_read_into_place_is_caught(saved, monkeypatch):
    """The second pass checks the bytes it read into the tensor: a chunk rewritten in
    place (same file, so the same version) after the first pass is not trusted. By then
    other tensors hold step 2's values, so restore says the state is partly written (no
    silent fallback), and a second restore verifies afresh and falls back cleanly."""
    from ckptflow.chunks.io import ChunkStore

    own = _own_chunks(saved)
    path = chunk_path(saved, own["raw"])
    check = ChunkStore.check

    def damage_after_check(self, digest, size):
        checked = check(self, digest, size)
        if digest == own["raw"]:
            with open(path, "r+b") as f:  # in place: inode and size unchanged
                f.seek(-1, 2)
                last = f.read(1)
                f.seek(-1, 2)
                f.write(bytes([last[0] ^ 0xFF]))
            checked = type(checked)(checked.digest, checked.size, version=_version(path))
        return checked

    monkeypatch.setattr(ChunkStore, "check", damage_after_check)
    target = blank_like(state(2))
    with Checkpointer(saved, RUN) as ck:
        with pytest.raises(PartialRestoreError, match="partly overwritten"):
            ck.restore(target)
        assert not _equal(blank_like(state(2)), target)  # what the error warns about
        monkeypatch.undo()
        result = ck.restore(target)
    assert result.step == 1 and result.skipped[0][0] == 2
    assert_tensors_equal(state(1), target)


def test_an_io_error_in_the_read_into_place_is_read_again_and_verified(saved, monkeypatch):
    from ckptflow.store.local import LocalStore

    calls = []

    def flaky_get_into(self, key, buffers, **reading):
        calls.append(key)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(LocalStore, "get_into", flaky_get_into)
    target = blank_like(state(2))
    with Checkpointer(saved, RUN) as ck:
        assert ck.restore(target).step == 2
    assert calls and not any(k.startswith("runs/") for k in calls)
    assert_tensors_equal(state(2), target)


def _equal(a: dict, b: dict) -> bool:
    try:
        assert_tensors_equal(a, b)
    except AssertionError:
        return False
    return True


def _version(path) -> tuple:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def test_verify_deep_rehashes_addresses_and_plain_verify_checks_fast(saved):
    own = _own_chunks(saved)
    with Checkpointer(saved, RUN) as ck:
        assert ck.verify(2).ok and catalog.verify_checkpoint(open_store(saved), RUN, 2, deep=True).ok
    flip_byte(chunk_path(saved, own["zstd"]), -1)
    for deep in (False, True):
        report = catalog.verify_checkpoint(open_store(saved), RUN, 2, deep=deep)
        assert not report.ok and own["zstd"] in report.problems[0]


def test_the_fast_checksum_misses_no_damage_within_one_word_and_streams_in_any_pieces():
    data = bytearray(hashlib.sha256(b"x").digest() * 40 + b"tail!")  # not a multiple of 8
    whole = fast_checksum(data)
    pieces = FastChecksum()
    for start, stop in [(0, 3), (3, 11), (11, 600), (600, len(data))]:
        pieces.update(data[start:stop])
    assert pieces.hexdigest() == whole
    assert address_and_checksum(data) == (blake3(data).hexdigest(), whole)
    for position in range(len(data)):
        for flip in (0x01, 0x80, 0xFF):
            data[position] ^= flip
            assert fast_checksum(data) != whole, (position, flip)
            data[position] ^= flip


def test_the_cli_verifies_fast_by_default_and_by_address_with_deep(saved, capsys):
    for extra, how in (([], "fast checksums"), (["--deep"], "chunk addresses")):
        code, out, _ = run_cli(capsys, "verify", saved, "--run", RUN, *extra)
        assert code == 0 and how in out
    flip_byte(chunk_path(saved, _own_chunks(saved)["raw"]), -1)
    for extra in ([], ["--deep"]):
        code, out, _ = run_cli(capsys, "verify", saved, "--run", RUN, *extra)
        assert code == 1 and "does not match its address" in out


def test_restore_checks_against_the_recorded_checksum_and_refuses_a_malformed_one(saved):
    """A sealed manifest whose recorded checksum does not fit its (intact) chunk is refused:
    restore really checks what the manifest records. A malformed record is a bad manifest."""
    digest = _own_chunks(saved)["raw"]

    def wrong(record: dict) -> None:
        record["fast_checksums"][digest] = "0" * 48

    reseal_manifest(saved, RUN, 2, wrong)
    with Checkpointer(saved, RUN) as ck:
        target = blank_like(state(2))
        assert ck.restore(target).step == 1
        assert_tensors_equal(state(1), target)
        assert ck.verify(2, deep=True).ok and not ck.verify(2, deep=False).ok

    def malformed(record: dict) -> None:
        record["fast_checksums"][digest] = "not hex"

    reseal_manifest(saved, RUN, 2, malformed)
    with pytest.raises(ManifestError, match="fast checksum"):
        catalog.read_manifest(open_store(saved), RUN, 2)


def test_same_content_compares_the_xxh3_part_of_a_fast_checksum():
    raw = bytearray(os.urandom(1 << 16))
    recorded = fast_checksum(raw)
    assert same_content(raw, recorded)
    raw[12345] ^= 1
    assert not same_content(raw, recorded)
