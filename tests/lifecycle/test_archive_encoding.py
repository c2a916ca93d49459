"""The copy of a checkpoint in any tier verifies on its own manifest (issue 20, item 9).

An incremental archived first leaves some chunks in the archive as deltas on its full's
chunks. A later full that holds the same content (a layer that stopped moving) lists
those chunks without any base: in the hot tier its save rewrote them plainly, but the
archive already had them. Archival must re-encode such a chunk there (its address is
its raw bytes, so the checkpoints sharing it keep reading the same bytes), commit the
manifest only after every chunk verifies, and leave no commit behind when it fails.
Run on a local archive and on a bucket of the moto S3 server (``store_url``).
"""

import os
import time

import pytest
import torch

from ckptflow import Checkpointer, gc, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import codecs
from ckptflow.chunks.lossy import ArchiveCodec
from ckptflow.errors import CorruptChunkError, StoreUnavailableError
from ckptflow.format import layout as fmt
from ckptflow.format.sealed import MAX_RECORD_BYTES
from ckptflow.lifecycle.retention_apply import copy_matches
from ckptflow.store import open_store
from support.corrupt import chunk_path, flip_byte
from support.faulty_store import FaultyStore
from support.states import DRIFT_CHUNK, assert_tensors_equal, blank_like, drifting_state

RUN = "a"


def frozen_after_two(step: int) -> dict:
    """Step 2's weights from step 2 on (the layers stopped moving), fresh noise each step."""
    state = drifting_state(min(step, 2))
    state["noise"], state["step"] = drifting_state(step)["noise"], step
    return state


def save(hot_root: str, step: int, kind: str) -> None:
    with Checkpointer(hot_root, RUN, codec="auto", chunk_bytes=DRIFT_CHUNK) as ck:
        ck.save(step, frozen_after_two(step), kind=kind)


def incremental_archived_then_full(tmp_path, archive_url: str):
    """Full 1 and incremental 2 (deltas on 1) in the hot tier, 2 archived, then full 3
    holding step 2's chunks: (hot, archive, step 2's chunks the archive holds as deltas
    that step 3 lists without their base)."""
    hot_root = str(tmp_path / "hot")
    save(hot_root, 1, "full")
    save(hot_root, 2, "incremental")
    hot, archive = open_store(hot_root), open_store(archive_url)
    assert lifecycle.archive(hot, archive, RUN, 2).ok
    save(hot_root, 3, "full")
    two, three = catalog.read_manifest(hot, RUN, 2), catalog.read_manifest(hot, RUN, 3)
    stranded = {d: b for d, b in two.bases.items() if d in three.chunks and b not in three.chunks}
    assert stranded and three.bases == {}
    assert all(codec_of(archive, d) == "delta" for d in stranded)
    assert all(codec_of(hot, d) != "delta" for d in stranded)  # the hot full rewrote them plainly
    return hot, archive, stranded


def codec_of(store, digest: str) -> str:
    return codecs.header_codec(store.get(fmt.chunk_key(digest)))


def restore_from(hot_root: str, archive_url: str, step: int, **kwargs) -> dict:
    target = blank_like(frozen_after_two(step))
    with Checkpointer(hot_root, RUN, tiers=[archive_url]) as ck:
        result = ck.restore(target, step=step, **kwargs)
    assert result.step == step and result.tier == open_store(archive_url).url
    return target


class Phases:
    """A ``verifying`` phase that records the total it begins with and what it is told."""

    def __init__(self) -> None:
        self.totals: list[int] = []
        self.counted: list[int] = []

    def __call__(self, total: int):
        self.totals.append(total)
        return self.counted.append


