"""Jobs and schedules: retention, scrub, promotion, rollback.

Retention and scrub act on many checkpoints at once and decide per checkpoint, so they
are op jobs over the library rather than partitioned materializations; promotion and
rollback change one thing (what is deployed), so they materialize ``deployed_model``.
"""

from dagster import (
    AssetSelection,
    Config,
    DefaultScheduleStatus,
    Failure,
    MetadataValue,
    OpExecutionContext,
    ScheduleDefinition,
    define_asset_job,
    job,
    op,
)

from assets.inventory import compute_plan
from assets.metadata import rounded, size, throughput
from assets.models import deployed_model
from assets.partitions import checkpoint_key, drop_checkpoint_partitions
from assets.progress import logged_progress
from ckptflow import lifecycle
from ckptflow.catalog.gc import gc
from ckptflow.errors import CkptflowError, StoreUnavailableError
from ckptflow.policy.retention import DAY
from ckptflow.store import Store
from resources import ArchiveTierResource, CheckpointStoreResource, RegistryResource, RetentionResource

BATCH = 1000  # partitions dropped, and checkpoints named in one log line, at a time


def batches(items: list) -> list[list]:
    return [items[start : start + BATCH] for start in range(0, len(items), BATCH)]


def _span(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else f"{keys[0]} .. {keys[-1]}"


@op
def apply_retention(
    context: OpExecutionContext,
    retention: RetentionResource,
    store: CheckpointStoreResource,
    archive: ArchiveTierResource,
    registry: RegistryResource,
) -> dict:
    """Recompute the plan now (never trust an older dry run), expire hot copies
    (``ckptflow.lifecycle.apply_retention``), drop the partitions of checkpoints gone
    from every tier (not of a step whose hot commit went while the archive holds an
    earlier commit of it: that one is archive-only now) and of archive-only ones beyond
    the newest ``archive_partitions`` (bounding the partitions the automation
    evaluates), then GC the hot tier. The policy
    is the ``retention`` resource's, the one ``retention_plan`` and the inventory show. A
    checkpoint whose expiry failed keeps its partition; the run fails after the rest is
    done, naming it. Partitions are dropped, and logged, ``BATCH`` at a time; GC waits
    ``gc_wait`` for saves in flight, logs the bytes it deleted as it goes, and its time and
    wait are metadata."""
    try:
        retention.check()  # before anything is expired: a policy the last step cannot read changes nothing
    except ValueError as e:
        raise Failure(f"the retention policy (CKPTFLOW_RETENTION) is not usable: {e}; nothing was expired") from None
    hot, arc = store.open(), archive.open()
    entries, plan = compute_plan(retention, hot, arc, registry)
    try:
        report = lifecycle.apply_retention(hot, arc, plan, registry=registry.open())
    except CkptflowError as e:  # another retention, or promotions still publishing: nothing was expired
        raise Failure(str(e)) from None
    expired = [checkpoint_key(*ref) for ref in report.expired]
    for batch in batches(expired):
        drop_checkpoint_partitions(context.instance, batch)
        context.log.info(f"expired {len(batch)} checkpoint(s) and dropped their partitions: {_span(batch)}")
    for batch in batches([checkpoint_key(*ref) for ref in report.hot_copies_expired]):
        context.log.info(
            f"expired the hot copies of {len(batch)} checkpoint(s) ({_span(batch)}); {arc.url} keeps theirs"
        )
    for batch in batches([checkpoint_key(*ref) for ref in report.hot_commits_expired]):
        context.log.info(
            f"expired {len(batch)} hot commit(s) never archived ({_span(batch)}); {arc.url} holds an earlier "
            "commit of each step, which keeps its partition"
        )
    for batch in batches(report.left_hot):
        kept = "; ".join(f"{checkpoint_key(*ref)}: {why}" for ref, why in batch[:3])
        more = f" (and {len(batch) - 3} more)" if len(batch) > 3 else ""
        context.log.warning(
            f"kept the hot copies of {len(batch)} checkpoint(s) not confirmed in the archive: {kept}{more}"
        )
    for batch in batches(report.expiries_finished):
        done = "; ".join(f"{checkpoint_key(*ref)} ({digest[:12]}…)" for ref, digest in batch[:3])
        more = f" (and {len(batch) - 3} more)" if len(batch) > 3 else ""
        context.log.info(f"finished {len(batch)} earlier expiries (their lifecycle records): {done}{more}")
    for batch in batches(report.changed):
        kept = "; ".join(f"{checkpoint_key(*ref)}: {why}" for ref, why in batch[:3])
        more = f" (and {len(batch) - 3} more)" if len(batch) > 3 else ""
        context.log.info(f"kept {len(batch)} checkpoint(s) that changed since the plan: {kept}{more}")
    beyond = lifecycle.archive_only_beyond(entries, report, retention.archive_partitions)
    archived = [checkpoint_key(*ref) for ref in beyond]
    for batch in batches(archived):
        dropped = drop_checkpoint_partitions(context.instance, batch)
        if dropped:
            context.log.info(
                f"dropped the partitions of {dropped} archive-only checkpoint(s) ({_span(batch)}): only the newest "
                f"{retention.archive_partitions} keep one; their archive copies and records stay"
            )
    with logged_progress(context, f"GC of {hot.url} (bytes deleted)") as meter:
        gc_report = gc(hot, grace=retention.grace_s(), wait=retention.wait_s(), progress=meter)
    for key in gc_report.restored:
        context.log.warning(f"GC put back {key}: a conditional delete killed mid-way had taken it aside")
    context.add_output_metadata(
        {
            "expired": len(report.expired),
            "hot_copies_expired": len(report.hot_copies_expired),
            "hot_commits_expired": len(report.hot_commits_expired),
            "left_hot": len(report.left_hot),
            "changed_since_plan": len(report.changed),
            "expiries_finished": len(report.expiries_finished),
            "failed": len(report.failed),
            "kept": len(plan.keep),
            "archive_only_unpartitioned": len(archived),
            "gc_deleted_objects": len(gc_report.deleted),
            "gc_deleted_bytes": MetadataValue.int(gc_report.bytes),
            "gc_seconds": MetadataValue.float(rounded(meter.seconds, 3)),
            "gc_skipped": gc_report.skipped or "",
            "gc_wait_s": MetadataValue.float(retention.wait_s()),
            "gc_restored": len(gc_report.restored),
            "expired_keys": MetadataValue.md("\n".join(f"- {k}" for k in expired) or "none"),
        }
    )
    if report.failed:
        raise Failure(
            f"{len(report.failed)} checkpoint(s) could not be expired and keep their partitions",
            metadata={
                "failed": MetadataValue.md("\n".join(f"- {checkpoint_key(*ref)}: {why}" for ref, why in report.failed))
            },
        )
    return {
        "expired": expired,
        "hot_copies_expired": [checkpoint_key(*r) for r in report.hot_copies_expired],
        "hot_commits_expired": [checkpoint_key(*r) for r in report.hot_commits_expired],
        "left_hot": [checkpoint_key(*r) for r, _ in report.left_hot],
        "gc_bytes": gc_report.bytes,
        "gc_skipped": gc_report.skipped,
    }


@job(
    description=(
        "Apply the retention policy to the hot tier (archive copies stay), drop partitions of "
        "checkpoints gone from every tier, then GC the hot tier."
    )
)
def retention_job():
    apply_retention()


class ScrubConfig(Config):
    older_than_days: float = 1.0  # young checkpoints were just validated on landing


@op
def scrub_checkpoints(
    context: OpExecutionContext, config: ScrubConfig, store: CheckpointStoreResource, archive: ArchiveTierResource
) -> dict:
    """Re-verify every chunk of checkpoints older than N days (bit rot, lost objects) in
    the hot tier, and of the commits only the archive holds (``lifecycle.scrub_archive_only``:
    their one copy rots unseen otherwise), and record each verdict in the hot store; then
    repair each tier's damaged chunk objects from the other tier's sound copies
    (``ckptflow.lifecycle.repair``) and validate again what failed. Figures are metadata
    per tier (the bytes re-read, the time and the rate among them: each tier's progress is
    logged as it goes). Fails the run if a checkpoint stays corrupt, so an operator hears of it.
    What could not be read keeps its earlier verdict; in the hot tier it is retried
    later (an outage proves nothing), in the archive it waits for the next scrub (a cold
    storage class reads only once thawed: a retry would not read it). What a newer
    ckptflow wrote fails the run without retries (upgrade the code location), and so does
    a hot checkpoint with an object in a cold storage class, saying how to thaw it (a
    retry minutes later meets the same cold object: ``errors.retrying_may_help``). A retry
    resumes: what passed validation since the run began is not read again (``resumed``)."""
    hot, arc = store.open(), archive.open()
    older_than_s = config.older_than_days * DAY
    since = _run_began(context) if context.retry_number else None
    with logged_progress(context, f"scrubbing {hot.url}") as hot_meter:
        scrubbed_hot = lifecycle.scrub(hot, older_than_s=older_than_s, progress=hot_meter, verified_since=since)
    with logged_progress(context, f"scrubbing the archive-only checkpoints of {arc.url}") as arc_meter:
        scrubbed_arc = lifecycle.scrub_archive_only(
            hot, arc, older_than_s=older_than_s, progress=arc_meter, verified_since=since
        )
    reports = {"hot": scrubbed_hot, "archive": scrubbed_arc}
    figures: dict = {}  # per tier: the bytes re-read, the time and the rate
    for tier, meter in (("hot", hot_meter), ("archive", arc_meter)):
        figures.update(size(f"{tier}_scrubbed", reports[tier].bytes_checked))
        figures.update(throughput(f"{tier}_scrub", reports[tier].bytes_checked, meter.seconds))
    repairs = _repairs(context, hot, arc, figures)
    tiers = {"hot": hot, "archive": arc}
    still = {
        tier: [
            (run, step, why)
            for run, step, why in r.corrupt
            if not _whole_again(tiers[tier], hot, run, step, repairs[tier])
        ]
        for tier, r in reports.items()
    }
    corrupt = [f"{checkpoint_key(run, step)} ({tier}): {why[:300]}" for tier in still for run, step, why in still[tier]]
    unreadable = [f"{c} ({tier})" for tier, r in reports.items() for c in r.unreadable + r.cold]
    newer = [c for r in reports.values() for c in r.newer]
    damage = {f"{t}_damaged_chunks": r.damaged_chunks for t, r in reports.items() if r.damaged_chunks is not None}
    context.add_output_metadata(
        {
            "checked": sum(r.checked for r in reports.values()),
            "corrupt": len(corrupt),
            **{f"{tier}_checked": r.checked for tier, r in reports.items()},
            **{f"{tier}_resumed": r.resumed for tier, r in reports.items()},
            **figures,
            **{f"{tier}_corrupt": len(still[tier]) for tier in reports},
            **{f"{tier}_repaired_by_copy": len(r.corrupt) - len(still[tier]) for tier, r in reports.items()},
            **{f"{tier}_unreadable": len(r.unreadable) for tier, r in reports.items()},
            **{f"{tier}_newer_format": len(r.newer) for tier, r in reports.items()},
            **{f"{tier}_cold": len(r.cold) for tier, r in reports.items()},
            **damage,
            **{f"{tier}_chunks_repaired": len(r.repaired) for tier, r in repairs.items()},
            **{f"{tier}_chunks_unrepaired": len(r.unrepaired) for tier, r in repairs.items()},
            **{f"{tier}_chunks_unresolved": len(r.unresolved) for tier, r in repairs.items()},
        }
    )
    for r in reports.values():
        if r.records_error:
            context.log.warning(r.records_error)
    for tier, repair in repairs.items():
        for digest, why in repair.unrepaired + repair.unavailable:
            context.log.warning(f"{tier} chunk {digest[:16]}… not repaired: {why[:300]}")
        if repair.unresolved:
            context.log.warning(
                f"{len(repair.unresolved)} damaged {tier} chunk(s) not repaired yet: a checkpoint that may list them "
                "could not be read (an outage, or a newer ckptflow wrote it); the next scrub tries again"
            )
    listed = MetadataValue.md("\n".join(f"- {c}" for c in corrupt + unreadable))
    if corrupt:
        raise Failure(
            f"{len(corrupt)} checkpoint(s) failed scrub, {len(unreadable)} could not be read; no tier held "
            "a sound copy of their damaged chunks. A chunk object refused is recorded in the store (where scrub "
            "may write), and the next save of a job that still holds its content writes it anew, a repair for "
            "every checkpoint sharing it",
            metadata={"corrupt": listed, **damage},
            allow_retries=False,
        )
    if newer:
        raise Failure(
            f"{len(newer)} checkpoint(s) were written by a newer ckptflow, which this code location cannot "
            f"verify (no verdict recorded, nothing changed): upgrade it; {newer[0][:300]}",
            metadata={"newer_format": MetadataValue.md("\n".join(f"- {c}" for c in newer))},
            allow_retries=False,
        )
    if reports["archive"].unreadable or reports["archive"].cold:
        unread = reports["archive"].unreadable + reports["archive"].cold
        context.log.warning(
            f"{len(unread)} archive-only checkpoint(s) in {arc.url} could not be read ({len(reports['archive'].cold)} "
            f"of them cold: thaw to scrub them; no verdict recorded; the next scrub tries again): {unread[0][:300]}"
        )
    cold = (
        f"{len(reports['hot'].cold)} checkpoint(s) in {hot.url} have an object in a cold storage class, which "
        "reads only once thawed (hours): no verdict recorded, nothing changed, not retried; thaw them, then "
        f"scrub again: {reports['hot'].cold[0][:1000]}"
        if reports["hot"].cold
        else ""
    )
    cold_listed = {"cold": MetadataValue.md("\n".join(f"- {c}" for c in reports["hot"].cold))} if cold else {}
    if reports["hot"].unreadable:  # retried; a cold object stays cold, so its instruction goes with the failure
        context.log.warning(
            f"{len(reports['hot'].unreadable)} checkpoint(s) in {hot.url} could not be read (no verdict recorded); "
            f"retrying: {reports['hot'].unreadable[0][:300]}"
        )
        raise store.retry_unavailable(context.retry_number) from Failure(
            f"the store {hot.url} could not be read: {len(reports['hot'].unreadable)} checkpoint(s) not verified"
            + (f"; and {cold}" if cold else ""),
            metadata={"unreadable": listed, **cold_listed},
        )
    if cold:
        raise Failure(cold, metadata=cold_listed, allow_retries=False)
    return {tier: {"checked": r.checked} for tier, r in reports.items()}


def _run_began(context: OpExecutionContext) -> float | None:
    """When this run began (its first attempt), to resume a retried scrub from; None if unknown."""
    record = context.instance.get_run_record_by_id(context.run_id)
    return None if record is None else record.start_time


def _repairs(context: OpExecutionContext, hot: Store, arc: Store, figures: dict) -> dict[str, lifecycle.RepairReport]:
    """Each tier's damaged chunks repaired from the other, its progress logged and its bytes,
    time and rate added to ``figures``; a tier whose records could not be read is skipped
    with a warning (the next scrub tries again: an outage proves nothing)."""
    repairs = {}
    for tier, store, source in (("hot", hot, arc), ("archive", arc, hot)):
        try:
            with logged_progress(context, f"repairing {store.url} from {source.url}") as meter:
                repairs[tier] = lifecycle.repair(store, [source], progress=meter)
        except StoreUnavailableError as e:
            context.log.warning(f"the {tier} tier's damaged chunks were not repaired: {e}")
            repairs[tier] = lifecycle.RepairReport()
        figures.update(size(f"{tier}_repaired", repairs[tier].bytes_repaired))
        figures.update(throughput(f"{tier}_repair", repairs[tier].bytes_repaired, meter.seconds))
    return repairs


def _whole_again(tier: Store, hot: Store, run: str, step: int, repaired: lifecycle.RepairReport) -> bool:
    """Whether a checkpoint scrub found corrupt in ``tier`` is whole now that chunks were
    repaired (a new verdict for its digest, in ``hot``, finding no damage: the failed verdict
    an import with allow_failed carries stands, and is no damage); False where nothing was
    repaired."""
    if not repaired.repaired:
        return False
    try:
        return not lifecycle.found_damage(lifecycle.validate(tier, run, step, records=hot))
    except CkptflowError:
        return False


@job(description="Re-verify old checkpoints, hot and archive-only, and record the verdicts.")
def scrub_job():
    scrub_checkpoints()


promotion_job = define_asset_job(
    "promotion",
    selection=AssetSelection.assets(deployed_model).downstream(),  # and mlflow_model where MLflow is configured
    description=(
        "Export a checkpoint (chosen, or best by a metric) as a model directory, register it as the next "
        "version and move latest; with stage: stable also stable, the old stable becoming fallback."
    ),
    config={"ops": {"deployed_model": {"config": {"action": "promote"}}}},
)
rollback_job = define_asset_job(
    "rollback",
    selection=AssetSelection.assets(deployed_model).downstream(),
    description="stable <- fallback (the previous stable); the rolled-back version becomes the fallback.",
    config={"ops": {"deployed_model": {"config": {"action": "rollback"}}}},
)

scrub_schedule = ScheduleDefinition(
    job=scrub_job, cron_schedule="0 3 * * *", default_status=DefaultScheduleStatus.RUNNING
)
retention_schedule = ScheduleDefinition(job=retention_job, cron_schedule="0 4 * * 0")  # weekly; off until turned on
