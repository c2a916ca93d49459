"""Applying a retention plan: a plan is about commits, and time passes before it is
applied. What changed since (a promotion, a step committed again, new damage) keeps the
checkpoint; a read that failed decides nothing; expiring one commit of a step keeps the
records of another (an archive copy of an earlier commit)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ckptflow import Checkpointer, lifecycle, open_store
from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.catalog.verdicts import records_by_subject
from ckptflow.errors import StoreUnavailableError
from ckptflow.interop.registry import Registry
from ckptflow.lifecycle import retention_apply
from ckptflow.lifecycle.promote import PromotionRequest, promote
from ckptflow.policy.retention import DAY, AnyOf
from ckptflow.reports import inventory
from support.corrupt import corrupt_chunk
from support.faulty_store import FaultyStore

LATER = time.time() + 100 * DAY  # every checkpoint is old; AnyOf(()) keeps only what must never go


def saved(root, steps=(1, 2, 3), seed=0):
    with Checkpointer(root, "r") as ck:
        for step in steps:
            torch.manual_seed(seed + step)
            ck.save(step, {"model": nn.Linear(16, 16)}, metadata={"val_loss": 1.0 / step})
    return open_store(root)


def a_plan(hot, archive=None):
    _, plan = lifecycle.current_plan(hot, archive, Registry(hot), AnyOf(()), now=LATER)
    return plan


def test_a_checkpoint_published_after_the_plan_is_kept(tmp_path):
    hot = saved(str(tmp_path / "hot"))
    plan = a_plan(hot)
    assert set(plan.delete) == {("r", 1), ("r", 2)}
    version = promote(hot, Registry(hot), PromotionRequest("m", ("r", 1), stage="stable")).registered
    report = lifecycle.apply_retention(hot, None, plan, registry=Registry(hot))
    assert report.expired == [("r", 2)]
    [(ref, why)] = report.changed
    assert ref == ("r", 1) and "published" in why
    assert read_manifest(hot, "r", 1).digest == version.manifest_digest


def test_a_step_committed_again_after_the_plan_is_kept(tmp_path):
    """The plan expired step 3's first commit (it failed validation); training rejected it
    and saved step 3 again: that new commit is the run's newest valid checkpoint."""
    root = str(tmp_path / "hot")
    hot = saved(root)
    corrupt_chunk(root, "r", 3)
    assert lifecycle.validate(hot, "r", 3)["ok"] is False
    plan = a_plan(hot)
    assert ("r", 3) in plan.delete
    with Checkpointer(root, "r") as ck:
        model = nn.Linear(16, 16)
        assert ck.restore({"model": model}).step == 2
        ck.save(3, {"model": model})
    again = read_manifest(hot, "r", 3).digest
    report = lifecycle.apply_retention(hot, None, plan, registry=Registry(hot))
    assert ("r", 3) not in report.expired
    [(ref, why)] = report.changed
    assert ref == ("r", 3) and why.startswith("committed again since the plan")
    assert read_manifest(hot, "r", 3).digest == again
    assert a_plan(hot).keep[("r", 3)] == ["newest valid checkpoint of its run"]


def test_a_checkpoint_damaged_after_the_plan_saw_it_whole_is_kept_for_the_next_plan(tmp_path):
    root = str(tmp_path / "hot")
    hot = saved(root)
    plan = a_plan(hot)
    path = tmp_path / "hot" / "runs" / "r" / "checkpoints" / "000000000002" / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"step"', b'"stem"', 1))
    report = lifecycle.apply_retention(hot, None, plan, registry=Registry(hot))
    assert report.expired == [("r", 1)]
    [(ref, why)] = report.changed
    assert ref == ("r", 2) and why.startswith("damaged since the plan saw it whole")


