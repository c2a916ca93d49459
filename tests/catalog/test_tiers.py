"""Tiered restore and per-tier GC: a hot store plus an archive tier (a local directory,
then a bucket on the moto S3 server through the ``store_url`` fixture)."""

import os
import random
import threading
import time

import numpy as np
import pytest
import torch

from ckptflow import Checkpointer, gc, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.errors import ColdObjectError, NoValidCheckpointError
from ckptflow.format import layout as fmt
from ckptflow.store import open_store
from support.faulty_store import FaultyStore
from support.states import assert_state_equals, snapshot

RUN = "r"


def rng_draws() -> tuple:
    return (torch.rand(4).tolist(), random.random(), np.random.rand())


def save_two(hot_root, state_factory, train_step):
    """Steps 1 and 2 in the hot store; (state, snapshot of step 2, RNG draws right after step 2's save)."""
    state = state_factory(seed=0)
    with Checkpointer(hot_root, RUN, chunk_bytes=512) as ck:
        train_step(state, 2)
        ck.save(1, state)
        train_step(state, 2)
        ck.save(2, state)
    snap = snapshot(state)
    return state, snap, rng_draws()


def scramble(state, train_step):
    train_step(state, 3)
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)


def test_restore_from_archive_after_the_hot_copy_expired_and_was_collected(
    tmp_path, store_url, tiny_state_factory, tiny_train_step
):
    hot_root = str(tmp_path / "hot")
    state, snap, draws = save_two(hot_root, tiny_state_factory, tiny_train_step)
    hot, archive = open_store(hot_root), open_store(store_url)
    report = lifecycle.archive(hot, archive, RUN, 2)
    assert report.ok and report.chunks_copied > 0
    archived_chunks = {i.key for i in archive.list("chunks/")}

    lifecycle.expire(hot, RUN, 2)
    swept = gc(hot, grace=0)
    assert swept.deleted and not hot.exists(fmt.manifest_key(RUN, 2))
    # hot GC marks from hot's manifests and sweeps hot's chunks only: the archive is untouched
    assert {i.key for i in archive.list("chunks/")} == archived_chunks
    assert catalog.verify_checkpoint(archive, RUN, 2).ok
    assert catalog.verify_checkpoint(hot, RUN, 1).ok

    scramble(state, tiny_train_step)
    with Checkpointer(hot_root, RUN, tiers=[store_url]) as ck:
        assert [i.step for i in ck.list()] == [1]  # list() is the hot tier
        result = ck.restore(state)
    assert (result.step, result.tier, result.skipped) == (2, archive.url, [])
    assert result.rng_restored
    assert_state_equals(state, snap)
    assert rng_draws() == draws

    # a save after an archive restore goes to the hot tier and is complete there on its own
    with Checkpointer(hot_root, RUN, tiers=[store_url]) as ck:
        ck.save(3, state, kind="incremental")
        assert catalog.verify_checkpoint(hot, RUN, 3).ok and not archive.exists(fmt.manifest_key(RUN, 3))
        assert ck.restore(state).tier == hot.url


def test_a_corrupt_hot_copy_falls_back_to_the_archive_copy_of_the_same_step(
    tmp_path, tiny_state_factory, tiny_train_step
):
    hot_root, arc_root = str(tmp_path / "hot"), str(tmp_path / "archive")
    state, snap, _ = save_two(hot_root, tiny_state_factory, tiny_train_step)
    hot = open_store(hot_root)
    assert lifecycle.archive(hot, open_store(arc_root), RUN, 2).ok
    manifest = catalog.read_manifest(hot, RUN, 2)
    digest = sorted(manifest.chunks)[0]
    blob = bytearray(hot.get(fmt.chunk_key(digest)))
    blob[-1] ^= 0xFF
    hot.replace(fmt.chunk_key(digest), bytes(blob))

    scramble(state, tiny_train_step)
    with Checkpointer(hot_root, RUN, tiers=[arc_root]) as ck:
        result = ck.restore(state)
        assert result.step == 2 and result.tier == open_store(arc_root).url
        assert [s for s, _ in result.skipped] == [2] and "does not match its address" in result.skipped[0][1]
        assert result.skipped[0][1].startswith(hot.url)
        assert_state_equals(state, snap)
        assert ck.restore(state, step=2).tier == open_store(arc_root).url  # an exact step may use any tier
        with pytest.raises(NoValidCheckpointError, match="step 7"):
            ck.restore(state, step=7)
    with Checkpointer(hot_root, RUN) as ck:  # without the tier: the hot tier's older step
        assert ck.restore(state).step == 1


