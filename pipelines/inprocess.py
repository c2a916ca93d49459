"""Drive the lifecycle to quiescence in-process, the way the daemon would.

`dagster dev` runs sensors and the automation sensor in the daemon; tests and the demo
need the same sequence synchronously against a real ``DagsterInstance``: tick the
landing sensor (add partitions, run the validation runs it requests), then evaluate the
automation conditions and run what they request, until nothing more is requested.
Everything lands in the instance, so `make ui` on the same DAGSTER_HOME shows it.
"""

from collections import defaultdict
from dataclasses import dataclass, field

from dagster import (
    AssetKey,
    DagsterInstance,
    Definitions,
    SensorResult,
    build_sensor_context,
    evaluate_automation_conditions,
)

from assets.partitions import checkpoints_partitions
from sensors.landing import landing_sensor


@dataclass
class DriveReport:
    landed: list[str] = field(default_factory=list)
    runs: dict[str, bool] = field(default_factory=dict)  # run description -> success


QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}  # run logs still go to the instance


def tick_landing(
    defs: Definitions,
    instance: DagsterInstance,
    cursor: str | None,
    report: DriveReport,
    run_config: dict | None = None,
) -> str | None:
    """One landing-sensor tick: apply its partition requests, execute its run requests."""
    # a context manager: resources with nested resources (the S3 archive's S3Resource) are set up in it
    with build_sensor_context(instance=instance, cursor=cursor, resources=dict(defs.resources or {})) as context:
        result = landing_sensor(context)
    if not isinstance(result, SensorResult):
        return cursor
    for request in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    job = defs.resolve_job_def(landing_sensor.job_name)
    for run_request in result.run_requests or []:
        outcome = job.execute_in_process(
            instance=instance, partition_key=run_request.partition_key, raise_on_error=False, run_config=run_config
        )
        report.runs[f"{job.name}[{run_request.partition_key}]"] = outcome.success
        report.landed.append(run_request.partition_key)
    return result.cursor


def run_automation(
    defs: Definitions,
    instance: DagsterInstance,
    cursor,
    report: DriveReport,
    run_config: dict | None = None,
    max_rounds: int = 10,
):
    """Evaluate automation conditions and execute what they request, round after round;
    returns the automation cursor (pass it to the next call, as the daemon keeps it)."""
    asset_job = defs.resolve_implicit_global_asset_job_def()
    for _ in range(max_rounds):
        result = evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
        cursor = result.cursor
        if not result.total_requested:
            break
        by_partition: dict[str | None, list[AssetKey]] = defaultdict(list)
        for asset_key in {r.key for r in result.results if r.true_subset.size and isinstance(r.key, AssetKey)}:
            for partition in result.get_requested_partitions(asset_key):
                by_partition[partition].append(asset_key)
        for partition, keys in sorted(by_partition.items(), key=lambda kv: str(kv[0])):
            outcome = asset_job.execute_in_process(
                instance=instance,
                partition_key=partition,
                asset_selection=sorted(keys, key=str),
                raise_on_error=False,
                run_config=run_config,
            )
            names = ",".join(k.to_user_string() for k in sorted(keys, key=str))
            report.runs[f"{names}[{partition}]"] = outcome.success
    return cursor


class Driver:
    """Holds the two cursors the daemon would keep: the landing sensor's and automation's."""

    def __init__(self, defs: Definitions, instance: DagsterInstance, quiet: bool = False):
        self.defs, self.instance = defs, instance
        self.run_config = QUIET if quiet else None
        self.sensor_cursor: str | None = None
        # the automation sensor has been running before anything landed: its first
        # evaluation only records the starting state
        self.automation_cursor = evaluate_automation_conditions(defs=defs, instance=instance).cursor

    def drive(self) -> DriveReport:
        """Land everything new, then run downstream automation until quiet."""
        report = DriveReport()
        while True:
            before = len(report.landed)
            self.sensor_cursor = tick_landing(self.defs, self.instance, self.sensor_cursor, report, self.run_config)
            if len(report.landed) == before:
                break
        self.automation_cursor = run_automation(
            self.defs, self.instance, self.automation_cursor, report, self.run_config
        )
        return report


def dynamic_keys(instance: DagsterInstance) -> list[str]:
    return list(instance.get_dynamic_partitions(checkpoints_partitions.name))