def test_expiring_a_new_commit_keeps_the_records_of_the_earlier_one_the_archive_holds(tmp_path):
    root, archive = str(tmp_path / "hot"), open_store(str(tmp_path / "archive"))
    hot = saved(root)
    assert lifecycle.validate(hot, "r", 3)["ok"] and lifecycle.archive(hot, archive, "r", 3).ok
    first = read_manifest(hot, "r", 3).digest
    corrupt_chunk(root, "r", 3)
    with Checkpointer(root, "r") as ck:  # restore rejects the hot copy of step 3, then saves it again
        model = nn.Linear(16, 16)
        assert ck.restore({"model": model}).step == 2
        for step in (3, 4):
            ck.save(step, {"model": model})
    plan = a_plan(hot, archive)
    assert ("r", 3) in plan.delete  # the new commit of step 3 has no archive copy
    report = lifecycle.apply_retention(hot, archive, plan, registry=Registry(hot))
    assert ("r", 3) in report.hot_commits_expired and ("r", 3) not in report.expired  # the archive holds it
    assert sorted(records_by_subject(hot)[("r", 3, first)]) == ["archive", "validation"]
    [entry] = [e for e in inventory.collect(hot, archive) if e.ref == ("r", 3)]
    assert (entry.tiers, entry.validation, entry.archived) == (["archive"], "passed", True)


class ArchiveOutage(FaultyStore):
    """An archive whose commit records do not answer (the store retried, then gave up)."""

    def get_bounded(self, key, limit):
        if key.endswith("manifest.json"):
            raise StoreUnavailableError(f"{self.url}/{key}: 503 SlowDown after 5 attempts")
        return self.inner.get_bounded(key, limit)

    def get_versioned(self, key, limit=None):
        if key.endswith("manifest.json"):
            raise StoreUnavailableError(f"{self.url}/{key}: 503 SlowDown after 5 attempts")
        return self.inner.get_versioned(key, limit)


@pytest.mark.parametrize("down", ["archive", "hot"])
def test_an_outage_expires_nothing_of_that_checkpoint_and_keeps_its_records(tmp_path, down):
    hot, archive = saved(str(tmp_path / "hot")), open_store(str(tmp_path / "archive"))
    assert lifecycle.validate(hot, "r", 1)["ok"] and lifecycle.archive(hot, archive, "r", 1).ok
    plan = a_plan(hot, archive)
    assert set(plan.delete) == {("r", 1), ("r", 2)}
    report = lifecycle.apply_retention(
        ArchiveOutage(hot) if down == "hot" else hot,
        ArchiveOutage(archive) if down == "archive" else archive,
        plan,
        registry=Registry(hot),
    )
    # step 2 has no archive copy, but whether the archive holds an earlier commit of it (whose
    # records must stay) is not known either while the archive does not answer
    assert [ref for ref, _ in report.failed] == [("r", 1), ("r", 2)]
    assert "503 SlowDown" in report.failed[0][1]
    [entry] = [e for e in inventory.collect(hot, archive) if e.ref == ("r", 1)]
    assert (entry.tiers, entry.validation, entry.archived) == (["hot", "archive"], "passed", True)


def test_a_damaged_hot_commit_record_is_not_the_newest_valid_checkpoint_though_the_archive_copy_is_sound(tmp_path):
    """Step 3's hot manifest rotted; its archive copy is sound. A resume from the hot tier
    cannot load step 3, so step 2 is the newest valid checkpoint there and stays hot."""
    root, archive = str(tmp_path / "hot"), open_store(str(tmp_path / "archive"))
    hot = saved(root)
    assert lifecycle.validate(hot, "r", 3)["ok"] and lifecycle.archive(hot, archive, "r", 3).ok
    path = tmp_path / "hot" / "runs" / "r" / "checkpoints" / "000000000003" / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"step"', b'"stem"', 1))
    [entry] = [e for e in inventory.collect(hot, archive) if e.ref == ("r", 3)]
    assert entry.validation == "failed" and "manifest" in entry.manifest_error
    plan = a_plan(hot, archive)
    assert plan.keep[("r", 2)] == ["newest valid checkpoint of its run"]
    lifecycle.apply_retention(hot, archive, plan, registry=Registry(hot))
    with Checkpointer(root, "r") as ck:
        assert ck.restore({"model": nn.Linear(16, 16)}).step == 2
    [entry] = [e for e in inventory.collect(hot, archive) if e.ref == ("r", 3)]
    assert (entry.tiers, entry.validation, entry.archived) == (["archive"], "passed", True)


