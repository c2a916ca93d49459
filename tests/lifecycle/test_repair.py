"""Damaged chunk objects repaired from another tier's sound copies (``ckptflow.lifecycle.repair``)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptflow import Checkpointer
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import codecs, damaged
from ckptflow.chunks.io import ChunkStore
from ckptflow.errors import CorruptChunkError, StoreUnavailableError
from ckptflow.format.layout import READABLE_FORMATS, chunk_key
from ckptflow.lifecycle import archive
from ckptflow.lifecycle.repair import repair
from ckptflow.store import open_store
from support.corrupt import flip_byte, manifest_path, reseal_manifest
from support.states import DRIFT_CHUNK, assert_tensors_equal, blank_like, drifting_state

RUN = "r"


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}}


def zeros() -> dict:
    return {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}


@pytest.fixture
def tiers(tmp_path):
    """A hot store with steps 1 and 2, step 1 archived."""
    hot, cold = open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "archive"))
    with Checkpointer(hot, RUN, codec="zstd") as ck:
        ck.save(1, state(1), rng=False)
        ck.save(2, state(2), rng=False)
    assert archive(hot, cold, RUN, 1).ok
    return hot, cold


def damage(store, step: int) -> str:
    """Flip a byte of the first chunk of ``step`` and read it, so the reader records the damage."""
    manifest = catalog.read_manifest(store, RUN, step)
    digest, size = sorted(manifest.chunks.items())[0]
    flip_byte(Path(store.root) / chunk_key(digest), 20)
    with pytest.raises(CorruptChunkError):
        ChunkStore(store).get(digest, size)
    assert digest in damaged.records(store)
    return digest


def restores(store, step: int, expected: dict) -> bool:
    target = zeros()
    with Checkpointer(store, RUN) as ck:
        result = ck.restore(target, step=step)
    return result.step == step and all(torch.equal(target["model"][k], v) for k, v in expected["model"].items())


def test_archive_damage_is_repaired_from_the_hot_copy(tiers):
    hot, cold = tiers
    digest = damage(cold, 1)
    assert not Checkpointer(cold, RUN).verify(1).ok

    report = repair(cold, [hot])
    assert report.ok and report.repaired == [(digest, hot.url)]
    assert digest not in damaged.records(cold)
    assert Checkpointer(cold, RUN).verify(1).ok and restores(cold, 1, state(1))


def test_hot_damage_is_repaired_from_the_archive_copy_and_a_later_save_needs_no_rewrite(tiers):
    hot, cold = tiers
    digest = damage(hot, 1)
    report = repair(hot, [cold])
    assert report.repaired == [(digest, cold.url)]
    assert Checkpointer(hot, RUN).verify(1).ok and restores(hot, 1, state(1))


def test_a_record_another_process_wrote_goes_when_repair_fixes_the_chunk(tiers):
    """The damage was found by another process's verify (its record is in the store, not in
    this process's memory): repairing the chunk deletes the record, so a second repair
    has nothing to do and stats no longer warns."""
    hot, cold = tiers
    digest = sorted(catalog.read_manifest(hot, RUN, 1).chunks)[0]
    flip_byte(Path(hot.root) / chunk_key(digest), 20)
    verify = f"from ckptflow import Checkpointer; assert not Checkpointer({hot.root!r}, {RUN!r}).verify(1).ok"
    subprocess.run([sys.executable, "-c", verify], check=True)
    assert digest in damaged.records(hot) and not damaged.known(hot.url, digest)
    assert repair(hot, [cold]).repaired == [(digest, cold.url)]
    assert digest not in damaged.records(hot) and repair(hot, [cold]).repaired == []


def test_without_a_sound_copy_nothing_moves_and_the_record_stays(tiers):
    hot, cold = tiers
    digest = damage(hot, 2)  # step 2 was never archived
    before = (Path(hot.root) / chunk_key(digest)).read_bytes()
    report = repair(hot, [cold])
    assert not report.ok and [d for d, _ in report.unrepaired] == [digest] and cold.url in report.unrepaired[0][1]
    assert (Path(hot.root) / chunk_key(digest)).read_bytes() == before
    assert digest in damaged.records(hot)


def test_a_source_copy_that_is_damaged_too_is_recorded_there_and_not_used(tiers):
    hot, cold = tiers
    digest = damage(cold, 1)
    flip_byte(Path(hot.root) / chunk_key(digest), 20)
    report = repair(cold, [hot])
    assert [d for d, _ in report.unrepaired] == [digest]
    assert digest in damaged.records(hot)  # the read that refused it recorded it where it lives


class Unreadable:
    """A tier that cannot be read now (an outage)."""

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        return getattr(self._store, name)

    def get_bounded(self, key, limit):
        raise StoreUnavailableError(f"{self._store.url} timed out")


def test_an_unreadable_source_is_unavailable_not_proof_and_a_later_one_is_tried(tiers, tmp_path):
    hot, cold = tiers
    digest = damage(cold, 1)
    report = repair(cold, [Unreadable(hot)])
    assert [d for d, _ in report.unavailable] == [digest] and not report.repaired and not report.ok
    assert digest in damaged.records(cold)
    assert repair(cold, [Unreadable(hot), hot]).repaired == [(digest, hot.url)]


def test_a_delta_in_the_source_is_stored_plainly(tmp_path):
    hot, cold = open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "archive"))
    with Checkpointer(hot, RUN, codec="auto", chunk_bytes=DRIFT_CHUNK) as ck:
        ck.save(1, drifting_state(1), rng=False)
        ck.save(2, drifting_state(2), kind="incremental", rng=False)  # "w" drifted: deltas against step 1
    manifest = catalog.read_manifest(hot, RUN, 2)
    assert manifest.bases, "the incremental stored no delta"
    assert archive(hot, cold, RUN, 2).ok
    digest = next(iter(manifest.bases))
    size = manifest.chunks[digest]
    flip_byte(Path(cold.root) / chunk_key(digest), 20)
    with pytest.raises(CorruptChunkError):
        ChunkStore(cold).get(digest, size)
    assert repair(cold, [hot]).repaired == [(digest, hot.url)]
    assert codecs.delta_base(cold.read_head(chunk_key(digest), codecs.HEAD_BYTES)) is None  # needs no base
    assert ChunkStore(cold).get(digest, size) is not None
    target = blank_like(drifting_state(2))
    with Checkpointer(cold, RUN) as ck:
        assert ck.restore(target, step=2).step == 2
    assert_tensors_equal(drifting_state(2), target)


def test_a_record_of_a_chunk_no_checkpoint_lists_is_left_to_gc(tiers):
    hot, cold = tiers
    damaged.note(cold, "f" * 64, "found by a reader of a checkpoint since expired")
    report = repair(cold, [hot])
    assert report.unreferenced == 1 and report.ok and not report.repaired


def sealed_as(store, step: int, version: int) -> None:
    reseal_manifest(store.root, RUN, step, lambda record: record.update(format_version=version))


def test_a_record_only_an_unread_checkpoint_may_list_is_unresolved_not_left_to_gc(tiers):
    """Step 2, archived, then committed in hot by a newer ckptflow: the damaged chunk only it
    lists is not 'unreferenced' (GC's to delete) but unresolved, and is repaired once it reads."""
    hot, cold = tiers
    assert archive(hot, cold, RUN, 2).ok
    digest = damage(hot, 2)
    sealed_as(hot, 2, max(READABLE_FORMATS) + 1)
    report = repair(hot, [cold])
    assert report.unresolved == [digest] and report.unreferenced == 0 and not report.ok
    assert "newer ckptflow" in report.unlisted[0] and digest in damaged.records(hot)

    sealed_as(hot, 2, max(READABLE_FORMATS))
    assert repair(hot, [cold]).repaired == [(digest, cold.url)]
    assert restores(hot, 2, state(2))


def test_a_checkpoint_proved_damaged_or_a_stray_symlink_leaves_what_it_lists_to_gc(tiers, tmp_path):
    """Neither passes with a retry or an upgrade: repair must not wait for them for ever."""
    hot, cold = tiers
    damage(hot, 2)
    flip_byte(manifest_path(hot.root, RUN, 2))
    (tmp_path / "elsewhere").mkdir()
    strays = Path(hot.root) / "runs" / "other" / "checkpoints"
    strays.mkdir(parents=True)
    (strays / "000000000005").symlink_to(tmp_path / "elsewhere")
    report = repair(hot, [cold])
    assert report.unreferenced == 1 and not report.unresolved and report.ok and len(report.unlisted) == 2


def test_progress_counts_the_content_of_each_chunk_repaired_and_nothing_else(tiers):
    hot, cold = tiers
    digest = damage(cold, 1)
    unrepairable = damage(hot, 2)  # step 2 was never archived: no sound copy anywhere
    counted: list[int] = []
    report = repair(cold, [hot], progress=counted.append)
    assert counted == [catalog.read_manifest(cold, RUN, 1).chunks[digest]] and report.bytes_repaired == sum(counted)
    counted.clear()
    report = repair(hot, [cold], progress=counted.append)
    assert report.unrepaired and report.unrepaired[0][0] == unrepairable
    assert counted == [] and report.bytes_repaired == 0
