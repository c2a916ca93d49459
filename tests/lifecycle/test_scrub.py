"""The archive scrub: which archive copies it verifies.

An archive copy of the commit the hot tier holds is verified by the hot scrub (one
verdict per commit). Any other commit the archive holds at that step (a lossy copy, an
earlier commit the step was saved again after) is read by nothing else, so the archive
scrub verifies it: its rot was unseen while retention counted the copy sound.
"""

import json
import time

import pytest
import torch
from torch import nn

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import verdicts
from ckptflow.chunks import damaged
from ckptflow.chunks.lossy import ArchiveCodec
from ckptflow.format import layout as fmt
from ckptflow.lifecycle.retention_apply import copy_matches
from ckptflow.store import open_store
from support.corrupt import chunk_path, flip_byte


def _stores(tmp_path):
    return open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "arc"))


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 8))


def _rot(root, manifest) -> None:
    for digest in manifest.chunks:
        flip_byte(chunk_path(root, digest))


def test_a_rotten_lossy_copy_of_a_hot_checkpoint_is_found_and_recorded_as_its_own_commit(tmp_path):
    hot, arc = _stores(tmp_path)
    with Checkpointer(hot, "r") as ck:
        ck.save(1, {"model": _model()})
    assert lifecycle.archive(hot, arc, "r", 1, codec=ArchiveCodec.parse("weights=bf16,optimizer=exact")).ok
    assert copy_matches(hot, arc, "r", 1) is None
    copy = catalog.read_manifest(arc, "r", 1)
    _rot(tmp_path / "arc", copy)
    report = lifecycle.scrub_archive_only(hot, arc, older_than_s=0)
    assert report.checked == 1 and [(run, step) for run, step, _ in report.corrupt] == [("r", 1)]
    assert lifecycle.read_record(hot, lifecycle.Subject.of(copy), "validation")["ok"] is False
    hot_commit = lifecycle.Subject.of(catalog.read_manifest(hot, "r", 1))
    assert lifecycle.read_record(hot, hot_commit, "validation") is None  # the hot commit's verdict is its own
    # and retention no longer counts that copy as the checkpoint's: the hot copy stays
    assert "failed validation" in copy_matches(hot, arc, "r", 1)


def test_an_earlier_commit_the_archive_holds_is_scrubbed_in_the_archive(tmp_path):
    hot, arc = _stores(tmp_path)
    with Checkpointer(hot, "r") as ck:
        ck.save(1, {"model": _model(0)})
    assert lifecycle.archive(hot, arc, "r", 1).ok
    earlier = catalog.read_manifest(arc, "r", 1)
    hot.delete(fmt.manifest_key("r", 1))  # as a save of the step again after a rejected restore
    with Checkpointer(hot, "r") as ck:
        ck.save(1, {"model": _model(1)})
    assert catalog.read_manifest(hot, "r", 1).digest != earlier.digest
    _rot(tmp_path / "arc", earlier)
    report = lifecycle.scrub_archive_only(hot, arc, older_than_s=0)
    assert report.checked == 1 and len(report.corrupt) == 1


def test_an_archive_copy_of_the_hot_commit_is_left_to_the_hot_scrub(tmp_path):
    hot, arc = _stores(tmp_path)
    with Checkpointer(hot, "r") as ck:
        ck.save(1, {"model": _model()})
    assert lifecycle.archive(hot, arc, "r", 1).ok
    report = lifecycle.scrub_archive_only(hot, arc, older_than_s=0)
    assert report.checked == 0 and not report.corrupt and not report.unreadable


def test_scrub_progress_adds_up_to_the_bytes_it_checked(tmp_path):
    hot, arc = _stores(tmp_path)
    with Checkpointer(hot, "r") as ck:
        for step in (1, 2):
            ck.save(step, {"model": _model(step)})
    calls: list[int] = []
    report = lifecycle.scrub(hot, older_than_s=0, progress=calls.append)
    every = sum(sum(catalog.read_manifest(hot, "r", step).chunks.values()) for step in (1, 2))
    assert report.checked == 2 and sum(calls) == report.bytes_checked == every
    assert lifecycle.archive(hot, arc, "r", 1).ok
    hot.delete(fmt.manifest_key("r", 1))  # only the archive holds it now
    calls.clear()
    report = lifecycle.scrub_archive_only(hot, arc, older_than_s=0, progress=calls.append)
    assert report.checked == 1 and sum(calls) == report.bytes_checked == sum(
        catalog.read_manifest(arc, "r", 1).chunks.values()
    )


