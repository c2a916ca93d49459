"""Applying a retention plan: expire hot copies, keep what the archive holds.

The plan itself is pure (``ckptflow.policy.retention``); this is the one place it touches a
store, so the Dagster job, a cron script and the tests apply it the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from ckptflow.interop.registry import Registry
from ckptflow.lifecycle.archive import copy_matches
from ckptflow.lifecycle.expire import ExpireError, expire
from ckptflow.policy.retention import Ref, RetentionPlan, RetentionPolicy
from ckptflow.reports import inventory
from ckptflow.store.base import Store

log = logging.getLogger("ckptflow")


@dataclass
class RetentionReport:
    expired: list[Ref] = field(default_factory=list)  # gone from every tier
    hot_copies_expired: list[Ref] = field(default_factory=list)  # the archive copy stays
    left_hot: list[tuple[Ref, str]] = field(default_factory=list)  # archive-only by plan, copy not confirmed
    failed: list[tuple[Ref, str]] = field(default_factory=list)  # an expiry failed; the checkpoint stays


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


def apply_retention(hot: Store, archive: Store | None, plan: RetentionPlan) -> RetentionReport:
    """Expire the hot copy of every checkpoint the plan expires.

    A checkpoint whose archive copy verified and matches (same manifest digest) keeps
    that copy and its lifecycle records: only its hot copy goes. One without loses
    everything, unless the plan only moves it to the archive, in which case its hot copy
    stays. Retention never deletes from the archive. An expiry that fails leaves that
    checkpoint in place and is reported; the others go on.
    """
    report = RetentionReport()
    for ref in plan.expire_hot:
        run, step = ref
        why_not = copy_matches(hot, archive, run, step) if archive is not None else "no archive tier"
        try:
            if why_not is None:
                expire(hot, run, step, keep_records=True)
                report.hot_copies_expired.append(ref)
            elif ref in plan.archive_only:
                report.left_hot.append((ref, why_not))
            else:
                expire(hot, run, step)
                report.expired.append(ref)
        except ExpireError as e:
            log.warning("retention could not expire %s step %d: %s", run, step, e)
            report.failed.append((ref, str(e)))
    return report


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
    archive_only.update({ref: created.get(ref, 0.0) for ref in report.hot_copies_expired})
    newest_first = sorted(archive_only, key=lambda ref: (archive_only[ref], ref), reverse=True)
    return sorted(newest_first[max(0, keep) :])
