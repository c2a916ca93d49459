"""Which commit a failed run belongs to, and the failure record written against it.

A failed run about a checkpoint is recorded as that checkpoint's ``failure`` lifecycle
record, keyed by the manifest digest of the commit the run was about, so the inventory
shows "last failure" per checkpoint whatever orchestrator ran it. That digest is the
one the run pinned before it read the checkpoint. A run without one failed before it
read anything; its failure is recorded against the current commit only when that
commit provably predates the run (committed ``CLOCK_SKEW_S`` before the run started),
never against a step committed again since: a restore that rejected the first commit
and a save of the same step make a new commit that has failed nothing. A store that
cannot be read raises: nothing is decided on an outage, and the caller retries.

A record is written only next to a commit the hot store still knows: its commit record, the
records retention keeps for an archive-only checkpoint, or its manifest in quarantine
(``commit_known``). A failure
read after retention expired the checkpoint (a sensor that lags, or replays its history)
writes nothing: its ``failure.json`` would be the only object left of the commit, under a
step no store holds, which nothing ever deletes. A digest tag that names no commit of the
step (malformed, or another commit's, set by hand) is no attribution.

A failure read again (the sensor's cursor reset) writes nothing over the record it wrote
first, nor over a later run's (``standing_failure``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import ledger
from ckptflow.catalog.records import is_number
from ckptflow.catalog.verdicts import Subject, read_record, step_prefix, write_record
from ckptflow.errors import ManifestError
from ckptflow.format import layout as fmt
from ckptflow.lifecycle.evaluate import commit_digest
from ckptflow.lifecycle.landing import SLACK
from ckptflow.store.base import Store

CLOCK_SKEW_S = SLACK  # between the writer's clock (a manifest's created_at) and the orchestrator's


@dataclass(frozen=True)
class FailedRun:
    """What the orchestrator knows of a failed run."""

    run_id: str
    job: str
    steps: Sequence[tuple[str, str]]  # (step, the first line of its error) for every failed step
    checkpoint: str | None = None  # the checkpoint name (partition key) it was about, if any
    digest: str | None = None  # the commit it pinned before reading the checkpoint, if it got that far
    started_at: float | None = None  # when it started, by the orchestrator's clock
    failed_at: float | None = None  # when it failed, by the orchestrator's clock
    # the record kinds the failed work writes when it succeeds (``verdicts.KINDS``): a later
    # run that writes them all makes this failure good (``reports.recoverable``); () if unknown
    made_good_by: tuple[str, ...] = ()
    # those of them a run begun after this one (by the orchestrator's order of runs, no clock)
    # wrote before the failure is recorded, by the commit that run was about (its digest): the
    # records of that commit there then are that run's. By commit, not by step: a run about
    # the step committed again wrote the new commit's records, and the failed commit's that
    # stood from before the failure were no run's redoing
    made_good_already: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # the runs of its checkpoint begun after it (the orchestrator's order): a failure record
    # of one of them stands against this failure's (``standing_failure``)
    later_runs: frozenset[str] = frozenset()
    # every run of its checkpoint the orchestrator lists, this one too: a failure record of a
    # run it does not list (deleted since, or another deployment's) is judged by the clocks
    known_runs: frozenset[str] = frozenset()

    @property
    def reason(self) -> str:
        return "; ".join(f"{step}: {why}" for step, why in self.steps) or "run failed before any step failed"


@dataclass(frozen=True)
class Unattributed:
    why: str


@dataclass(frozen=True)
class Attribution:
    message: str  # what was done, as a line
    unattributed: str | None = None  # why the failure was recorded against no commit


def commit_before(store: Store, run: str, step: int, started_at: float | None) -> str | Unattributed:
    """The digest of the current commit of ``(run, step)`` if it provably is what a run
    that started at ``started_at`` and pinned no commit was about: committed before the
    run started (a commit since then would be newer). A store error propagates."""
    try:
        manifest = catalog.read_manifest(store, run, step)
    except ManifestError as e:
        return Unattributed(f"its commit record cannot be read: {e}")
    if started_at is None or manifest.created_at + CLOCK_SKEW_S > started_at:
        return Unattributed(
            "the run carries no manifest digest and the step was committed (again) after it started, "
            f"so which commit it was about is unknown (current commit {manifest.digest[:12]}…)"
        )
    return manifest.digest


def commit_known(store: Store, run: str, step: int, digest: str) -> bool:
    """Whether ``store`` holds the commit ``digest`` of ``(run, step)``, records of it (an
    archive-only checkpoint's, which retention keeps), or its manifest moved aside into
    quarantine (proved damaged, the step saved again). A store error propagates."""
    return (
        any(True for _ in store.list(f"{step_prefix(run, step)}{digest}/"))
        or commit_digest(store, run, step) == digest
        or store.exists(fmt.quarantine_key(run, step, digest))
    )


def standing_failure(recorded: Mapping | None, failed: FailedRun) -> str | None:
    """Why the failure record ``recorded`` stands against ``failed``'s (None: it does not).
    One of this run's stands: it is a replay (the sensor's cursor reset), and the record
    first written is the one whose ``records_seen`` were read nearest the failure; written
    again, a record a re-run wrote since would read as standing at the failure, the failure
    open again though the work was redone (once that run is gone from the orchestrator's
    history, ``made_good_already`` no longer names it). One of a run begun after ``failed``
    stands: an older failure replayed over it would hide it, and its own replay then rewrite it.
    So does one of a run the orchestrator no longer lists (deleted by hand, or recorded by
    another deployment sharing the store) that began later by the clocks, the only order left
    (``began_later``)."""
    other = (recorded or {}).get("run_id")
    if other == failed.run_id:
        return "its failure record is there already, as first written"
    if other in failed.later_runs:
        return f"the failure of run {other}, begun after it, is recorded and stands"
    if recorded and other not in failed.known_runs and began_later(recorded, failed):
        return f"the failure of run {other}, which the orchestrator no longer lists, began later and stands"
    return None


def began_later(recorded: Mapping, failed: FailedRun) -> bool:
    """Whether the run of the failure record ``recorded`` began after ``failed`` by the
    clocks: when each began, the order the instance's runs are judged by (a run begun after
    the failed one and failed before it stands too: the first pass kept its record, and a
    replay by when each failed wrote over it); a record without it (an older version's) by
    when each failed. A time that is no number, or none, is no order."""
    began, failed_at = recorded.get("started_at", math.nan), recorded.get("failed_at", math.nan)
    if is_number(began) and failed.started_at is not None:
        return bool(began > failed.started_at)
    return is_number(failed_at) and failed.failed_at is not None and failed_at > failed.failed_at


def record_failure(failed: FailedRun, open_store: Callable[[], Store]) -> Attribution:
    """Write the failure record of the commit ``failed`` belongs to, in the hot store
    ``open_store`` opens (only for a run about a checkpoint); what was done, as a line."""
    reason = failed.reason
    key = failed.checkpoint
    if not key:
        return Attribution(
            f"run {failed.run_id} of {failed.job} failed ({reason[:120]}); it names no checkpoint partition"
        )
    try:
        run, step = fmt.parse_checkpoint_name(key)
    except ValueError:
        return Attribution(f"run {failed.run_id} failed for partition {key!r}, which is not a checkpoint name")
    if failed.digest is not None and not fmt.is_digest(failed.digest):
        why = f"its ckptflow/manifest_digest tag {failed.digest[:80]!r} is not a manifest's sha256"
        return Attribution(f"run {failed.run_id} failed for {key} ({reason[:120]}); not recorded: {why}", why)
    hot = open_store()
    digest = failed.digest or commit_before(hot, run, step, failed.started_at)
    if isinstance(digest, str) and not commit_known(hot, run, step, digest):
        if ledger.was_expired(hot, run, step, digest):
            return Attribution(  # the commit it was about is gone: said, nothing written, still its commit
                f"run {failed.run_id} failed for {key} ({reason[:120]}); not recorded: commit {digest[:12]}… was "
                "expired by retention since, its records with it"
            )
        digest = Unattributed(
            f"no commit of {key} has that digest ({digest[:12]}…): neither a commit record nor any record of it, "
            "nor an expiry in the ledger"
        )
    if isinstance(digest, Unattributed):
        return Attribution(
            f"run {failed.run_id} failed for {key} ({reason[:120]}); not recorded against a commit: {digest.why}",
            digest.why,
        )
    subject = Subject(run, step, digest)
    standing = standing_failure(read_record(hot, subject, "failure"), failed)
    if standing is not None:
        return Attribution(f"run {failed.run_id} failed for {key} ({reason[:120]}); not recorded again: {standing}")
    # which record of each kind stood when the failure was recorded, by its recorded_at used as
    # a name, never compared with a time: one written since is another (``reports.recoverable``)
    seen = {kind: (read_record(hot, subject, kind) or {}).get("recorded_at") for kind in failed.made_good_by}
    write_record(
        hot,
        subject,
        "failure",
        {
            "run_id": failed.run_id,
            "job": failed.job,
            "steps": [s for s, _ in failed.steps],
            "message": reason,
            "started_at": failed.started_at,
            "failed_at": failed.failed_at,
            "made_good_by": list(failed.made_good_by),
            "records_seen": seen,
            "made_good_already": [k for k in failed.made_good_by if k in failed.made_good_already.get(digest, ())],
        },
    )
    return Attribution(f"recorded the failure of run {failed.run_id} for {key}: {reason[:120]}")
