"""Run-failure sensor: a failed run about a checkpoint is recorded next to it.

The record goes to the store (``lifecycle/<run>/<step>/failure.json``), so the
inventory shows "last failure" per checkpoint whatever Dagster instance runs it, and
retention/operators see that, e.g., archival of a checkpoint keeps failing.
"""

from dagster import DefaultSensorStatus, RunFailureSensorContext, run_failure_sensor

from assets.partitions import parse_checkpoint_key
from ckptflow import lifecycle
from resources import CheckpointStoreResource


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
    steps = [e.step_key for e in context.get_step_failure_events()]
    lifecycle.write_record(store.open(), ckpt_run, step, "failure", {
        "run_id": run.run_id, "job": run.job_name, "steps": steps,
        "message": context.failure_event.message or "run failed",
    })