def test_a_checkpoint_published_before_the_plan_still_moves_to_the_archive(tmp_path):
    """Only what was published or aliased *since* the plan keeps a checkpoint: a promoted,
    exactly archived checkpoint the plan moved to archive-only loses its hot copy."""
    hot, archive = saved(str(tmp_path / "hot"), steps=(1, 2)), open_store(str(tmp_path / "archive"))
    promote(hot, Registry(hot), PromotionRequest("m", ("r", 1), stage="stable"))
    assert lifecycle.archive(hot, archive, "r", 1).ok
    _, plan = lifecycle.current_plan(hot, archive, Registry(hot), AnyOf(()), hot_days=1, now=LATER)
    assert ("r", 1) in plan.archive_only
    report = lifecycle.apply_retention(hot, archive, plan, registry=Registry(hot))
    assert report.hot_copies_expired == [("r", 1)] and report.changed == []


@pytest.mark.parametrize("how", ["damaged manifest", "retried expiry"])
def test_expiry_deletes_the_records_of_the_step_when_no_tier_holds_it(tmp_path, how):
    """Retention tells expire which commits another tier holds (here none): the records go
    with the checkpoint, of one whose manifest is damaged (they are keyed by the digest it
    had) or on a retry after a record's delete failed. Left behind, an older step's
    evaluation would be read as this run's previous one."""
    root = str(tmp_path / "hot")
    hot = saved(root, steps=(1, 2))
    assert lifecycle.validate(hot, "r", 1)["ok"]
    lifecycle.evaluate(hot, hot, "r", 1)
    if how == "damaged manifest":
        path = tmp_path / "hot" / "runs" / "r" / "checkpoints" / "000000000001" / "manifest.json"
        path.write_bytes(path.read_bytes().replace(b'"step"', b'"stem"', 1))
        lifecycle.expire(hot, "r", 1, keep_digests=())
    else:
        flaky, failures = FaultyStore(hot), [True]
        flaky.fail_if = lambda op, key: op == "delete" and key.startswith("lifecycle/") and failures and failures.pop()
        with pytest.raises(lifecycle.ExpireError, match="this expiry again"):
            lifecycle.expire(flaky, "r", 1, keep_digests=())
        lifecycle.expire(hot, "r", 1, keep_digests=())
    assert [subject for subject in records_by_subject(hot) if subject[:2] == ("r", 1)] == []


def test_an_expiry_called_by_hand_deletes_only_the_expired_commits_records_and_nothing_in_an_outage(tmp_path):
    """Without retention's knowledge of the archive, ``expire`` keeps the records of any
    other commit of the step (the one an archive copy holds); and a commit record that
    does not answer deletes nothing."""
    root, archive = str(tmp_path / "hot"), open_store(str(tmp_path / "archive"))
    hot = saved(root)
    assert lifecycle.validate(hot, "r", 3)["ok"] and lifecycle.archive(hot, archive, "r", 3).ok
    first = read_manifest(hot, "r", 3).digest
    corrupt_chunk(root, "r", 3)
    with Checkpointer(root, "r") as ck:
        model = nn.Linear(16, 16)
        assert ck.restore({"model": model}).step == 2
        ck.save(3, {"model": model})
    with pytest.raises(lifecycle.ExpireError, match="nothing of checkpoint r step 3 was deleted"):
        lifecycle.expire(ArchiveOutage(hot), "r", 3)
    assert read_manifest(hot, "r", 3).digest != first
    lifecycle.expire(hot, "r", 3)
    assert sorted(records_by_subject(hot)[("r", 3, first)]) == ["archive", "validation"]


