"""Run-failure sensor: a failed run about a checkpoint is recorded next to it.

The record goes to the store as the checkpoint's ``failure`` lifecycle record (keyed by
the manifest digest the run was about), so the inventory shows "last failure" per
checkpoint whatever Dagster instance runs it, and operators see that, e.g., archival
of a checkpoint keeps failing.
"""

from dagster import DefaultSensorStatus, RunFailureSensorContext, run_failure_sensor

from assets.partitions import parse_checkpoint_key
from ckptflow import catalog
from ckptflow.errors import CkptflowError
from ckptflow.lifecycle.records import Subject, write_record
from resources import CheckpointStoreResource
from sensors.landing import DIGEST_TAG


@run_failure_sensor(default_status=DefaultSensorStatus.RUNNING, minimum_interval_seconds=30)
def failure_sensor(context: RunFailureSensorContext, store: CheckpointStoreResource) -> None:
    run = context.dagster_run
    key = run.tags.get("dagster/partition")
    if not key:
        context.log.info(f"run {run.run_id} of {run.job_name} failed; it names no checkpoint partition")
        return
    try:
        ckpt_run, step = parse_checkpoint_key(key)
    except ValueError:
        return
    hot = store.open()
    digest = run.tags.get(DIGEST_TAG)
    if not digest:
        try:
            digest = catalog.read_manifest(hot, ckpt_run, step).digest
        except CkptflowError as e:
            context.log.info(f"run {run.run_id} failed for {key}, whose commit record cannot be read: {e}")
            return
    steps = [e.step_key for e in context.get_step_failure_events()]
    write_record(
        hot,
        Subject(ckpt_run, step, digest),
        "failure",
        {
            "run_id": run.run_id,
            "job": run.job_name,
            "steps": steps,
            "message": context.failure_event.message or "run failed",
        },
    )