@pytest.mark.parametrize("what", ["chunk", "manifest"])
def test_a_cold_object_in_the_hot_tier_is_reported_cold_and_the_scrub_goes_on(s3_store_url, s3_client, s3_bucket, what):
    """A bucket lifecycle rule moved a chunk (or the commit record) of step 1 to GLACIER
    (moto keeps the class and refuses the read as S3 does). The scrub listed it as
    unreadable, with outages, so the scrub job retried it minutes later; a cold object
    stays cold until thawed (``errors.retrying_may_help``). It is listed as cold now, with
    how to thaw it, no verdict recorded, and step 2 is verified."""
    with Checkpointer(s3_store_url, run="r") as ck:
        ck.save(1, {"model": _model(1)})
        ck.save(2, {"model": _model(2)})
    store = open_store(s3_store_url)
    one, two = (catalog.read_manifest(store, "r", step) for step in (1, 2))
    [frozen, *_] = sorted(set(one.chunks) - set(two.chunks))
    key = "ckpts/" + (fmt.chunk_key(frozen) if what == "chunk" else fmt.manifest_key("r", 1))
    s3_client.copy_object(
        Bucket=s3_bucket, Key=key, CopySource={"Bucket": s3_bucket, "Key": key}, StorageClass="GLACIER"
    )
    report = lifecycle.scrub(store, older_than_s=0)
    assert report.unreadable == [] and report.corrupt == [] and report.checked == 1
    [cold] = report.cold
    assert "GLACIER" in cold and "ckptflow thaw" in cold
    assert lifecycle.read_record(store, lifecycle.Subject.of(one), "validation") is None
    assert lifecycle.read_record(store, lifecycle.Subject.of(two), "validation")["ok"] is True


def test_only_a_cold_object_is_listed_cold(tmp_path):
    """Step 1's commit record is a symbolic link (a layout ckptflow never writes nor follows):
    no retry and no thaw reads it. Scrub listed it as ``cold`` for no retry helping (every
    error but an outage, by ``errors.retrying_may_help``), so the scrub job failed saying it
    "has an object in a cold storage class ... thaw them". A checkpoint is cold only for a
    cold object (the problem's kind ``cold``); this one is unreadable, as before."""
    root = tmp_path / "hot"
    with Checkpointer(str(root), "r") as ck:
        ck.save(1, {"model": _model(1)})
        ck.save(2, {"model": _model(2)})
    manifest = root / fmt.manifest_key("r", 1)
    manifest.rename(tmp_path / "elsewhere.json")
    manifest.symlink_to(tmp_path / "elsewhere.json")
    report = lifecycle.scrub(open_store(str(root)), older_than_s=0)
    assert report.cold == [] and report.checked == 1
    [unread] = report.unreadable
    assert "symbolic link" in unread


def test_a_resumed_scrub_reads_again_a_checkpoint_whose_chunk_was_found_damaged_since_its_verdict(tmp_path):
    """Steps 1 and 2 share every chunk. The first attempt of a scrub verified both; then a
    verify (another process: a restore, an export) found a shared chunk rotten and recorded
    it in the store. The retry counted both verdicts, recorded before that finding, as sound
    and read neither: no checkpoint corrupt, where a fresh scrub finds both."""
    root = tmp_path / "hot"
    hot = open_store(str(root))
    with Checkpointer(hot, "r") as ck:
        for step in (1, 2):
            ck.save(step, {"model": _model()}, kind="full")
    began = time.time()
    assert lifecycle.scrub(hot, older_than_s=0).corrupt == []
    _rot(root, catalog.read_manifest(hot, "r", 1))
    assert not catalog.verify_checkpoint(hot, "r", 1).ok  # the finding, recorded in the store
    assert damaged.records(hot)
    resumed = lifecycle.scrub(hot, older_than_s=0, verified_since=began)
    assert sorted(step for _, step, _ in resumed.corrupt) == [1, 2] and resumed.resumed == 0
    assert lifecycle.scrub(hot, older_than_s=0).corrupt == resumed.corrupt  # as a fresh scrub finds


def test_a_resumed_scrub_reads_a_verdict_without_a_time_as_none(tmp_path):
    """A validation record without ``recorded_at`` is sound to every reader (``verdicts``):
    the retry raised KeyError on it. It was not given since the scrub began: read again."""
    hot = open_store(str(tmp_path / "hot"))
    with Checkpointer(hot, "r") as ck:
        ck.save(1, {"model": _model()})
    subject = lifecycle.Subject.of(catalog.read_manifest(hot, "r", 1))
    key = verdicts.record_key(subject, "validation")
    hot.replace(key, json.dumps({"ok": True, "problems": [], "manifest_digest": subject.digest}).encode())
    report = lifecycle.scrub(hot, older_than_s=0, verified_since=time.time() - 60)
    assert report.checked == 1 and report.resumed == 0 and report.bytes_checked > 0


def test_a_resumed_scrub_reads_again_a_checkpoint_whose_recorded_verdict_found_damage(tmp_path):
    """The first attempt of a scrub found step 1's chunks rotten; then ``repair`` put sound
    copies from the archive in place (the damage records went with them), and the scrub
    was retried. The retry counted the failed verdict without reading: step 1 stayed corrupt
    in its report and in its record, where a fresh scrub finds it sound. Only a verdict
    that verified the bytes may stand unread."""
    root = tmp_path / "hot"
    hot, arc = _stores(tmp_path)
    with Checkpointer(hot, "r") as ck:
        ck.save(1, {"model": _model()}, kind="full")
    assert lifecycle.archive(hot, arc, "r", 1).ok
    began = time.time()
    manifest = catalog.read_manifest(hot, "r", 1)
    _rot(root, manifest)
    assert [step for _, step, _ in lifecycle.scrub(hot, older_than_s=0).corrupt] == [1]
    assert lifecycle.repair(hot, [arc]).ok and not damaged.records(hot)
    resumed = lifecycle.scrub(hot, older_than_s=0, verified_since=began)
    assert resumed.corrupt == [] and resumed.resumed == 0 and resumed.checked == 1
    assert lifecycle.read_record(hot, lifecycle.Subject.of(manifest), "validation")["ok"] is True