def test_a_full_archived_after_an_incremental_verifies_and_restores_from_the_archive_alone(tmp_path, store_url):
    hot, archive, stranded = incremental_archived_then_full(tmp_path, store_url)
    verifying = Phases()
    report = lifecycle.archive(hot, archive, RUN, 3, verifying=verifying)
    assert report.ok, report.problems
    assert report.chunks_reencoded == len(stranded)
    # the re-read begins once, with every chunk's content; a chunk stored anew after failing counts once
    three = catalog.read_manifest(hot, RUN, 3)
    assert verifying.totals == [sum(three.chunks.values())] == [sum(verifying.counted)]
    assert len(verifying.counted) == len(three.chunks)
    assert catalog.verify_checkpoint(archive, RUN, 3).ok
    assert all(codec_of(archive, d) != "delta" for d in stranded)
    assert catalog.verify_checkpoint(archive, RUN, 2).ok  # re-encoding kept the incremental readable
    assert copy_matches(hot, archive, RUN, 3) is None

    for step in (1, 2, 3):  # the hot tier keeps nothing of the run
        lifecycle.expire(hot, RUN, step, keep_records=True)
    gc(hot, grace=0)
    assert not list(hot.list("chunks/"))
    assert_tensors_equal(frozen_after_two(3), restore_from(hot.root, store_url, 3))
    assert_tensors_equal(frozen_after_two(2), restore_from(hot.root, store_url, 2))

    lifecycle.expire(archive, RUN, 2)  # the incremental's bases go with it; the full needs none of them
    swept = gc(archive, grace=0, now=time.time() + 5)  # S3 mtimes have 1 s resolution
    assert {fmt.chunk_key(b) for b in stranded.values()} <= {k for k, _ in swept.deleted}
    assert catalog.verify_checkpoint(archive, RUN, 3).ok
    assert_tensors_equal(frozen_after_two(3), restore_from(hot.root, store_url, 3))


def test_a_commit_left_in_the_archive_by_a_failed_archival_is_repaired_by_the_retry(tmp_path, store_url):
    """What archival before this fix left behind: the full's manifest committed in the
    archive over chunks that are deltas on bases it does not list. Each retry then
    failed the same way; now the retry re-encodes them and the copy verifies."""
    hot, archive, stranded = incremental_archived_then_full(tmp_path, store_url)
    three = catalog.read_manifest(hot, RUN, 3)
    for digest in three.chunks:
        archive.put_if_absent(fmt.chunk_key(digest), hot.get(fmt.chunk_key(digest)))
    for key in three.rank_keys() + [fmt.manifest_key(RUN, 3)]:
        archive.put_if_absent(key, hot.get(key))
    assert not catalog.verify_checkpoint(archive, RUN, 3).ok

    report = lifecycle.archive(hot, archive, RUN, 3)
    assert report.ok, report.problems
    assert report.chunks_reencoded == len(stranded)
    assert catalog.verify_checkpoint(archive, RUN, 3).ok
    again = lifecycle.archive(hot, archive, RUN, 3)
    assert again.ok and again.chunks_reencoded == 0 and again.chunks_copied == 0
    lifecycle.expire(hot, RUN, 3, keep_records=True)
    assert_tensors_equal(frozen_after_two(3), restore_from(hot.root, store_url, 3))


def test_a_failed_archival_leaves_no_commit_in_the_archive(tmp_path):
    hot, archive, _ = incremental_archived_then_full(tmp_path, str(tmp_path / "archive"))
    three = catalog.read_manifest(hot, RUN, 3)
    new = sorted(d for d in three.chunks if not archive.exists(fmt.chunk_key(d)))
    flip_byte(chunk_path(hot.root, new[0]))  # damaged in the hot tier before it was copied

    report = lifecycle.archive(hot, archive, RUN, 3)
    assert not report.ok and any(new[0] in p and "does not match its address" in p for p in report.problems)
    assert not archive.exists(fmt.manifest_key(RUN, 3))
    assert not archive.exists(fmt.chunk_key(new[0]))  # damaged bytes are not copied either
    assert [i.step for i in catalog.list_checkpoints(archive, RUN)] == [2]
    assert lifecycle.read_record(hot, lifecycle.Subject.of(three), "archive")["ok"] is False
    assert copy_matches(hot, archive, RUN, 3) is not None

    flip_byte(chunk_path(hot.root, new[0]))  # repaired; now the archive fails while chunks are copied
    flaky = FaultyStore(archive)

    def outage(op, key):
        if op == "put_if_absent" and key == fmt.chunk_key(new[-1]):
            raise StoreUnavailableError(f"S3 PutObject of {archive.url}/{key} failed after 10 attempts: SlowDown")
        return False

    flaky.fail_if = outage
    with pytest.raises(StoreUnavailableError):
        lifecycle.archive(hot, flaky, RUN, 3)
    assert not archive.exists(fmt.manifest_key(RUN, 3))
    flaky.fail_if = lambda op, key: False
    assert lifecycle.archive(hot, flaky, RUN, 3).ok
    assert catalog.verify_checkpoint(archive, RUN, 3).ok


