"""Retention plans over hand-built histories: every rule, and the never-delete rules."""

import pytest

from ckptflow.policy.retention import (
    DAY,
    AnyOf,
    Candidate,
    KeepBestK,
    KeepFullWithin,
    KeepRecent,
    default_policy,
    plan,
)
from ckptflow.policy.scores import TRAINER

NOW = 1_000 * DAY


def c(step, age_days, kind="incremental", run="r", valid=True, **metrics):
    return Candidate(
        run=run,
        step=step,
        kind=kind,
        created_at=NOW - age_days * DAY,
        scales={metric: {TRAINER: figure} for metric, figure in metrics.items()},
        valid=valid,
        digest=digest(run, step),
    )


def digest(run, step):
    """The manifest digest of a hand-built candidate (any string names a commit here)."""
    return f"{run}-{step}-first-commit"


def history():
    """Run 'r': steps 10..100, one per 5 days back from today (step 100 is newest)."""
    out = []
    for i, step in enumerate(range(100, 0, -10)):
        kind = "full" if step % 40 == 0 else "incremental"
        out.append(c(step, age_days=i * 5 + 1, kind=kind, val_loss=1.0 + abs(step - 50) / 100))
    return out


def test_default_policy_keeps_recent_full_within_30_days_best_k_and_newest():
    p = plan(history(), NOW, policy=default_policy(best_k=2))
    # ages: 100:1d 90:6d 80:11d 70:16d 60:21d 50:26d 40:31d 30:36d 20:41d 10:46d
    assert set(p.keep) == {("r", 100), ("r", 90), ("r", 80), ("r", 50), ("r", 60)}
    assert any("younger than 7 days" in r for r in p.keep[("r", 90)])
    assert p.keep[("r", 80)] == ["full checkpoint younger than 30 days"]
    assert any(r.startswith("best 1 of 10 by min val_loss") for r in p.keep[("r", 50)])
    # 40 and 60 tie on val_loss: the newer wins, so the 31-day-old full step 40 expires
    assert any(r.startswith("best 2") for r in p.keep[("r", 60)])
    assert "newest valid checkpoint of its run" in p.keep[("r", 100)]
    assert set(p.delete) == {("r", 70), ("r", 40), ("r", 30), ("r", 20), ("r", 10)}
    assert "no retention rule keeps it" in p.delete[("r", 10)]
    assert set(p.keep).isdisjoint(p.delete)


def test_old_full_checkpoint_expires_after_30_days():
    p = plan([c(40, 31, "full"), c(80, 29, "full"), c(90, 1)], NOW, policy=default_policy(best_k=0))
    assert set(p.delete) == {("r", 40)}


def test_best_k_max_mode_and_per_run():
    cands = [c(s, 100, run="a", acc=s / 100) for s in (10, 20, 30)] + [
        c(s, 100, run="b", acc=1 - s / 100) for s in (10, 20, 30)
    ]
    p = plan(cands, NOW, policy=AnyOf((KeepBestK("acc", 1, "max"),)))
    # best per run (max acc) plus newest per run (never-delete)
    assert set(p.keep) == {("a", 30), ("b", 10), ("b", 30)}
    with pytest.raises(ValueError):
        KeepBestK("acc", 1, "median")


def test_best_k_ignores_invalid_and_unscored():
    cands = [c(10, 100, val_loss=0.1, valid=False), c(20, 100, val_loss=0.5), c(30, 100), c(40, 100, val_loss=0.9)]
    p = plan(cands, NOW, policy=AnyOf((KeepBestK("val_loss", 1),)))
    assert ("r", 20) in p.keep and ("r", 10) in p.delete
    assert p.delete[("r", 10)].startswith("invalid")


def test_never_delete_pinned_and_aliased_even_under_an_empty_policy():
    cands = [c(10, 400, "full"), c(20, 300), c(30, 200), c(40, 100)]
    aliased = {("r", 20, digest("r", 20)): ["stable", "fallback"]}
    p = plan(cands, NOW, pinned=[("r", 10, digest("r", 10))], aliased=aliased, policy=AnyOf(()))
    assert p.keep[("r", 10)] == ["pinned / published"]
    assert p.keep[("r", 20)] == ["model alias fallback, stable"]
    assert p.keep[("r", 40)] == ["newest valid checkpoint of its run"]
    assert set(p.delete) == {("r", 30)}


def test_never_delete_rules_apply_to_a_bare_rule_too():
    p = plan([c(10, 100), c(20, 50)], NOW, pinned=[("r", 10, digest("r", 10))], policy=KeepRecent(7))
    assert set(p.keep) == {("r", 10), ("r", 20)} and not p.delete


