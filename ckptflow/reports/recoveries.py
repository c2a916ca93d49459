"""Recovery records and the operational numbers built from them.

Every ``Checkpointer.restore`` (on rank 0) leaves a small JSON record under
``recoveries/<run>/`` in the hot store: when, which step, what was skipped and why, how
long it took, and whether it succeeded. With the manifests and the lifecycle
verdicts that gives the figures an operator asks for: recoveries and their success
rate, how often checkpoints land, how long a checkpoint takes to become
recovery-ready (committed and validated), the recovery point and time objectives (RPO,
RTO) and whether the newest recovery-ready checkpoint is within the RPO target. GC
never touches ``recoveries/``.

A restore rejected for the caller's side (``recovery_log.rejected``: the state passed does not
fit the checkpoint) is no recovery: it is counted apart (``rejected``), and left out of the
recoveries, their success rate, fallbacks, selectors and the last recovery.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import listing as catalog_listing
from ckptflow.catalog.ledger import expired
from ckptflow.catalog.records import is_number
from ckptflow.catalog.recovery_log import PREFIX, read_all, rejected
from ckptflow.catalog.verdicts import records_by_subject
from ckptflow.store.base import Store

DAY = 86400.0


@dataclass(frozen=True)
class RunMetrics:
    """The operational figures of one run.

    *Recovery-ready* means committed and passed validation (a lifecycle ``validation``
    record for that commit). RPO is training time at risk: the longest gap between the
    commits of consecutive recovery-ready checkpoints whose later one falls in the
    window (a corrupt checkpoint is not recovery-ready, so it widens the gap); the open
    gap since the newest one is what the lifecycle's freshness check watches. RTO is
    how long a recovery takes: the time to notice the crash (``detection_s``, from the
    operator: the scheduler's restart delay) plus the measured restore durations.
    """

    run: str
    checkpoints: int
    save_interval_s: float | None  # median time between consecutive commits
    ready_s: float | None  # median time from commit to a passed validation (recovery-ready)
    recoveries: int
    recoveries_ok: int
    fallbacks: int  # recoveries that had to skip at least one checkpoint
    restore_s: float | None  # median duration of successful recoveries
    window_s: float = DAY
    checkpoints_in_window: int = 0  # commits in the window: the checkpoint frequency
    ready_worst_s: float | None = None  # slowest commit -> recovery-ready
    rpo_s: float | None = None  # longest gap between recovery-ready checkpoints in the window
    newest_ready_at: float | None = None  # commit time of the newest recovery-ready checkpoint
    restore_worst_s: float | None = None
    detection_s: float = 0.0
    selectors: dict[str, int] = field(default_factory=dict)  # recoveries by what they asked for (latest, validated...)
    last_recovery: dict | None = None  # the newest recovery record, as written (never a rejected one)
    rejected: int = 0  # restores refused for the caller's side (a state that does not fit): not recoveries

    @property
    def recovery_success_rate(self) -> float | None:
        return self.recoveries_ok / self.recoveries if self.recoveries else None

    @property
    def rto_median_s(self) -> float | None:
        return None if self.restore_s is None else self.detection_s + self.restore_s

    @property
    def rto_worst_s(self) -> float | None:
        return None if self.restore_worst_s is None else self.detection_s + self.restore_worst_s

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "recovery_success_rate": self.recovery_success_rate,
            "rto_median_s": self.rto_median_s,
            "rto_worst_s": self.rto_worst_s,
        }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def longest_gap(ready_at: list[float], start: float, end: float) -> float | None:
    """The longest gap between consecutive recovery-ready commit times whose later one
    lies in ``[start, end]``; the newest one before ``start`` anchors the first gap.
    None with fewer than two recovery-ready checkpoints to compare."""
    times = sorted(t for t in ready_at if t <= end)
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= start]
    return max(gaps) if gaps else None


def run_metrics(
    store: Store, run: str, *, now: float | None = None, window_s: float = DAY, detection_s: float = 0.0
) -> RunMetrics:
    now = time.time() if now is None else now
    infos = catalog.list_checkpoints(store, run)
    created = sorted(i.created_at for i in infos)
    records = records_by_subject(store, run)
    ready, ready_at = [], []
    for info in infos:
        verdict = records.get((run, info.step, info.digest), {}).get("validation")
        if verdict and verdict.get("ok") and isinstance(verdict.get("recorded_at"), (int, float)):
            ready.append(max(0.0, verdict["recorded_at"] - info.created_at))
            ready_at.append(info.created_at)
    first = _first_commit_at(store, run, created)
    recs = [r for r in read_all(store, run) if not _first_start(r, first)]
    refused = [r for r in recs if rejected(r)]
    recs = [r for r in recs if not rejected(r)]
    ok = [r for r in recs if r.get("ok")]
    durations = [r["duration_s"] for r in ok if isinstance(r.get("duration_s"), (int, float))]
    return RunMetrics(
        run=run,
        checkpoints=len(infos),
        save_interval_s=_median([b - a for a, b in zip(created, created[1:])]),
        ready_s=_median(ready),
        recoveries=len(recs),
        recoveries_ok=len(ok),
        fallbacks=sum(1 for r in recs if r.get("skipped")),
        restore_s=_median(durations),
        window_s=window_s,
        checkpoints_in_window=sum(1 for t in created if now - window_s <= t <= now),
        ready_worst_s=max(ready, default=None),
        rpo_s=longest_gap(ready_at, now - window_s, now),
        newest_ready_at=max(ready_at, default=None),
        restore_worst_s=max(durations, default=None),
        detection_s=detection_s,
        selectors=dict(Counter(str(r.get("select") or "latest") for r in recs)),
        last_recovery=recs[-1] if recs else None,
        rejected=len(refused),
    )


def _first_commit_at(store: Store, run: str, created: list[float]) -> float | None:
    """When the run's first checkpoint was committed: the oldest held, or an older one that
    retention expired (the ledger keeps its commit time). Only the held ones would move the
    run's start forward with every expiry, and every failed recovery before the oldest
    checkpoint still held would read as a first launch."""
    gone = [e["created_at"] for e in expired(store, run) if is_number(e.get("created_at"), minimum=0)]
    return min(created + gone, default=None)


def _first_start(record: dict, first_checkpoint_at: float | None) -> bool:
    """A restore that found no checkpoint at all before the run's first one was committed
    (``_first_commit_at``): the run's first launch (the documented pattern catches
    ``NoValidCheckpointError`` and trains from scratch), not a failed recovery. Without a
    checkpoint ever committed nothing tells the two apart, so such a record still counts."""
    return (
        first_checkpoint_at is not None
        and not record.get("ok")
        and not record.get("skipped")
        and not record.get("passed_over")
        and isinstance(record.get("at"), (int, float))
        and record["at"] < first_checkpoint_at
    )


def store_metrics(
    store: Store, *, now: float | None = None, window_s: float = DAY, detection_s: float = 0.0
) -> list[RunMetrics]:
    """Every run with checkpoints or recoveries (a run whose every recovery failed may have none)."""
    recovered = {
        info.key[len(PREFIX) :].rstrip("/") for info in store.list(PREFIX, recursive=False) if info.key.endswith("/")
    }
    return [
        run_metrics(store, run, now=now, window_s=window_s, detection_s=detection_s)
        for run in sorted(set(catalog_listing.list_runs(store)) | recovered)
    ]


@dataclass(frozen=True, kw_only=True)
class Freshness:
    """How old the newest recovery-ready checkpoint of the store is, against an RPO target."""

    target_s: float
    newest_ready_at: float | None  # commit time; None: nothing is recovery-ready
    run: str | None
    age_s: float | None

    @property
    def ok(self) -> bool:
        return self.age_s is not None and self.age_s <= self.target_s


def freshness(metrics: list[RunMetrics], target_s: float, now: float | None = None) -> Freshness:
    """Is there a recovery-ready checkpoint younger than the RPO target, in any run?"""
    now = time.time() if now is None else now
    ready = [(m.newest_ready_at, m.run) for m in metrics if m.newest_ready_at is not None]
    if not ready:
        return Freshness(target_s=target_s, newest_ready_at=None, run=None, age_s=None)
    at, run = max(ready)
    return Freshness(target_s=target_s, newest_ready_at=at, run=run, age_s=max(0.0, now - at))
