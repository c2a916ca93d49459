"""Jobs and schedules: retention, scrub, promotion, rollback.

Retention and scrub act on many checkpoints at once and decide per checkpoint, so they
are op jobs over the library rather than partitioned materializations; promotion and
rollback change one thing (what is deployed), so they materialize ``deployed_model``.
"""

import time

from dagster import (
    AssetSelection, Config, DefaultScheduleStatus, Failure, MetadataValue, OpExecutionContext, ScheduleDefinition,
    define_asset_job, job, op,
)

from assets.inventory import RetentionConfig, compute_plan
from assets.models import deployed_model
from assets.partitions import checkpoint_key, checkpoints_partitions
from ckptflow import catalog, inventory, lifecycle
from ckptflow.gc import gc
from ckptflow.retention import DAY
from resources import ArchiveTierResource, CheckpointStoreResource, RegistryResource


@op
def apply_retention(
    context: OpExecutionContext, config: RetentionConfig, store: CheckpointStoreResource,
    archive: ArchiveTierResource, registry: RegistryResource,
) -> dict:
    """Recompute the plan now (never trust an older dry run) and expire hot copies
    (commit record first, so the copy stops existing at once), then let GC of the hot
    tier reclaim the chunks nothing there references any more.

    Tiers: a checkpoint whose archive copy verified and matches keeps that copy, its
    partition and its lifecycle records (only the hot copy goes); one without loses its
    partition too. A checkpoint the plan keeps in the archive only is left hot if its
    archive copy cannot be confirmed. Retention never deletes from the archive tier."""
    hot, arc = store.open(), archive.open()
    plan = compute_plan(config, inventory.collect(hot, arc), registry)
    expired, hot_only_expired, left_hot = [], [], []
    for run, step in plan.expire_hot:
        key = checkpoint_key(run, step)
        why_not = inventory.archive_copy_matches(hot, arc, run, step)
        if why_not is None:
            lifecycle.expire(hot, run, step, keep_records=True)
            hot_only_expired.append(key)
            context.log.info(f"expired the hot copy of {key}; the archive copy in {arc.url} stays")
            continue
        if (run, step) in plan.archive_only:
            left_hot.append(key)
            context.log.warning(f"kept the hot copy of {key}: {why_not}")
            continue
        lifecycle.expire(hot, run, step)
        if context.instance.has_dynamic_partition(checkpoints_partitions.name, key):
            context.instance.delete_dynamic_partition(checkpoints_partitions.name, key)
        expired.append(key)
        context.log.info(f"expired {key}: {plan.delete[(run, step)]}")
    report = gc(hot, grace=config.gc_grace)
    context.add_output_metadata({
        "expired": len(expired), "hot_copies_expired": len(hot_only_expired), "left_hot": len(left_hot),
        "kept": len(plan.keep), "gc_deleted_objects": len(report.deleted),
        "gc_deleted_bytes": MetadataValue.int(report.bytes), "gc_skipped": report.skipped or "",
        "expired_keys": MetadataValue.md("\n".join(f"- {k}" for k in expired) or "none"),
    })
    return {"expired": expired, "hot_copies_expired": hot_only_expired, "left_hot": left_hot,
            "gc_bytes": report.bytes, "gc_skipped": report.skipped}


@job(description=(
    "Apply the retention policy to the hot tier (archive copies stay), drop partitions of "
    "checkpoints gone from every tier, then GC the hot tier."
))
def retention_job():
    apply_retention()


class ScrubConfig(Config):
    older_than_days: float = 1.0  # young checkpoints were just validated on landing


@op
def scrub_checkpoints(context: OpExecutionContext, config: ScrubConfig, store: CheckpointStoreResource) -> dict:
    """Re-verify every chunk of checkpoints older than N days (bit rot, lost objects) and
    record each verdict; fails the run if any is corrupt so an operator hears of it."""
    hot = store.open()
    cutoff = time.time() - config.older_than_days * DAY
    checked, corrupt = 0, []
    for run in catalog.list_runs(hot):
        for info in catalog.list_checkpoints(hot, run):
            if info.created_at >= cutoff:
                continue
            record = lifecycle.validate(hot, run, info.step)
            checked += 1
            if not record["ok"]:
                corrupt.append(f"{checkpoint_key(run, info.step)}: {'; '.join(record['problems'])[:300]}")
    context.add_output_metadata({"checked": checked, "corrupt": len(corrupt)})
    if corrupt:
        raise Failure(f"{len(corrupt)} checkpoint(s) failed scrub", metadata={
            "corrupt": MetadataValue.md("\n".join(f"- {c}" for c in corrupt))})
    return {"checked": checked}


@job(description="Re-verify old checkpoints and record the verdicts.")
def scrub_job():
    scrub_checkpoints()


promotion_job = define_asset_job(
    "promotion", selection=AssetSelection.assets(deployed_model),
    description="Export a checkpoint (chosen, or best by a metric) to safetensors, register it, move an alias.",
    config={"ops": {"deployed_model": {"config": {"action": "promote"}}}},
)
rollback_job = define_asset_job(
    "rollback", selection=AssetSelection.assets(deployed_model), description="stable <- fallback.",
    config={"ops": {"deployed_model": {"config": {"action": "rollback"}}}},
)

scrub_schedule = ScheduleDefinition(job=scrub_job, cron_schedule="0 3 * * *", default_status=DefaultScheduleStatus.RUNNING)
retention_schedule = ScheduleDefinition(job=retention_job, cron_schedule="0 4 * * 0")  # weekly; off until turned on
