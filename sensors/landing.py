"""The landing sensor: new commit records become partitions and validation runs.

Which commits are new, and the cursor that remembers them, is the library's
(``ckptflow.lifecycle.landing``); this sensor turns them into Dagster's terms. One
``SensorResult`` both adds the dynamic partitions and requests their runs, so a
partition never exists without its validation having been requested (and a tick that
fails adds neither). Each run's key holds the commit's marker (its manifest digest),
so a step committed again gets a run of its own. A commit that already has a
validation record (scrub, a promotion or the demo's in-process driver validated it)
gets no new run only if its ``checkpoint`` partition was materialized for that very
digest: a verdict in the store is not a materialization, and without one the automation
never requests its evaluation, compression or archival. A store that does not answer
(``StoreUnavailableError``) skips the tick, saying so, with the cursor kept: the next tick
lists again from where this one would have.
"""

from dagster import (
    AssetRecordsFilter,
    AssetSelection,
    DagsterInstance,
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    define_asset_job,
    sensor,
)

from assets.checkpoints import checkpoint
from assets.freshness import RPO_FRESHNESS_KEY
from assets.partitions import (
    DIGEST_TAG,
    checkpoint_tags,
    checkpoints_partitions,
    in_step_order,
    parse_checkpoint_key,
    partition_keys,
)
from ckptflow.errors import StoreUnavailableError
from ckptflow.lifecycle import landing
from resources import CheckpointStoreResource
from sensors.intervals import SENSOR_INTERVAL_S

LANE_TAG = "ckptflow/lane"  # validation / evaluation / archival: what the run queue limits by

validation_job = define_asset_job(
    "validate_checkpoint",
    # the checkpoint with its blocking integrity check; the store-wide RPO check runs on its own cadence
    selection=AssetSelection.assets(checkpoint) - AssetSelection.checks(RPO_FRESHNESS_KEY),
    description=(
        "Verify a newly committed checkpoint (manifest, rank records, every chunk) and register it. "
        "A corrupt checkpoint fails this run: its blocking integrity check blocked it, and the failure says why."
    ),
)


@sensor(job=validation_job, minimum_interval_seconds=SENSOR_INTERVAL_S, default_status=DefaultSensorStatus.RUNNING)
def landing_sensor(context: SensorEvaluationContext, store: CheckpointStoreResource):
    """Adds a ``checkpoints`` partition per new commit record and requests its validation;
    skips the tick, its cursor kept, while the store does not answer."""
    try:
        landed, cursor = landing.land(store.open(), context.cursor)
    except StoreUnavailableError as e:  # an outage proves nothing: the next tick lists again from the same cursor
        why = f"the checkpoint store {store.url} is unavailable ({e}): no commit records listed; retried next tick"
        context.log.warning(why)
        return SkipReason(f"{why}, from the same cursor")
    if not landed:
        return SensorResult(skip_reason=SkipReason("no new commit records"), cursor=cursor)
    held = partition_keys(context.instance)  # a checkpoint an older instance holds under its former name keeps it
    keys = {c.key: held.get(parse_checkpoint_key(c.key), c.key) for c in landed}
    new_keys = in_step_order(set(keys.values()) - set(held.values()))
    requests = [
        RunRequest(
            run_key=f"{keys[c.key]}@{c.marker}",
            partition_key=keys[c.key],
            tags={LANE_TAG: "validation", **checkpoint_tags(c.key), **({DIGEST_TAG: c.digest} if c.digest else {})},
        )
        for c in landed
        if not (c.validated and _materialized_for(context.instance, keys[c.key], c.digest))
    ]
    context.log.info(
        f"{len(landed)} new commit record(s); {len(new_keys)} new partition(s), {len(requests)} validation run(s)"
    )
    return SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[checkpoints_partitions.build_add_request(new_keys)] if new_keys else [],
        cursor=cursor,
    )


def _materialized_for(instance: DagsterInstance, partition_key: str, digest: str) -> bool:
    """Whether the newest materialization of ``checkpoint`` in ``partition_key`` is of the
    commit ``digest`` (asked only of commits that have a validation record: few)."""
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=checkpoint.key, asset_partitions=[partition_key]), limit=1
    ).records
    if not records or records[0].asset_materialization is None:
        return False
    named = records[0].asset_materialization.metadata.get("manifest_digest")
    return getattr(named, "value", named) == digest
