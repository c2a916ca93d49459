"""Drive the lifecycle to quiescence in-process, in the order the daemon would.

`dagster dev` runs the sensors in the daemon; the demo and the fast tests need the same
sequence synchronously against a real ``DagsterInstance``: tick the landing sensor
(add partitions, run the validation runs it requests), then evaluate each automation
sensor's conditions and run what it requests (one run per sensor and partition, as
the daemon does), until nothing more is requested, then tick the failure sensor.
Everything lands in the instance, so `make ui` on the same DAGSTER_HOME shows it.

This is a stand-in for the daemon, not a proof that the daemon works:
``tests/dagster/test_daemon.py`` runs the real ``dagster-daemon``. Checks with their own
automation condition (the RPO freshness check) are left to the daemon.
"""

import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from dagster import (
    AssetKey,
    AutomationConditionSensorDefinition,
    BetaWarning,
    DagsterInstance,
    Definitions,
    SensorResult,
    build_sensor_context,
    evaluate_automation_conditions,
)

from assets.partitions import CHECKPOINTS_PARTITIONS, parse_checkpoint_key
from sensors.failures import failure_sensor
from sensors.landing import landing_sensor, validation_job

# evaluate_automation_conditions selects with a beta parameter internally; we opt in by using it
warnings.filterwarnings(
    "ignore", message=r"Parameter `include_sources` of function `AssetSelection.all`", category=BetaWarning
)


@dataclass
class DriveReport:
    """What one drive did. ``landed``: the checkpoint partitions commits landed in, each once,
    in the order they first did; a step committed again lands a second commit in the same
    partition, and its second validation run is in ``runs`` under its run key. ``runs`` holds
    every run (``add_run``): an asset and partition the automation runs again is there again."""

    landed: list[str] = field(default_factory=list)
    runs: dict[str, bool] = field(default_factory=dict)  # run description -> success

    def add_landed(self, keys: list[str]) -> None:
        self.landed.extend(dict.fromkeys(k for k in keys if k not in self.landed))

    def add_run(self, name: str, success: bool, *, again: str | None = None) -> None:
        """Record a run under ``name``; when a run already has that name, under ``again``, else
        ``name #2``, ``#3``...: every run is an entry of its own, so a round of runs of what
        ran before still counts as runs (``Driver.drive`` stops at a round that adds none)."""
        key = next((k for k in (name, again) if k is not None and k not in self.runs), None)
        nth = 2
        while key is None:
            key = None if f"{name} #{nth}" in self.runs else f"{name} #{nth}"
            nth += 1
        self.runs[key] = success


QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}  # run logs still go to the instance


def _sensor_context(defs: Definitions, instance: DagsterInstance, cursor: str | None):
    # a context manager: resources with nested resources are set up in it
    return build_sensor_context(instance=instance, cursor=cursor, resources=dict(defs.resources or {}))


def tick_landing(
    defs: Definitions,
    instance: DagsterInstance,
    cursor: str | None,
    report: DriveReport,
    run_config: dict | None = None,
) -> tuple[str | None, bool]:
    """One landing-sensor tick: apply its partition requests, execute its run requests.
    Returns the sensor's cursor and whether the tick landed any commit record: one that
    landed only commits landed before (partitions held, validated for their digest: no
    request) still moved the cursor a page on, and the next tick may land new ones."""
    with _sensor_context(defs, instance, cursor) as context:
        result = landing_sensor(context)
    if not isinstance(result, SensorResult):
        return cursor, False
    for request in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        report.add_landed(list(request.partition_keys))
    job = defs.resolve_job_def(validation_job.name)
    for run_request in result.run_requests or []:
        key = run_request.partition_key
        assert key is not None  # the landing sensor requests runs of checkpoint partitions
        outcome = job.execute_in_process(
            instance=instance,
            partition_key=key,
            raise_on_error=False,
            run_config=run_config,
            tags=run_request.tags,
        )
        report.add_run(f"{job.name}[{key}]", outcome.success, again=f"{job.name}[{run_request.run_key}]")
        report.add_landed([key])
    return result.cursor, result.skip_reason is None


