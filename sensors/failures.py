"""Run-failure sensor: a failed run about a checkpoint is recorded next to it, and the
run is tagged with what failed and why.

Which commit the failure belongs to, and its record in the store, are the library's
(``ckptflow.lifecycle.attribution``): the commit a run is about is its
``ckptflow/manifest_digest`` tag (the landing sensor sets it on validation runs, every
per-checkpoint asset on its own run before it reads the checkpoint), else the current
commit only if it provably predates the run; a run recorded against no commit is
tagged ``ckptflow/failure_unattributed`` with why (a digest tag naming no commit of its
checkpoint is no attribution). A failure of a commit retention has expired since is
written nowhere (``attribution.commit_known``): a lagging or replaying sensor left a
``failure.json`` under a deleted step, which nothing deleted. A store that cannot be read stops
the tick at that run, which the next tick retries. The tag (``ckptflow/failure``: the
failed step and the first line of its error) puts the reason in the run list, next to
the run's partition.

A plain sensor with its own cursor over the instance's run-failure events rather than
``run_failure_sensor``: that one starts at the newest event when it first ticks, so
runs that failed before the daemon started (``make demo`` runs the lifecycle
in-process, then ``make ui`` starts the daemon) would never be recorded. This one
starts at the beginning of the instance's history; a failure recorded already is not
rewritten (``attribution.standing_failure``). A cursor
that is not an integer (an older version's, or one set in the UI) starts it there again,
with a warning, rather than failing every tick.
"""

