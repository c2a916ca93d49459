"""The landing sensor: new commit records become partitions and validation runs.

One ``SensorResult`` both adds the dynamic partitions and requests their runs, so a
partition never exists without its validation having been requested (and a tick that
fails adds neither).

Cost. The cursor is JSON ``{run: last step seen}``. A tick lists the run directories
and, per run, its step directories (one ``list`` each, no reads); only steps above the
cursor are stat'ed for a commit record. ``max_per_tick`` pages: the cursor advances only
as far as the partitions this tick added, so a store with 10,000 new checkpoints
lands over several ticks without a huge run request list.

A step without a manifest (a save in flight, or one that died) is not a checkpoint and
does not move the cursor; once a newer step commits the cursor passes it, because a
save never commits below a newer commit of the same run.

Checkpoints whose partition already exists (registered by an in-process driver such as
the demo, or before a cursor reset) are passed over without a new run, so pointing the
daemon at an instance that already knows them does not revalidate everything.
"""

import json

from dagster import (
    AssetSelection, DefaultSensorStatus, RunRequest, SensorEvaluationContext, SensorResult, SkipReason,
    define_asset_job, sensor,
)

from assets.checkpoints import checkpoint
from assets.partitions import checkpoint_key, checkpoints_partitions
from ckptflow import catalog
from ckptflow import format as fmt
from resources import CheckpointStoreResource

MAX_PER_TICK = 500

validation_job = define_asset_job(
    "validate_checkpoint",
    selection=AssetSelection.assets(checkpoint),  # with its blocking integrity check
    description="Register a checkpoint and run its blocking integrity check.",
)


def new_checkpoints(store, cursor: dict[str, int], limit: int) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """Committed (run, step)s above the cursor, oldest first per run, at most ``limit``,
    and the cursor after them."""
    found: list[tuple[str, int]] = []
    cursor = dict(cursor)
    for run in catalog.list_runs(store):
        last = cursor.get(run, -1)
        for step in catalog.list_steps(store, run):
            if len(found) >= limit:
                return found, cursor
            if step > last and store.exists(fmt.manifest_key(run, step)):
                found.append((run, step))
                cursor[run] = step
    return found, cursor


@sensor(job=validation_job, minimum_interval_seconds=30, default_status=DefaultSensorStatus.RUNNING)
def landing_sensor(context: SensorEvaluationContext, store: CheckpointStoreResource):
    """Adds a ``checkpoints`` partition per new commit record and requests its validation."""
    cursor = json.loads(context.cursor) if context.cursor else {}
    found, cursor = new_checkpoints(store.open(), cursor, MAX_PER_TICK)
    if not found:
        return SkipReason("no new commit records")
    known = set(context.instance.get_dynamic_partitions(checkpoints_partitions.name))
    keys = [k for k in (checkpoint_key(run, step) for run, step in found) if k not in known]
    cursor_json = json.dumps(cursor, sort_keys=True)
    if not keys:
        return SensorResult(skip_reason=f"{len(found)} new commit record(s), all already registered", cursor=cursor_json)
    context.log.info(f"landing {len(keys)} checkpoint(s): {keys[0]} … {keys[-1]}")
    return SensorResult(
        run_requests=[RunRequest(run_key=key, partition_key=key) for key in keys],
        dynamic_partitions_requests=[checkpoints_partitions.build_add_request(keys)],
        cursor=cursor_json,
    )