def test_the_next_retention_finishes_an_expiry_that_failed_after_its_commit_record_went(tmp_path):
    """A record's delete failed after the commit record went: no plan sees the checkpoint
    again (no commit is left), so the ledger's marker is how the next retention finds the
    records left (an older step's evaluation would be read as the run's previous one)."""
    hot = saved(str(tmp_path / "hot"))
    for step in (1, 2):
        lifecycle.evaluate(hot, hot, "r", step)
    digest = read_manifest(hot, "r", 1).digest
    flaky, failures = FaultyStore(hot), [True]
    flaky.fail_if = lambda op, key: (
        op == "delete" and key.startswith("lifecycle/r/000000000001/") and failures and failures.pop()
    )
    report = lifecycle.apply_retention(flaky, None, a_plan(hot), registry=Registry(hot))
    assert report.expired == [("r", 2)] and [ref for ref, _ in report.failed] == [("r", 1)]
    assert ("r", 1, digest) in records_by_subject(hot) and not hot.exists(
        "runs/r/checkpoints/000000000001/manifest.json"
    )
    plan = a_plan(hot)
    assert ("r", 1) not in plan.delete  # nothing is left to plan about
    report = lifecycle.apply_retention(hot, None, plan, registry=Registry(hot))
    assert report.expiries_finished == [(("r", 1), digest)] and report.failed == []
    assert [s for s in records_by_subject(hot) if s[:2] in (("r", 1), ("r", 2))] == []
    assert not list(hot.list("ledger/expiring/"))


def _failed_validation(root: str, hot) -> None:
    corrupt_chunk(root, "r", 3)
    assert lifecycle.validate(hot, "r", 3)["ok"] is False


def _damaged_commit_record(root: str, hot) -> None:
    path = Path(root) / "runs" / "r" / "checkpoints" / "000000000003" / "manifest.json"
    path.write_bytes(path.read_bytes()[:-20] + b"\x00" * 20)


@pytest.mark.parametrize("doomed", [_failed_validation, _damaged_commit_record])
def test_a_step_committed_again_between_the_last_check_and_the_expiry_is_kept(tmp_path, monkeypatch, doomed):
    """The plan expired step 3's first commit (it failed validation, or its commit record is
    damaged: its digest "" in the plan, no checkpoint to name); the new commit of step 3
    (restore rejected the first and training saved it again) lands after retention checked
    the step was unchanged and before the expiry read it. The expiry read whatever the step
    held then and deleted the new commit, valid, and its verdict with it."""
    root = str(tmp_path / "hot")
    hot = saved(root)
    doomed(root, hot)
    plan = a_plan(hot)
    assert ("r", 3) in plan.delete and (plan.digests[("r", 3)] == "") == (doomed is _damaged_commit_record)
    decided = retention_apply._archived_commits  # called after the last check, right before the expiry

    def committed_again_meanwhile(archive, run, step):
        if step == 3:
            with Checkpointer(root, "r") as ck:
                model = nn.Linear(16, 16)
                assert ck.restore({"model": model}).step == 2
                ck.save(3, {"model": model})
            assert lifecycle.validate(hot, "r", 3)["ok"]
        return decided(archive, run, step)

    monkeypatch.setattr(retention_apply, "_archived_commits", committed_again_meanwhile)
    report = lifecycle.apply_retention(hot, None, plan, registry=Registry(hot))
    assert ("r", 3) not in report.expired
    [(ref, why)] = report.failed
    assert ref == ("r", 3) and "committed again while checkpoint r step 3 was being expired" in why
    again = read_manifest(hot, "r", 3)
    assert lifecycle.read_record(hot, lifecycle.Subject.of(again), "validation")["ok"]
    assert a_plan(hot).keep[("r", 3)] == ["newest valid checkpoint of its run"]
