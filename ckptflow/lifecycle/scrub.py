"""Scrub: re-verify old checkpoints (bit rot, lost objects) and record each verdict.

A checkpoint the store would not let it read (an outage) keeps its earlier verdict: it
is listed as unreadable, never recorded as failed; one a newer ckptflow wrote is listed
apart (``newer``), since no retry reads it, and so is one with an object in a cold storage
class (``cold``: Glacier, Deep Archive), which reads once someone thaws it, hours later: no
retry reads it either (``errors.retrying_may_help``). A chunk object found damaged is
recorded in the store (``ckptflow.chunks.damaged``): the next save of a job that holds
its content writes it anew, which repairs every checkpoint sharing it.

The archive tier rots too, and a checkpoint retention expired from the hot tier has no
other copy: ``scrub_archive_only`` re-verifies those, recording the verdicts in the hot
store as validation of an archive-only checkpoint does. An archive copy of the commit
the hot tier holds is scrubbed there (a verdict names the commit, whichever tier was
read, so the hot copy's stands). An archive copy of another commit of that step (a
lossy copy, or an earlier commit the step was saved again after) is scrubbed in the
archive: no hot scrub reads its chunks, and retention trusts it once the hot copy goes.

A scrub retried after an outage resumes (``verified_since``): a checkpoint that passed
validation since the first attempt began is not read again, its verdict counted as found,
unless one of its chunks is recorded damaged (``damaged``: found by a reader since, maybe
after that verdict; or the damage records cannot be listed). A failed verdict is read again:
``repair`` may have mended it since, and its damage records went with the repair. Without it
each retry re-read every checkpoint of both tiers, hours of reads on a large store and
archive reads billed per byte, to reach the few the outage left unread."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.listing import Problem, StepListing, listing, problem_from
from ckptflow.catalog.records import is_number
from ckptflow.catalog.verdicts import Subject, read_record
from ckptflow.chunks import damaged
from ckptflow.errors import CkptflowError, NewerFormatError, StoreUnavailableError
from ckptflow.format.manifest import Manifest
from ckptflow.lifecycle.evaluate import commit_digest
from ckptflow.lifecycle.validate import found_damage, validate
from ckptflow.store.base import Store


@dataclass
class ScrubReport:
    checked: int = 0  # verdicts, ``resumed`` among them
    resumed: int = 0  # verdicts an earlier attempt of this scrub recorded (``verified_since``): not read again
    bytes_checked: int = 0  # the content of the chunks of the checkpoints given a verdict
    corrupt: list[tuple[str, int, str]] = field(default_factory=list)  # (run, step, problems)
    unreadable: list[str] = field(default_factory=list)  # checkpoints that could not be looked at: no verdict
    newer: list[str] = field(default_factory=list)  # written by a newer ckptflow: no verdict, retrying will not help
    cold: list[str] = field(default_factory=list)  # an object to thaw first (the message says how): no verdict
    damaged_chunks: int | None = None  # damage records in the store (``damaged``); None: they could not be listed
    records_error: str = ""  # why they could not be listed (the verdicts stand: no retry for it)


def scrub(
    store: Store,
    *,
    older_than_s: float = 86400.0,
    now: float | None = None,
    progress: Callable[[int], None] | None = None,
    verified_since: float | None = None,
) -> ScrubReport:
    """Validate every committed checkpoint created more than ``older_than_s`` ago (young
    ones were validated when they landed); each verdict is recorded for its digest.
    ``progress`` is called with the content size of each chunk checked (``validate``): a
    scrub re-reads a whole store, hours of it on a large one. ``verified_since`` (the time
    the first attempt of a retried scrub began): a checkpoint that passed validation since
    is not read again, its verdict counted (``ScrubReport.resumed``)."""
    listed = listing(store, manifests_only=True)
    return _scrub(
        store,
        listed,
        records=store,
        older_than_s=older_than_s,
        now=now,
        progress=progress,
        verified_since=verified_since,
    )


def scrub_archive_only(
    hot: Store,
    archive: Store,
    *,
    older_than_s: float = 86400.0,
    now: float | None = None,
    progress: Callable[[int], None] | None = None,
    verified_since: float | None = None,
) -> ScrubReport:
    """``scrub`` of the commits ``archive`` holds and ``hot`` does not, verdicts recorded
    in ``hot``: checkpoints only the archive holds, and archive copies of another commit
    than the hot one of their step. A step the hot tier could not list or read (a run or
    a commit record it could not read) is left for the next scrub: it may hold that commit."""
    in_hot = list(listing(hot, manifests_only=True))
    held = {(e.run, e.step) for e in in_hot if isinstance(e, Problem) or e.committed}
    unlisted_runs = {e.run for e in in_hot if isinstance(e, Problem) and e.step is None}

    def scrubbed_in_hot(item: Manifest | Problem) -> bool:
        if (item.run, item.step) not in held:
            return False
        if not isinstance(item, Manifest):
            return True  # which commit the archive holds is unknown: the hot one may be it
        try:
            return commit_digest(hot, item.run, item.step) == item.digest
        except (CkptflowError, OSError):
            return True

    listed = (e for e in listing(archive, manifests_only=True) if e.run not in unlisted_runs)
    return _scrub(
        archive,
        listed,
        records=hot,
        older_than_s=older_than_s,
        now=now,
        skip=scrubbed_in_hot,
        progress=progress,
        verified_since=verified_since,
    )


def _scrub(
    store: Store,
    listed: Iterable[StepListing | Problem],
    *,
    records: Store,
    older_than_s: float,
    now: float | None,
    skip: Callable[[Manifest | Problem], bool] = lambda item: False,
    progress: Callable[[int], None] | None = None,
    verified_since: float | None = None,
) -> ScrubReport:
    cutoff = (time.time() if now is None else now) - older_than_s
    report = ScrubReport()
    # a chunk found damaged since a verdict was recorded (by a restore, an export) proves it stale
    found_damaged = None if verified_since is None else damaged.listed(store)[0]
    for item in catalog.committed(store, listed=listed):
        if skip(item):
            continue
        if not isinstance(item, Manifest):
            if item.kind == "corrupt" and item.step is not None:
                report.corrupt.append((item.run, item.step, item.message))
            else:
                _unread(report, item.kind, str(item))
            continue
        if item.created_at >= cutoff:
            continue
        record = None
        if verified_since is not None and found_damaged is not None and found_damaged.keys().isdisjoint(item.chunks):
            record = _verified_since(records, item, verified_since)
        try:
            if record is None:
                record = validate(store, item.run, item.step, records=records, progress=progress)
                report.bytes_checked += record["bytes_checked"]
            else:
                report.resumed += 1
        except (StoreUnavailableError, NewerFormatError) as e:  # newer: committed meanwhile by a newer writer
            _unread(report, problem_from(item.run, item.step, e).kind, str(e))
            continue
        report.checked += 1
        found = found_damage(record)  # not the verdict an import carries: its bytes verify
        if found:
            report.corrupt.append((item.run, item.step, "; ".join(found)))
    damage, report.records_error = damaged.listed(store)  # the verdicts stand without the count
    report.damaged_chunks = None if damage is None else len(damage)
    return report


def _verified_since(records: Store, item: Manifest, since: float) -> dict | None:
    """The passing verdict of ``item`` recorded at or after ``since`` (by an earlier attempt
    of this scrub, or any validation meanwhile), or None: read it (a record that could not be
    read, or that says not when it was recorded, is no verdict; a failed one may be stale,
    its chunks repaired since)."""
    try:
        record = read_record(records, Subject.of(item), "validation")
    except (CkptflowError, OSError):
        return None
    if record is None or record["ok"] is not True or not is_number(record.get("recorded_at")):
        return None
    return record if record["recorded_at"] >= since else None


def _unread(report: ScrubReport, kind: str, what: str) -> None:
    """List a checkpoint scrub could not read by its problem's ``kind`` (``listing.problem_from``):
    a newer format (``newer``) and a cold object (``cold``: it reads once thawed) apart, since no
    retry reads them; anything else (an outage, a link, a refused record) as ``unreadable``."""
    {"newer": report.newer, "cold": report.cold}.get(kind, report.unreadable).append(what)
