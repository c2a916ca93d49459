"""Pins and aliases belong to a commit (run, step, manifest digest): they protect the
checkpoint a model version came from, never a later commit of the same step."""

import torch
from torch import nn

from ckptflow import Checkpointer, lifecycle, open_store
from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.interop.registry import Registry
from ckptflow.lifecycle.promote import PromotionRequest, promote, rebuild
from ckptflow.policy.retention import DAY, AnyOf, Candidate, KeepRecent, plan

NOW = 1_000 * DAY


def c(step, digest, valid=True, **kw):
    return Candidate(run="r", step=step, kind="full", created_at=NOW - 100 * DAY, valid=valid, digest=digest, **kw)


def test_a_pin_or_alias_of_another_commit_of_the_step_protects_nothing():
    cands = [c(10, "B"), c(20, "B"), c(30, "C")]
    p = plan(cands, NOW, pinned=[("r", 10, "A")], aliased={("r", 20, "A"): ["m:stable"]}, policy=AnyOf(()))
    assert set(p.delete) == {("r", 10), ("r", 20)}
    p = plan(cands, NOW, pinned=[("r", 10, "B")], aliased={("r", 20, "B"): ["m:stable"]}, policy=AnyOf(()))
    assert p.keep[("r", 10)] == ["pinned / published"] and p.keep[("r", 20)] == ["model alias m:stable"]


def test_a_checkpoint_whose_manifest_could_not_be_read_is_protected_by_any_pin_of_its_name():
    """Its digest is unknown: retention does not delete what it cannot tell apart."""
    cands = [c(10, "", valid=False), c(20, "", valid=False), c(30, "C")]
    p = plan(cands, NOW, pinned=[("r", 10, "A")], aliased={("r", 20, "A"): ["m:stable"]}, policy=AnyOf(()))
    assert set(p.keep) == {("r", 10), ("r", 20), ("r", 30)} and not p.delete


def test_the_exact_copy_stays_hot_only_for_the_commit_that_was_pinned():
    lossy = {"archived": True, "archive_lossy": True}
    cands = [c(10, "A", **lossy), c(20, "B", **lossy), c(30, "C")]
    p = plan(cands, NOW, pinned=[("r", 10, "A"), ("r", 20, "A")], policy=KeepRecent(365), hot_days=7)
    assert ("r", 10) not in p.archive_only  # the pinned commit: its exact copy stays hot
    assert ("r", 20) in p.archive_only  # another commit: the lossy archive copy will do


def test_a_version_from_a_rejected_commit_keeps_its_archive_copy_not_the_replacement(tmp_path):
    """v1 is published from r/1 (digest A), which is archived, then expired from the hot tier
    and step 1 committed again (B). Retention keeps B only on its own merits; the archive
    copy of A still rebuilds v1."""
    hot, archive = open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "archive"))
    with Checkpointer(hot.root, "r") as ck:
        for step in (1, 2):
            torch.manual_seed(step)
            ck.save(step, {"model": nn.Linear(16, 16)}, metadata={"val_loss": 1.0 / step})
    registry = Registry(hot)
    v1 = promote(hot, registry, PromotionRequest("m", ("r", 1), stage="stable")).registered
    assert lifecycle.archive(hot, archive, "r", 1).ok
    lifecycle.expire(hot, "r", 1)
    with Checkpointer(hot.root, "r") as ck:
        torch.manual_seed(99)
        ck.save(1, {"model": nn.Linear(16, 16)})
    replacement = read_manifest(hot, "r", 1).digest
    assert replacement != v1.manifest_digest

    _, retention = lifecycle.current_plan(hot, archive, registry, AnyOf(()), now=NOW)
    assert ("r", 1) in retention.delete and ("r", 2) in retention.keep
    report = lifecycle.apply_retention(hot, archive, retention, registry=registry)
    assert report.hot_commits_expired == [("r", 1)] and report.expired == []  # the archive holds A
    assert read_manifest(archive.metadata_store(), "r", 1).digest == v1.manifest_digest
    hot.delete(registry.file_key("m", v1.files["model.safetensors"]["sha256"]))
    assert rebuild(registry, "m", v1.version, [hot, archive]) == ["model.safetensors"]
