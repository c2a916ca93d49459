"""Applying a retention plan: expire hot copies, keep what the archive holds.

The plan itself is pure (``ckptflow.policy.retention``); this is the one place it touches a
store, so the Dagster job, a cron script and the tests apply it the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import ledger, verdicts
from ckptflow.catalog.tiers import holds_commit
from ckptflow.chunks import leases
from ckptflow.chunks.lease_listing import wait_for_leases
from ckptflow.chunks.leases import PROMOTION_WAIT, PROMOTIONS, Heartbeat, exclusive_lock
from ckptflow.errors import CkptflowError, RetentionError
from ckptflow.format.manifest import Manifest
from ckptflow.interop.registry import Registry
from ckptflow.lifecycle.expire import expire
from ckptflow.policy.retention import Commit, Ref, RetentionPlan, RetentionPolicy
from ckptflow.reports import inventory
from ckptflow.store.base import Store

log = logging.getLogger("ckptflow")


@dataclass
class RetentionReport:
    expired: list[Ref] = field(default_factory=list)  # gone from every tier
    hot_copies_expired: list[Ref] = field(default_factory=list)  # the archive copy stays
    # the hot commit went, never archived; the archive still holds an earlier commit of the step
    hot_commits_expired: list[Ref] = field(default_factory=list)
    left_hot: list[tuple[Ref, str]] = field(default_factory=list)  # archive-only by plan, copy not confirmed
    changed: list[tuple[Ref, str]] = field(default_factory=list)  # not what the plan decided about any more: kept
    failed: list[tuple[Ref, str]] = field(default_factory=list)  # an expiry failed; the checkpoint stays
    expiries_finished: list[tuple[Ref, str]] = field(default_factory=list)  # (ref, digest): an earlier one's records


def current_plan(
    hot: Store,
    archive: Store | None,
    registry: Registry,
    policy: RetentionPolicy | None = None,
    *,
    pinned: Iterable[Ref] = (),
    hot_days: float | None = None,
    now: float | None = None,
) -> tuple[list[inventory.Entry], RetentionPlan]:
    """The inventory and the plan for it now: pinned = what is committed now under the
    names in ``pinned`` plus the commit every published model version came from; aliased
    from the registry."""
    entries = inventory.collect(hot, archive)
    names = set(pinned)
    plan = inventory.retention_plan(
        entries,
        time.time() if now is None else now,
        pinned=registry.pinned() | {(e.run, e.step, e.digest) for e in entries if e.ref in names},
        aliased=registry.aliased(),
        policy=policy,
        hot_days=hot_days,
    )
    return entries, plan


def apply_retention(
    hot: Store, archive: Store | None, plan: RetentionPlan, *, registry: Registry, wait: float = PROMOTION_WAIT
) -> RetentionReport:
    """Expire the hot copy of every checkpoint the plan expires.

    A checkpoint whose archive copy verified and matches (same manifest digest) keeps
    that copy and its lifecycle records: only its hot copy goes. One without loses
    everything, unless the plan only moves it to the archive, in which case its hot copy
    stays. Retention never deletes from the archive. An expiry that fails leaves that
    checkpoint in place and is reported; the others go on.

    A plan is about commits, and time passes between a plan and its apply: each
    checkpoint is read again right before it goes, and kept (``changed``) if its step was
    committed again since (the plan saw another commit), if a model version was
    published from it or an alias moved to it since (the registry is read again before
    the first expiry, and compared with what the plan knew), or if it is damaged now
    where the plan saw it whole; the expiry then deletes the planned commit only
    (``expire(commit=)``), so one landing after that read is kept too (``failed``, saying
    it was committed again). One whose commit record cannot be read now (an outage)
    is ``failed``: nothing is decided on a read that failed. Expiring a checkpoint with
    no matching archive copy deletes its lifecycle records, but not those of the commit
    the archive holds at that step (an earlier commit: its verdicts still describe it).

    Promotions and retention exclude each other (``ckptflow.chunks.leases.PROMOTIONS``):
    retention takes its lock in ``hot``, waits up to ``wait`` seconds for promotions in
    flight, and reads the registry only then, so a version registered meanwhile is seen
    and one registered later waits. Promotions still publishing after ``wait``, or
    another retention holding the lock, raise ``RetentionError``; nothing was expired.
    """
    report = RetentionReport()
    if not plan.expire_hot and not ledger.unfinished_expiries(hot):
        return report
    with exclusive_lock(hot, PROMOTIONS) as lock:
        held = wait_for_leases(hot, wait, family=PROMOTIONS)
        if held.live:
            raise RetentionError(
                f"{len(held.live)} promotion(s) are publishing checkpoints of {hot.url} ({held.live[0].key}, renewed "
                f"within the last {leases.DEAD_AFTER:.0f} s) after {wait:.0f} s; nothing was expired: run retention "
                "again when they finish"
            )
        for info in held.dead:
            hot.delete(info.key)
        protected = (registry.pinned() | set(registry.aliased())) - plan.protected
        _expire_planned(hot, archive, plan, protected, lock, report)
        if not lock.lost:
            _finish_expiries(hot, archive, report)
    return report


def _finish_expiries(hot: Store, archive: Store | None, report: RetentionReport) -> None:
    """Finish expiries that failed (or died) after their commit record went: no later
    plan sees them, since no commit is left to plan about (``ledger.expiry_begun``).
    The records still held for that commit go now, unless the archive holds it. One
    whose commit is still held (its record's delete failed, or an expiry by hand is at
    work) is left, marker and all: the plan decides about it, and its next expiry
    clears the marker."""
    just_failed = {ref for ref, _ in report.failed}  # not again at once: the next retention tries it
    for run, step, digest, key in ledger.unfinished_expiries(hot):
        if (run, step) in just_failed:
            continue
        try:
            held = catalog.manifest_or_damage(hot, run, step)
            if isinstance(held, Manifest) and held.digest == digest:
                continue
            if digest not in _archived_commits(archive, run, step):
                for record in verdicts.step_record_keys(hot, run, step, only=digest):
                    hot.delete(record)
                report.expiries_finished.append(((run, step), digest))
            ledger.expiry_done(hot, key)
        except (CkptflowError, OSError) as e:
            log.warning("retention could not finish the expiry of %s step %d (%s…): %s", run, step, digest[:12], e)
            report.failed.append(((run, step), f"finishing its expiry: {e}"))


def _expire_planned(
    hot: Store,
    archive: Store | None,
    plan: RetentionPlan,
    protected: set[Commit],
    lock: Heartbeat,
    report: RetentionReport,
) -> None:
    for ref in plan.expire_hot:
        run, step = ref
        if lock.lost:
            report.failed.append((ref, f"retention lost its lock ({PROMOTIONS.lock}) and stopped before this one"))
            continue
        try:
            changed = _changed_since(hot, ref, plan.digests.get(ref, ""), protected)
            if changed:
                report.changed.append((ref, changed))
                continue
            why_not = copy_matches(hot, archive, run, step) if archive is not None else "no archive tier"
            # the commit the plan is about; "": its record was damaged (an unread one is never expired)
            decided = plan.digests.get(ref)
            if why_not is None:
                expire(hot, run, step, keep_records=True, commit=decided)
                report.hot_copies_expired.append(ref)
            elif ref in plan.archive_only:
                report.left_hot.append((ref, why_not))
            else:
                archived = _archived_commits(archive, run, step)
                expire(hot, run, step, keep_digests=archived, commit=decided)
                held = archive is not None and holds_commit(archive.metadata_store(), run, step)
                (report.hot_commits_expired if held else report.expired).append(ref)
        except CkptflowError as e:
            log.warning("retention could not expire %s step %d: %s", run, step, e)
            report.failed.append((ref, str(e)))


def _archived_commits(archive: Store | None, run: str, step: int) -> set[str]:
    """The digests whose records describe what ``archive`` holds at ``(run, step)``: its
    commit, and for a lossy copy the exact commit it was made from. None read proves no
    copy missing: an outage is raised, so nothing is decided on it."""
    manifest = catalog.manifest_or_damage(archive.metadata_store(), run, step) if archive is not None else None
    if not isinstance(manifest, Manifest):
        return set()
    source = (manifest.lossy or {}).get("source_digest")
    return {manifest.digest, *([source] if isinstance(source, str) else [])}


def _changed_since(hot: Store, ref: Ref, planned: str, protected: set[Commit]) -> str | None:
    """Why the checkpoint at ``ref`` is no longer the one the plan expired (``planned``:
    its digest then, "" for a commit record that did not read as a checkpoint); None
    if it is. A read that fails without proving damage is raised."""
    run, step = ref
    manifest = catalog.manifest_or_damage(hot, run, step)
    if not isinstance(manifest, Manifest):
        return f"damaged since the plan saw it whole ({manifest}); the next plan decides" if planned else None
    digest = manifest.digest
    if digest != planned:
        before = f"{planned[:12]}…" if planned else "one that did not read"
        return f"committed again since the plan ({before} then, {digest[:12]}… now); the next plan decides"
    if (run, step, digest) in protected:
        return "a model version was published from it, or an alias moved to it, since the plan"
    return None


def archive_only_beyond(entries: Iterable[inventory.Entry], report: RetentionReport, keep: int) -> list[Ref]:
    """Archive-only checkpoints (after ``report``) other than the newest ``keep``, sorted.

    An orchestrator that gives every checkpoint a partition pays for each one on every
    evaluation of its automation; archive-only checkpoints have finished their lifecycle,
    so past the newest ``keep`` of them their partitions can go (their archive copies,
    lifecycle records and inventory rows stay). That bounds the partitions to the hot
    checkpoints plus ``keep``.
    """
    expired = set(report.expired)
    archive_only = {e.ref: e.created_at for e in entries if "hot" not in e.tiers and e.ref not in expired}
    created = {e.ref: e.created_at for e in entries}
    archive_only.update({ref: created.get(ref, 0.0) for ref in report.hot_copies_expired + report.hot_commits_expired})
    newest_first = sorted(archive_only, key=lambda ref: (archive_only[ref], ref), reverse=True)
    return sorted(newest_first[max(0, keep) :])


def copy_matches(hot: Store, archive: Store, run: str, step: int) -> str | None:
    """None if ``archive`` holds this exact checkpoint (the same manifest digest as the
    hot copy) and archival verified it there; else why not. Checked right before a
    hot copy is expired. A manifest that could not be read (an outage, a denied or cold
    object) proves no copy missing: that error is raised, so nothing is decided on it."""
    hot_manifest = catalog.manifest_or_damage(hot, run, step)
    if not isinstance(hot_manifest, Manifest):
        return str(hot_manifest)
    record = verdicts.read_record(hot, verdicts.Subject.of(hot_manifest), "archive") or {}
    if not record.get("ok"):
        return "archival has not verified a copy in the archive tier"
    if record.get("url") not in (None, archive.url):
        return f"it was archived to {record['url']}, not {archive.url}"
    arc_manifest = catalog.manifest_or_damage(archive.metadata_store(), run, step)
    if not isinstance(arc_manifest, Manifest):
        return str(arc_manifest)
    expected = record.get("archive_digest") or hot_manifest.digest  # a lossy copy has its own digest
    if arc_manifest.digest != expected:
        return f"the archive's manifest differs ({arc_manifest.digest[:12]}… vs {expected[:12]}…)"
    if arc_manifest.digest != hot_manifest.digest:  # a lossy copy, with a verdict of its own: the archive scrub's
        # (an exact copy of a checkpoint that is itself lossy, an import of a lossy export, names its own source)
        if (arc_manifest.lossy or {}).get("source_digest") != hot_manifest.digest:
            return "the archive holds a lossy copy of another commit of this step"
        verdict = verdicts.read_record(hot, verdicts.Subject.of(arc_manifest), "validation")
        if verdict is not None and not verdict["ok"]:
            return "the archive's copy failed validation since it was archived (a scrub found it damaged)"
    return None
