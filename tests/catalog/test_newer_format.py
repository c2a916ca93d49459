"""A checkpoint a newer ckptflow wrote (sealed whole, a ``format_version`` above what this
one reads) is not damage: restore stops instead of falling back past it, a save never
moves it aside, GC sweeps nothing, validation records no verdict, export stops, and
retention keeps it. Only a record whose checksum fails, or whose version no ckptflow
writes, is damage."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ckptflow import Checkpointer, ManifestError, NewerFormatError, lifecycle, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import commit
from ckptflow.catalog.gc import gc
from ckptflow.dcp.failures import Failure
from ckptflow.errors import is_damage
from ckptflow.format import layout as fmt
from ckptflow.format.sealed import seal, unseal
from ckptflow.interop.export.tensors import newest_verified_step
from ckptflow.interop.registry import Registry
from ckptflow.lifecycle import Subject, read_record, scrub, validate
from ckptflow.reports import inventory
from ckptflow.training.restore import agree
from support.cli import run_cli
from support.corrupt import manifest_path, reseal_manifest, tree_bytes

RUN = "r"
NEWER = max(fmt.READABLE_FORMATS) + 1


def state(value: float) -> dict:
    return {"w": torch.full((256,), value), "v": torch.full((64,), -value)}


@pytest.fixture
def saved(tmp_path):
    """Steps 1 and 2 committed."""
    root = str(tmp_path / "store")
    with Checkpointer(root, run=RUN) as ck:
        ck.save(1, state(1.0))
        ck.save(2, state(2.0))
    return root


def make_newer(root: str) -> int:
    """Seal step 2's manifest again as a newer format; the format it had."""
    original = json.loads(manifest_path(root, RUN, 2).read_bytes())["format_version"]
    reseal_manifest(root, RUN, 2, lambda record: record.update(format_version=NEWER))
    return original


@pytest.fixture
def root(saved):
    """Steps 1 and 2 committed; step 2's manifest then sealed again as a newer format."""
    make_newer(saved)
    return saved


def test_a_newer_format_is_not_damage_but_a_broken_or_impossible_one_is():
    record = {"format_version": NEWER, "run": RUN}
    with pytest.raises(NewerFormatError) as newer:
        unseal(seal(record), "manifest m")
    assert not is_damage(newer.value) and "newer ckptflow" in str(newer.value) and "upgrade" in str(newer.value)
    flipped = seal(record).replace(b'"r"', b'"s"')  # the checksum no longer covers it
    with pytest.raises(ManifestError, match="fails its checksum"):
        unseal(flipped, "manifest m")
    for version in ("4", True, 0, -1, 2.0, 2.5, None):
        with pytest.raises(ManifestError, match="no ckptflow writes") as err:
            unseal(seal({"format_version": version}), "manifest m")
        assert is_damage(err.value)


def test_restore_stops_at_a_newer_checkpoint_and_leaves_the_state_alone(root):
    target = state(0.0)
    with Checkpointer(root, run=RUN) as ck:
        with pytest.raises(NewerFormatError) as err:
            ck.restore(target)
        assert torch.equal(target["w"], torch.zeros(256)) and torch.equal(target["v"], torch.zeros(64))
        message = str(err.value)
        assert f"run {RUN!r} step 2" in message and "stopped rather than fall back" in message
        assert f"format_version {NEWER}" in message and "upgrade ckptflow" in message and "step=N" in message
        assert ck.restore(target, step=1).step == 1  # an older step, named, still loads
    assert torch.equal(target["w"], torch.full((256,), 1.0))


def test_ranks_agree_that_a_newer_checkpoint_stops_the_restore():
    class Gathered:
        def __init__(self, failures):
            self.failures = failures

        def all_gather(self, _mine):
            return self.failures

    newer = Failure("written by a newer ckptflow", damage=False, newer=True)
    damaged = Failure("chunk does not match its address", damage=True)
    combined = agree(Gathered([damaged, newer]), damaged)  # type: ignore[arg-type]
    assert combined is not None and combined.newer and not combined.damage
    assert not agree(Gathered([damaged, damaged]), damaged).newer  # type: ignore[arg-type, union-attr]


def test_a_save_over_a_newer_checkpoint_is_refused_and_moves_nothing(root):
    before = tree_bytes(root)
    with Checkpointer(root, run=RUN) as ck:
        with pytest.raises(NewerFormatError, match="neither replaced nor moved aside"):
            ck.save(2, state(3.0))
        ck.save(3, state(3.0))  # another step is no concern of the newer one
    after = tree_bytes(root)
    assert {k: v for k, v in after.items() if k in before} == before
    assert not any("quarantine" in key for key in after)


def test_a_newer_manifest_found_at_commit_is_neither_replaced_nor_moved(root):
    """The commit's own path: the step was committed by a newer writer while this save ran."""
    store = open_store(root)
    theirs = manifest_path(root, RUN, 2).read_bytes()
    ours = manifest_path(root, RUN, 1).read_bytes()
    with pytest.raises(NewerFormatError):
        commit.commit_manifest(store, RUN, 2, ours, pool=None, replaces=None)  # type: ignore[arg-type]
    assert manifest_path(root, RUN, 2).read_bytes() == theirs
    assert not os.path.exists(os.path.join(root, "runs", RUN, "quarantine"))


def test_gc_sweeps_nothing_while_a_newer_checkpoint_is_in_the_store(root):
    with Checkpointer(root, run=RUN) as ck:
        ck.save(3, {"w": torch.full((256,), 9.0), "v": torch.full((64,), 9.0)})
    # what only step 1 referenced is garbage once step 1 is gone, but step 2 may still need it
    os.remove(manifest_path(root, RUN, 1))
    before = tree_bytes(root)
    report = gc(root, grace="0s")
    assert report.deleted == [] and report.skipped is not None
    assert "newer ckptflow" in report.skipped and "run gc with a ckptflow that reads it" in report.skipped
    assert tree_bytes(root) == before