from dagster import (
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DefaultSensorStatus,
    RunRecord,
    RunsFilter,
    RunStatusChangeRecordsFilter,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from assets.partitions import DIGEST_TAG
from ckptflow.catalog.listing import problem_from
from ckptflow.errors import CkptflowError
from ckptflow.lifecycle import attribution
from resources import CheckpointStoreResource
from resources.dagster_private import FAILURE_CLASS_PREFIX
from sensors.intervals import SENSOR_INTERVAL_S

FAILURE_TAG = "ckptflow/failure"
UNATTRIBUTED_TAG = "ckptflow/failure_unattributed"  # why a failure was recorded against no commit
PER_TICK = 200
PARTITION_TAG = "dagster/partition"
RANGE_TAGS = ("dagster/asset_partition_range_start", "dagster/asset_partition_range_end")
# the lifecycle record each per-checkpoint step writes when it succeeds: a re-run that
# writes it makes the step's failure good (no longer "needs attention" in ``recoverability``)
STEP_RECORDS = {
    "checkpoint": "validation",
    "evaluation": "evaluation",
    "compressed": "compression",
    "archived": "archive",
}


def partition_of(run: DagsterRun) -> str | None:
    """The run's checkpoint partition: its partition tag, or a one-partition range
    (what backfills with one partition per run tag)."""
    key = run.tags.get(PARTITION_TAG)
    if key:
        return key
    start, end = (run.tags.get(t) for t in RANGE_TAGS)
    return start if start and start == end else None


def failed_steps(instance: DagsterInstance, run_id: str) -> list[tuple[str, str]]:
    """(step, the first line of its error) for every failed step of the run."""
    out = []
    for entry in instance.all_logs(run_id, of_type=DagsterEventType.STEP_FAILURE):
        event = entry.dagster_event
        if event is None:
            continue
        data = event.step_failure_data
        user = data.user_failure_data if data else None
        if user and user.description:
            text = user.description
        else:
            text = data.error.message if data and data.error else ""
        first = next((line.strip() for line in text.splitlines() if line.strip()), "failed")
        out.append((event.step_key or "?", first.removeprefix(FAILURE_CLASS_PREFIX)))
    return out


class TickRuns:
    """What one tick reads of the instance's runs: each finished run's step successes once,
    however many failures of its partition the tick records (each failure read the events of
    every run of its partition begun after it: O(failures x later runs) reads of the event
    log). A failure's partition's runs, and the successes of a run not finished, are read for
    that failure: a run may begin, or a step of it succeed, while a tick goes on (200 failures,
    each with reads of the store), and a record written by a run the failure's record does not
    count as later would read as standing at the failure (read once at the tick's first
    failure, a re-run's evaluation left the failures recorded after it open for good)."""

    def __init__(self, instance: DagsterInstance):
        self.instance = instance
        self._written: dict[str, set[str | None]] = {}

    def around(self, run: DagsterRun) -> tuple[RunRecord | None, list[RunRecord], frozenset[str]]:
        """``run``'s record, the runs of its checkpoint partition begun after it (a greater
        storage id: the instance's order, no clock) and the ids of all its runs, read now: by
        its tag and by a one-partition range."""
        key = partition_of(run)
        found = {
            record.dagster_run.run_id: record
            for tags in (({PARTITION_TAG: key}, dict.fromkeys(RANGE_TAGS, key)) if key else ())
            for record in self.instance.get_run_records(RunsFilter(tags=tags))
        }
        failed = found.get(run.run_id) or self.instance.get_run_record_by_id(run.run_id)
        if failed is None:
            return None, [], frozenset(found)
        later = [r for r in found.values() if r.storage_id > failed.storage_id]
        return failed, sorted(later, key=lambda record: record.storage_id), frozenset(found) | {run.run_id}

    def written_by(self, record: RunRecord) -> set[str | None]:
        """The lifecycle records the run's succeeded steps wrote (``STEP_RECORDS``); kept for
        the tick once the run had finished when ``record`` was read (it logs no more)."""
        run_id = record.dagster_run.run_id
        if run_id in self._written:
            return self._written[run_id]
        written = {
            STEP_RECORDS.get(entry.dagster_event.step_key or "")
            for entry in self.instance.all_logs(run_id, of_type=DagsterEventType.STEP_SUCCESS)
            if entry.dagster_event is not None
        }
        if record.dagster_run.is_finished:
            self._written[run_id] = written
        return written


def started_at(record: RunRecord | None) -> float | None:
    return None if record is None else record.start_time or record.create_timestamp.timestamp()


def made_good_by(steps: list[tuple[str, str]]) -> tuple[str, ...]:
    """The records a later run must write to make these failed steps good; () when a step
    writes none (a failure before any step, another job's step): that stays a failure."""
    kinds = [STEP_RECORDS.get(step) for step, _ in steps]
    return tuple(dict.fromkeys(k for k in kinds if k)) if kinds and all(kinds) else ()


def made_good_already(runs: TickRuns, later: list[RunRecord], kinds: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Those of ``kinds`` each run of ``later`` (the runs of the failed run's checkpoint
    partition begun after it: ``TickRuns.around``) wrote by now, a step of it that
    writes one having succeeded, by the commit that run was about (its digest tag; one
    without the tag is left out: which commit's records it wrote is unknown). The records of
    that commit standing when the failure is recorded late, after such a re-run, are that
    re-run's (``ckptflow.reports.recoverable.made_good``)."""
    if not kinds:
        return {}
    written: dict[str, set[str | None]] = {}
    for record in later:
        digest = record.dagster_run.tags.get(DIGEST_TAG)
        if digest:
            written.setdefault(digest, set()).update(runs.written_by(record))
    return {digest: tuple(k for k in kinds if k in done) for digest, done in written.items()}


def record_failure(
    runs: TickRuns, run: DagsterRun, store: CheckpointStoreResource, *, failed_at: float | None = None
) -> str:
    """Tag the run with its reason and write the checkpoint's failure record (``failed_at``:
    the run's failure event's time); what was done, as a line. A store that cannot be
    read raises (the sensor retries the run next tick)."""
    instance = runs.instance
    steps = failed_steps(instance, run.run_id)
    kinds = made_good_by(steps)
    record, later, known = runs.around(run)
    failed = attribution.FailedRun(
        run.run_id,
        run.job_name,
        steps,
        checkpoint=partition_of(run),
        digest=run.tags.get(DIGEST_TAG),
        started_at=started_at(record),
        failed_at=failed_at,
        made_good_by=kinds,
        made_good_already=made_good_already(runs, later, kinds),
        later_runs=frozenset(r.dagster_run.run_id for r in later),
        known_runs=known,
    )
    instance.add_run_tags(run.run_id, {FAILURE_TAG: failed.reason[:300]})
    done = attribution.record_failure(failed, store.open)
    if done.unattributed is not None:
        instance.add_run_tags(run.run_id, {UNATTRIBUTED_TAG: done.unattributed[:300]})
    return done.message


@sensor(default_status=DefaultSensorStatus.RUNNING, minimum_interval_seconds=SENSOR_INTERVAL_S)
def failure_sensor(context: SensorEvaluationContext, store: CheckpointStoreResource):
    """Records every failed run about a checkpoint (from the start of the instance's history)."""
    after = _cursor(context)
    records = context.instance.fetch_run_status_changes(
        RunStatusChangeRecordsFilter(event_type=DagsterEventType.RUN_FAILURE, after_storage_id=after),
        limit=PER_TICK,
        ascending=True,
    ).records
    runs = TickRuns(context.instance)
    for record in records:
        run = context.instance.get_run_by_id(record.event_log_entry.run_id)
        if run is not None:
            try:
                failed_at = record.event_log_entry.timestamp
                context.log.info(record_failure(runs, run, store, failed_at=failed_at))
            except (CkptflowError, OSError) as e:
                if problem_from(run.run_id, None, e).kind == "unavailable":
                    context.log.warning(f"the failure of run {run.run_id} is not recorded yet ({e}): retried next tick")
                    break  # the cursor stays before this run
                context.log.warning(f"the failure of run {run.run_id} cannot be recorded: {e}")
        after = record.storage_id
    context.update_cursor(str(after))
    if not records:
        return SkipReason("no failed runs since the last tick")
    return None


def _cursor(context: SensorEvaluationContext) -> int:
    """The storage id of the last failure event handled; -1 (the beginning) before the first
    tick, and for a cursor that is not an integer (an older version's, or one set by hand in
    the UI), which would otherwise fail every tick: failures are read again from the
    beginning, which is safe: a record written already stands (``attribution.standing_failure``)."""
    if not context.cursor:
        return -1
    try:
        return int(context.cursor)
    except ValueError:
        context.log.warning(
            f"failure_sensor: its cursor {context.cursor[:80]!r} is not a run-failure event's storage id (an "
            "integer): restarting from the beginning of the instance's history; failures recorded before are read "
            "again and their records stand (set the cursor to an integer in the UI to start elsewhere)"
        )
        return -1