def test_newest_valid_skips_corrupt_newest():
    cands = [c(10, 100), c(20, 90), c(30, 80, valid=False)]
    p = plan(cands, NOW, policy=AnyOf(()))
    assert set(p.keep) == {("r", 20)}
    assert set(p.delete) == {("r", 10), ("r", 30)}


def test_a_checkpoint_whose_commit_record_could_not_be_read_is_never_deleted():
    """Nothing is known of it (an outage, a cold object, a newer format): no rule may expire
    it, and the newest one that could be read stays as the newest valid."""
    unread = Candidate(run="r", step=30, kind="?", created_at=0.0, valid=None, unread="S3 503 SlowDown")
    p = plan([c(10, 100), c(20, 90), unread], NOW, policy=AnyOf(()))
    assert p.keep == {
        ("r", 20): ["newest valid checkpoint of its run"],
        ("r", 30): ["its commit record could not be read (S3 503 SlowDown): no decision without it"],
    }
    assert set(p.delete) == {("r", 10)}


def test_unvalidated_counts_as_valid_for_newest_but_invalid_recent_is_kept():
    p = plan([c(10, 100), c(20, 90, valid=None), c(30, 1, valid=False)], NOW, policy=default_policy(best_k=0))
    assert ("r", 20) in p.keep and ("r", 30) in p.keep and ("r", 10) in p.delete
    assert p.verdict(("r", 10)).startswith("delete:") and p.verdict(("r", 30)).startswith("keep:")


def test_full_within_rule_does_not_keep_invalid_full():
    p = plan([c(10, 10, "full", valid=False), c(20, 10, "full")], NOW, policy=AnyOf((KeepFullWithin(30),)))
    assert set(p.delete) == {("r", 10)}


def test_hot_days_moves_archived_kept_checkpoints_to_the_archive_only():
    """Tiers: kept + archived + older than ``hot_days`` -> archive only (hot copy expires);
    unarchived ones and the newest valid checkpoint stay hot whatever their age."""
    cands = [
        Candidate(run="r", step=10, kind="full", created_at=NOW - 20 * DAY, valid=True, archived=True),
        Candidate(run="r", step=20, kind="full", created_at=NOW - 10 * DAY, valid=True, archived=False),
        Candidate(run="r", step=30, kind="full", created_at=NOW - 9 * DAY, valid=True, archived=True),
        Candidate(run="r", step=40, kind="full", created_at=NOW - 1 * DAY, valid=True, archived=True),
    ]
    p = plan(cands, NOW, policy=default_policy(recent_days=0, full_days=30, best_k=0), hot_days=2)
    assert set(p.keep) == {("r", 10), ("r", 20), ("r", 30), ("r", 40)} and not p.delete
    assert set(p.archive_only) == {("r", 10), ("r", 30)}  # 20: no archive copy; 40: young
    assert p.expire_hot == [("r", 10), ("r", 30)]
    assert p.verdict(("r", 10)).startswith("keep in archive only (hot copy expires): archived and older than 2 days")
    old_newest = [Candidate(run="r", step=50, kind="full", created_at=NOW - 5 * DAY, valid=True, archived=True)]
    assert not plan(old_newest, NOW, hot_days=0).archive_only  # what a resume loads stays hot
    assert not plan(cands, NOW, policy=default_policy(recent_days=0, full_days=30, best_k=0)).archive_only


def test_archive_only_checkpoints_beyond_the_newest_n_lose_their_partitions():
    """After retention: 1, 2 were archive-only already, 3 just lost its hot copy, 4 was
    expired from every tier, 5 is hot. Only the newest ``keep`` archive-only ones stay."""
    from ckptflow.lifecycle import RetentionReport, archive_only_beyond
    from ckptflow.reports.inventory import Entry

    entries = [
        Entry("r", 1, created_at=10.0, tiers=["archive"]),
        Entry("r", 2, created_at=20.0, tiers=["archive"]),
        Entry("r", 3, created_at=30.0, tiers=["hot", "archive"]),
        Entry("r", 4, created_at=40.0, tiers=["hot"]),
        Entry("r", 5, created_at=50.0, tiers=["hot"]),
    ]
    report = RetentionReport(expired=[("r", 4)], hot_copies_expired=[("r", 3)])
    assert archive_only_beyond(entries, report, keep=1) == [("r", 1), ("r", 2)]
    assert archive_only_beyond(entries, report, keep=0) == [("r", 1), ("r", 2), ("r", 3)]
    assert archive_only_beyond(entries, report, keep=3) == []