def tick_failures(defs: Definitions, instance: DagsterInstance, cursor: str | None) -> str | None:
    """One failure-sensor tick: record (and tag) every run that failed since ``cursor``."""
    with _sensor_context(defs, instance, cursor) as context:
        failure_sensor(context)
        return context.cursor


def run_automation(
    defs: Definitions,
    instance: DagsterInstance,
    sensor: AutomationConditionSensorDefinition,
    cursor,
    report: DriveReport,
    run_config: dict | None = None,
    *,
    evaluation_time: datetime | None = None,
):
    """Evaluate one automation sensor's conditions once (at ``evaluation_time``, default
    now) and execute what they request, one run per partition; returns the sensor's cursor
    (pass it to the next call)."""
    asset_job = defs.resolve_implicit_global_asset_job_def()
    result = evaluate_automation_conditions(
        defs=defs,
        instance=instance,
        asset_selection=sensor.asset_selection,
        cursor=cursor,
        evaluation_time=evaluation_time,
    )
    by_partition: dict[str | None, list[AssetKey]] = defaultdict(list)
    for asset_key in {r.key for r in result.results if r.true_subset.size and isinstance(r.key, AssetKey)}:
        for partition in result.get_requested_partitions(asset_key):
            by_partition[partition].append(asset_key)
    for partition, keys in sorted(by_partition.items(), key=lambda kv: _step_order(kv[0])):
        outcome = asset_job.execute_in_process(
            instance=instance,
            partition_key=partition,
            asset_selection=sorted(keys, key=str),
            raise_on_error=False,
            run_config=run_config,
        )
        names = ",".join(k.to_user_string() for k in sorted(keys, key=str))
        report.add_run(f"{names}[{partition}]", outcome.success)
    return result.cursor


def _step_order(partition: str | None) -> tuple:
    """Checkpoints by (run, step), as the daemon would meet them; anything else first."""
    try:
        return (1, *parse_checkpoint_key(partition)) if partition else (0, "", 0)
    except ValueError:
        return (0, partition, 0)


class Driver:
    """Holds the cursors the daemon would keep: the sensors' and each automation sensor's.

    ``clock`` gives each automation evaluation its time (default: the wall clock). The
    summaries refresh when a ``*/10`` cron tick passes between two evaluations, so a test
    that expects a quiet second pass pins the clock instead of racing the wall clock.
    """

    def __init__(
        self,
        defs: Definitions,
        instance: DagsterInstance,
        *,
        quiet: bool = False,
        clock: Callable[[], datetime | None] = lambda: None,
    ):
        self.defs, self.instance, self.clock = defs, instance, clock
        self.run_config = QUIET if quiet else None
        self.sensor_cursor: str | None = None
        self.failure_cursor: str | None = None
        self.automation = [s for s in defs.sensors or [] if isinstance(s, AutomationConditionSensorDefinition)]
        # the automation sensors have been running before anything landed: their first
        # evaluation only records the starting state
        self.automation_cursors = {
            s.name: evaluate_automation_conditions(
                defs, instance, asset_selection=s.asset_selection, evaluation_time=clock()
            ).cursor
            for s in self.automation
        }

    def drive(self, max_rounds: int = 10) -> DriveReport:
        """Land everything new, run each automation sensor until quiet, record failures."""
        report = DriveReport()
        landed = True
        while landed:  # until a tick lands no commit record: a page of those landed before is not the end
            self.sensor_cursor, landed = tick_landing(
                self.defs, self.instance, self.sensor_cursor, report, self.run_config
            )
        for _ in range(max_rounds):
            before = len(report.runs)
            for sensor in self.automation:
                self.automation_cursors[sensor.name] = run_automation(
                    self.defs,
                    self.instance,
                    sensor,
                    self.automation_cursors[sensor.name],
                    report,
                    self.run_config,
                    evaluation_time=self.clock(),
                )
            if len(report.runs) == before:
                break
        self.failure_cursor = tick_failures(self.defs, self.instance, self.failure_cursor)
        return report


def dynamic_keys(instance: DagsterInstance) -> list[str]:
    return list(instance.get_dynamic_partitions(CHECKPOINTS_PARTITIONS))