def test_a_lossy_copy_does_not_reuse_a_delta_whose_base_it_does_not_list(tmp_path, store_url):
    """The tensors a lossy codec keeps exact (here every dtype but float32) are the
    exact chunks, which the archive may hold as deltas from an archived incremental."""
    hot, archive, stranded = incremental_archived_then_full(tmp_path, store_url)
    report = lifecycle.archive(hot, archive, RUN, 3, codec=ArchiveCodec.parse("bf16"))
    assert report.ok, report.problems
    copy = catalog.read_manifest(archive, RUN, 3)
    assert copy.lossy is not None and copy.bases == {}
    kept = set(stranded) & set(copy.chunks)
    assert kept and all(codec_of(archive, d) != "delta" for d in kept)
    assert catalog.verify_checkpoint(archive, RUN, 3).ok and catalog.verify_checkpoint(archive, RUN, 2).ok
    lifecycle.expire(hot, RUN, 3, keep_records=True)
    target = restore_from(hot.root, store_url, 3, allow_lossy=True)
    expected = frozen_after_two(3)
    exact = [name for name, t in expected["model"].items() if t.dtype != torch.float32]
    assert len(exact) > 5
    assert_tensors_equal({n: expected["model"][n] for n in exact}, {n: target["model"][n] for n in exact})


def test_a_cold_archive_replaces_a_chunk_it_holds_in_another_encoding(tmp_path, s3_client, s3_bucket):
    """A cold archive cannot be read back: a chunk whose stored size differs from the
    verified hot copy's is stored anew plainly, so the copy checked by size is the one
    that verifies, and restores once thawed."""
    from ckptflow.catalog.tiers import thaw
    from ckptflow.store.s3 import S3Store

    cold = S3Store(s3_bucket, "arc", client=s3_client, storage_class="DEEP_ARCHIVE")
    hot_root = str(tmp_path / "hot")
    save(hot_root, 1, "full")
    save(hot_root, 2, "incremental")
    hot = open_store(hot_root)
    assert lifecycle.archive(hot, cold, RUN, 2).ok
    save(hot_root, 3, "full")
    verifying = Phases()
    report = lifecycle.archive(hot, cold, RUN, 3, verifying=verifying)
    assert report.ok, report.problems
    assert report.verified_by == "size" and report.chunks_reencoded > 0
    assert verifying.totals == []  # checked by size: nothing re-read, no such phase
    thaw(cold, RUN, 3)
    assert catalog.verify_checkpoint(cold, RUN, 3).ok
    thaw(cold, RUN, 2)
    assert catalog.verify_checkpoint(cold, RUN, 2).ok


