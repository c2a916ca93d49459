"""The one Dagster code location: assets, checks, sensors, jobs, schedules, resources.

Resources are chosen per deployment by ``CKPTFLOW_DEPLOYMENT``:

* ``local`` (default): the hot store is ``CKPTFLOW_STORE`` or ``<repo>/.demo/store``
  (what `make demo` writes), the archive ``CKPTFLOW_ARCHIVE`` or ``<repo>/.demo/archive``;
* ``production``: ``CKPTFLOW_STORE`` and ``CKPTFLOW_ARCHIVE`` are required (read by
  Dagster at run time through ``EnvVar``, so they never appear in run config).

In both, an archive URL ``s3://bucket/prefix`` (``CKPTFLOW_ARCHIVE``, read when the code
location loads) selects ``S3ArchiveResource``: dagster-aws ``S3Resource`` (endpoint from
``CKPTFLOW_S3_ENDPOINT_URL`` for S3-compatible stores; region and credentials from the
standard AWS environment) feeding ckptflow's S3 backend, objects written in
``CKPTFLOW_ARCHIVE_STORAGE_CLASS`` (e.g. ``GLACIER_IR``; default: the bucket's default).

MLflow (opt-in): with ``CKPTFLOW_MLFLOW_TRACKING_URI`` set (or ``build_definitions(mlflow=...)``),
the ``mlflow_model`` asset mirrors ckptflow's registry into that MLflow Model Registry as a
step of its own in the promotion and rollback jobs (``assets/mlflow_model.py``).

Evaluators are chosen per run: ``CKPTFLOW_EVALUATORS`` is a JSON object of run-name
pattern -> ``module:function``; runs that match no pattern are evaluated from their
trainer's recorded metrics. The local default scores the demo run with the demo's
evaluator (``pipelines/demo/evaluate.py``) and nothing else.
"""

import os

from dagster import (
    AssetSelection,
    AutomationConditionSensorDefinition,
    DefaultSensorStatus,
    Definitions,
    EnvVar,
    in_process_executor,
)

from assets import ALL_ASSETS, ALL_CHECKS, evaluation
from pipelines.jobs import promotion_job, retention_job, retention_schedule, rollback_job, scrub_job, scrub_schedule
from resources import (
    ArchiveResource,
    CheckpointStoreResource,
    EvaluatorResource,
    PricingResource,
    RegistryResource,
    RetentionResource,
)
from resources.archive import default_archive_url
from resources.evaluator import evaluators_from_env
from resources.mlflow_registry import mlflow_uri_from_env
from resources.store import default_store_url
from sensors import failure_sensor, landing_sensor, validation_job
from sensors.intervals import SENSOR_INTERVAL_S
from sensors.landing import LANE_TAG

DEMO_EVALUATORS = {"tinylm-demo": "pipelines.demo.evaluate:evaluate"}


def resources_for(deployment: str, *, store: str | None = None, archive: str | None = None) -> dict:
    """Resources of a deployment; ``store`` / ``archive`` override the local defaults."""
    evaluator = EvaluatorResource(evaluators=evaluators_from_env(DEMO_EVALUATORS if deployment == "local" else {}))
    archive_url = archive or os.environ.get("CKPTFLOW_ARCHIVE") or ""
    s3_archive = None
    if archive_url.startswith("s3://"):
        from resources.s3_archive import S3ArchiveResource  # dagster-aws only where it is used

        s3_archive = S3ArchiveResource.from_url(
            archive_url,
            endpoint_url=os.environ.get("CKPTFLOW_S3_ENDPOINT_URL") or None,
            storage_class=os.environ.get("CKPTFLOW_ARCHIVE_STORAGE_CLASS") or None,
        )
    if deployment == "local":
        store, archive = store or default_store_url(), archive or default_archive_url()
        return {
            "store": CheckpointStoreResource(url=store),
            "archive": s3_archive or ArchiveResource(url=archive),
            "registry": RegistryResource(url=store),
            "evaluator": evaluator,
            "pricing": PricingResource.from_env(),
            "retention": RetentionResource.from_env(),
        }
    if deployment == "production":
        return {
            "store": CheckpointStoreResource(url=EnvVar("CKPTFLOW_STORE")),
            "archive": s3_archive or ArchiveResource(url=EnvVar("CKPTFLOW_ARCHIVE")),
            "registry": RegistryResource(url=EnvVar("CKPTFLOW_STORE")),
            "evaluator": evaluator,
            "pricing": PricingResource.from_env(),
            "retention": RetentionResource.from_env(),
        }
    raise ValueError(f"CKPTFLOW_DEPLOYMENT={deployment!r} is not one of 'local', 'production'")


# Downstream per-checkpoint assets follow their AutomationConditions, evaluated by two
# sensors (on by default) so that evaluation and archival are separate runs: a failing
# evaluator fails only its own run, never the compression and archival of the same
# checkpoint (Dagster puts everything one sensor requests for a partition in one run).
# Runs are requested directly, not as backfills: a backfill adds a backfill-daemon
# iteration (up to 30 s) before its run is even queued.
EVALUATION = AssetSelection.assets(evaluation)
lifecycle_automation = AutomationConditionSensorDefinition(
    "lifecycle_automation",
    target=AssetSelection.all() - EVALUATION,
    default_status=DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    emit_backfills=False,
    run_tags={LANE_TAG: "archival"},
    description="Compression and archival of validated checkpoints; the inventory and metrics on their cadence.",
)
evaluation_automation = AutomationConditionSensorDefinition(
    "evaluation_automation",
    target=EVALUATION,
    default_status=DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    emit_backfills=False,
    run_tags={LANE_TAG: "evaluation"},  # the instance's run queue limits this lane (pipelines/instance/)
    description="Evaluation of validated checkpoints, in runs of its own.",
)


def build_definitions(
    deployment: str | None = None, *, store: str | None = None, archive: str | None = None, mlflow: str | None = None
) -> Definitions:
    resources = resources_for(
        deployment or os.environ.get("CKPTFLOW_DEPLOYMENT", "local"), store=store, archive=archive
    )
    assets = list(ALL_ASSETS)
    mlflow_uri = mlflow or mlflow_uri_from_env()
    if mlflow_uri:  # opt-in: the MLflow mirror is an asset only where an MLflow server is configured
        from assets.mlflow_model import build_mlflow_model
        from resources.mlflow_registry import MlflowRegistryResource

        assets.append(build_mlflow_model())
        resources["mlflow"] = MlflowRegistryResource(tracking_uri=mlflow_uri)
    return Definitions(
        assets=assets,
        asset_checks=ALL_CHECKS,
        jobs=[validation_job, retention_job, scrub_job, promotion_job, rollback_job],
        schedules=[scrub_schedule, retention_schedule],
        sensors=[landing_sensor, failure_sensor, lifecycle_automation, evaluation_automation],
        resources=resources,
        # One process per run: the multiprocess executor would start a Python process per
        # step, each importing torch and the code location again (seconds per step).
        executor=in_process_executor,
    )


defs = build_definitions()
__all__ = ["build_definitions", "defs", "evaluation_automation", "lifecycle_automation", "resources_for"]