def test_verify_validate_scrub_and_export_say_upgrade_and_record_nothing(root, capsys):
    code, out, err = run_cli(capsys, "verify", root, "--run", RUN)
    assert code == 3, (out, err)
    assert "newer ckptflow" in out and "none of them proof of damage" in err and "reads it" in err
    store = open_store(root)
    digest = fmt.digest_of(manifest_path(root, RUN, 2).read_bytes())
    with pytest.raises(NewerFormatError, match="no verdict was recorded"):
        validate(store, RUN, 2)
    assert read_record(store, Subject(RUN, 2, digest), "validation") is None
    report = scrub(store, older_than_s=0.0, now=2e9)
    assert report.corrupt == report.unreadable == [] and any("newer ckptflow" in line for line in report.newer)
    with pytest.raises(NewerFormatError, match="export of run 'r' step 2 .* stopped rather than fall back"):
        newest_verified_step(store, RUN)
    code, out, err = run_cli(capsys, "export", root, "--run", RUN, "--out", os.path.join(root, "..", "exported"))
    assert code == 3 and "newer ckptflow" in err and not os.path.exists(os.path.join(root, "..", "exported"))
    assert catalog.verify_checkpoint(store, RUN, 2).newer is not None


def test_retention_keeps_a_newer_checkpoint_and_the_newest_one_it_can_read(root):
    entries = inventory.collect(open_store(root))
    newer = next(e for e in entries if e.step == 2)
    assert newer.validation == "unreadable" and newer.valid is None
    plan = inventory.retention_plan(entries, now=4e9)  # long after every age rule
    assert plan.delete == {}
    assert "could not be read" in plan.keep[(RUN, 2)][0] and "newer ckptflow" in plan.keep[(RUN, 2)][0]
    assert plan.keep[(RUN, 1)] == ["newest valid checkpoint of its run"]
    assert inventory.recovery_choices(open_store(root), entries)[0]["latest"] == "stops at 2 (unreadable)"


def test_an_archive_copy_of_an_older_commit_does_not_let_retention_expire_a_newer_one(tmp_path):
    """Step 1 archived (commit A), its hot copy expired, then committed again in the hot tier
    by a newer ckptflow (B): the archive's A says nothing about B, so B stays."""
    hot, archive = open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "archive"))
    with Checkpointer(hot.root, run=RUN) as ck:
        ck.save(1, state(1.0))
        ck.save(2, state(2.0))
    assert lifecycle.archive(hot, archive, RUN, 1).ok
    lifecycle.expire(hot, RUN, 1, keep_records=True)
    with Checkpointer(hot.root, run=RUN) as ck:
        ck.save(1, state(9.0))
    reseal_manifest(hot.root, RUN, 1, lambda record: record.update(format_version=NEWER))
    theirs = manifest_path(hot.root, RUN, 1).read_bytes()
    entries, plan = lifecycle.current_plan(hot, archive, Registry(hot), now=4e9)
    assert next(e for e in entries if e.step == 1).validation == "unreadable" and (RUN, 1) in plan.keep
    report = lifecycle.apply_retention(hot, archive, plan, registry=Registry(hot))
    assert (RUN, 1) not in report.expired + report.hot_copies_expired
    assert manifest_path(hot.root, RUN, 1).read_bytes() == theirs


def test_a_rank_record_newer_than_its_readable_manifest_is_damage(saved):
    """A newer writer seals its manifest in its own format too: such a rank record is not
    that commit's, so restore falls back past it."""
    store = open_store(saved)
    key = catalog.read_manifest(store, RUN, 2).rank_key(0)
    record = json.loads(store.get(key))
    record.pop("checksum")
    store.replace(key, seal({**record, "format_version": NEWER}))
    target = state(0.0)
    with Checkpointer(saved, run=RUN) as ck:
        result = ck.restore(target)
    assert result.step == 1 and "not that commit's" in result.skipped[0][1]
    assert catalog.verify_checkpoint(store, RUN, 2).damaged


def test_an_archive_copy_that_cannot_be_read_does_not_mark_the_hot_one(saved, tmp_path):
    """The inventory describes a checkpoint by the hot copy it read; the archive copy's
    problem is scrub's to report, not a verdict on the hot one."""
    hot, archive = open_store(saved), open_store(str(tmp_path / "archive"))
    assert lifecycle.archive(hot, archive, RUN, 1).ok
    reseal_manifest(archive.root, RUN, 1, lambda record: record.update(format_version=NEWER))
    entry = next(e for e in inventory.collect(hot, archive) if e.step == 1)
    assert entry.tiers == ["hot", "archive"] and entry.validation == "not checked" and entry.digest


def test_what_an_old_reader_met_loads_once_a_reader_knows_its_format(saved):
    """Every refusal above changed nothing: a reader of that format restores it exactly."""
    original = make_newer(saved)
    with Checkpointer(saved, run=RUN) as ck:
        for attempt in (lambda: ck.restore(state(0.0)), lambda: ck.save(2, state(5.0))):
            with pytest.raises(NewerFormatError):
                attempt()
    gc(saved, grace="0s")
    reseal_manifest(saved, RUN, 2, lambda record: record.update(format_version=original))
    target = state(0.0)
    with Checkpointer(saved, run=RUN) as ck:
        assert ck.restore(target).step == 2
    assert torch.equal(target["w"], torch.full((256,), 2.0)) and torch.equal(target["v"], torch.full((64,), -2.0))