def test_a_save_replacing_a_stale_delta_never_makes_it_need_a_new_base(tmp_path):
    """The hot tier's own case. A chunk stored as a delta whose base GC took is stored
    anew by the next save that uses it. If that save is an incremental, it must not
    store it as a delta on its own base: a full of another run that rewrote the same
    chunk plainly meanwhile (the same frozen weights) lists no such base."""
    import threading

    root = str(tmp_path / "hot")
    save(root, 1, "full")
    save(root, 2, "incremental")
    store = open_store(root)
    two = catalog.read_manifest(store, RUN, 2)
    delta = next(d for d, b in two.bases.items() if b not in catalog.read_manifest(store, RUN, 1).bases)
    for step in (1, 2):  # expired; GC took the bases, not yet the (younger) deltas
        lifecycle.expire(store, RUN, step)
    for base in set(two.bases.values()):
        store.delete(fmt.chunk_key(base))
    with Checkpointer(root, RUN, codec="auto", chunk_bytes=DRIFT_CHUNK) as ck:
        ck.save(3, drifting_state(3), kind="full")  # the next incremental's bases

    paused = FaultyStore(open_store(root))
    pause = paused.pause_before("replace", lambda key: key == fmt.chunk_key(delta))
    outcome: list = []

    def incremental() -> None:
        with Checkpointer(paused, RUN, codec="auto", chunk_bytes=DRIFT_CHUNK) as ck:
            outcome.append(ck.save(4, frozen_after_two(4), kind="incremental"))

    saver = threading.Thread(target=incremental)
    saver.start()
    try:
        assert pause.reached.wait(30)
        with Checkpointer(root, "other", codec="auto", chunk_bytes=DRIFT_CHUNK) as other:
            other.save(1, frozen_after_two(4), kind="full")  # rewrites the chunk plainly
    finally:
        pause.release()
        saver.join(60)
    assert outcome
    report = catalog.verify_checkpoint(store, "other", 1)
    assert report.ok, report.problems
    assert catalog.verify_checkpoint(store, RUN, 4).ok
    target = blank_like(frozen_after_two(4))
    with Checkpointer(root, "other") as ck:
        assert ck.restore(target).step == 1
    assert_tensors_equal(frozen_after_two(4), target)


def test_compaction_never_replaces_a_chunk_with_bytes_that_do_not_decode_to_it(tmp_path, monkeypatch):
    """Every rewrite of an existing chunk object is checked before the swap: an encoder
    that went wrong (here: one flipped byte in what it returns) leaves the chunk as it
    was, for this checkpoint and every other one sharing it."""
    root = str(tmp_path / "hot")
    with Checkpointer(root, RUN, codec="raw", chunk_bytes=DRIFT_CHUNK) as ck:
        ck.save(1, drifting_state(1), kind="full")
    store = open_store(root)
    real = codecs.encode

    def flipped(*args, **kwargs):
        parts = [bytearray(memoryview(p).cast("B")) for p in real(*args, **kwargs)]
        parts[-1][len(parts[-1]) // 2] ^= 0x01
        return parts

    monkeypatch.setattr(codecs, "encode", flipped)
    with pytest.raises(CorruptChunkError, match="does not decode to its content.*left as it is"):
        lifecycle.compress(store, RUN, 1)
    monkeypatch.undo()
    assert catalog.verify_checkpoint(store, RUN, 1).ok
    assert lifecycle.compress(store, RUN, 1).reencoded > 0
    assert catalog.verify_checkpoint(store, RUN, 1).ok


def test_a_rank_record_larger_than_any_record_is_refused_unread_and_nothing_is_committed(tmp_path):
    """Archival reads the commit's rank records to copy them: bounded like every record
    (a sparse 1 GiB + 1 byte file here), so damage is a problem of the copy, not 1 GiB read."""
    hot = open_store(str(tmp_path / "hot"))
    with Checkpointer(hot, RUN) as ck:
        ck.save(1, {"w": torch.ones(64)})
    manifest = catalog.read_manifest(hot, RUN, 1)
    [rank_key] = manifest.rank_keys()
    with open(os.path.join(hot.root, rank_key), "r+b") as f:
        f.truncate(MAX_RECORD_BYTES + 1)
    archive = open_store(str(tmp_path / "archive"))
    report = lifecycle.archive(hot, archive, RUN, 1)
    assert not report.ok and any(rank_key in p for p in report.problems), report.problems
    assert not archive.exists(fmt.manifest_key(RUN, 1)) and not archive.exists(rank_key)