def test_archive_gc_is_protected_by_the_archives_own_manifests(
    tmp_path, store_url, tiny_state_factory, tiny_train_step
):
    """Expiring and collecting *everything* in the hot tier leaves the archive whole, and
    GC of the archive keeps what its manifests need (it never looks at the hot tier)."""
    hot_root, arc_root = str(tmp_path / "hot"), store_url
    state, snap, _ = save_two(hot_root, tiny_state_factory, tiny_train_step)
    hot, archive = open_store(hot_root), open_store(arc_root)
    for step in (1, 2):
        assert lifecycle.archive(hot, archive, RUN, step).ok
        lifecycle.expire(hot, RUN, step)
    gc(hot, grace=0)
    assert not list(hot.list("chunks/"))
    archive.put_if_absent(fmt.chunk_key("0" * 64), b"orphan from an interrupted archival")
    report = gc(archive, grace=0, now=time.time() + 5)  # S3 mtimes have 1 s resolution
    assert [k for k, _ in report.deleted] == [fmt.chunk_key("0" * 64)]
    assert report.live_manifests == 2
    scramble(state, tiny_train_step)
    with Checkpointer(hot_root, RUN, tiers=[arc_root]) as ck:
        assert ck.restore(state).step == 2
        assert_state_equals(state, snap)


def test_cold_archive_keeps_metadata_readable_and_restore_says_to_thaw(
    tmp_path, s3_client, s3_bucket, tiny_state_factory, tiny_train_step
):
    from ckptflow.reports import inventory
    from ckptflow.store.s3 import S3Store

    hot_root = str(tmp_path / "hot")
    state, _, _ = save_two(hot_root, tiny_state_factory, tiny_train_step)
    hot = open_store(hot_root)
    cold = S3Store(s3_bucket, "arc", client=s3_client, storage_class="DEEP_ARCHIVE")
    report = lifecycle.archive(hot, cold, RUN, 2)
    assert report.ok and report.verified_by == "size" and report.chunks_verified == report.chunks_copied > 0

    def storage_class(key):
        return s3_client.head_object(Bucket=s3_bucket, Key=f"arc/{key}").get("StorageClass", "STANDARD")

    manifest = catalog.read_manifest(cold, RUN, 2)  # readable without a thaw
    assert storage_class(fmt.manifest_key(RUN, 2)) == "STANDARD"
    assert {storage_class(fmt.chunk_key(d)) for d in manifest.chunks} == {"DEEP_ARCHIVE"}
    assert [e.tiers for e in inventory.collect(hot, cold) if e.step == 2] == [["hot", "archive"]]

    lifecycle.expire(hot, RUN, 2)
    gc(hot, grace=0)
    with Checkpointer(hot_root, RUN, tiers=[cold]) as ck:
        before = snapshot(state)
        with pytest.raises(ColdObjectError, match="must be restored before it can be read"):
            ck.restore(state, step=2)
        # a cold copy proves no damage: restore says to thaw it rather than resume from step 1
        with pytest.raises(ColdObjectError, match=r"ckptflow thaw s3://.* --run r --step 2"):
            ck.restore(state)
    assert_state_equals(state, before)


def test_archive_gc_racing_an_archival_that_reuses_a_failed_attempts_chunks(
    tmp_path, tiny_state_factory, tiny_train_step
):
    """An archival retried after one that failed finds that attempt's chunks in the archive
    (old, no manifest names them) and reuses them. A GC of the archive running meanwhile
    must not sweep them: the archived copy it commits would name chunks the archive lost."""
    hot_root, arc_root = str(tmp_path / "hot"), str(tmp_path / "arc")
    save_two(hot_root, tiny_state_factory, tiny_train_step)
    hot, archive = open_store(hot_root), open_store(arc_root)
    assert lifecycle.archive(hot, archive, RUN, 2).ok
    archive.delete(fmt.manifest_key(RUN, 2))  # what an attempt that failed before its commit leaves
    hour_ago = time.time() - 3600
    for dirpath, _dirs, files in os.walk(arc_root):
        for name in files:
            os.utime(os.path.join(dirpath, name), (hour_ago, hour_ago))
    chunks = {info.key for info in archive.list("chunks/")}
    assert chunks

    faulty = FaultyStore(archive)
    pause = faulty.pause_before("put_if_absent", lambda key: key == fmt.manifest_key(RUN, 2))
    reports: list = []
    retry = threading.Thread(target=lambda: reports.append(lifecycle.archive(hot, faulty, RUN, 2)))
    retry.start()
    try:
        assert pause.reached.wait(30), "the archival never reached its commit"
        swept = gc(archive, grace="30m", wait=0.5)  # a GC of the archive, while the retry commits
    finally:
        pause.release()
        retry.join(30)
    (report,) = reports
    assert report.ok, report.problems
    assert not swept.deleted, f"GC swept chunks an archival in flight was committing: {swept.deleted}"
    assert swept.skipped
    assert chunks <= {info.key for info in archive.list("chunks/")}
    verified = catalog.verify_checkpoint(archive, RUN, 2, deep=False)
    assert not verified.damaged and not verified.problems, verified.problems
