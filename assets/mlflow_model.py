"""``mlflow_model``: ckptflow's registry mirrored into an MLflow Model Registry (opt-in).

A step of its own after ``deployed_model`` in the promotion and rollback jobs, so a failed
MLflow call fails only this step, never the promotion: ckptflow's registry has already
moved and stays the source of truth. The step is retried (``RetryPolicy``) when a retry
may help (MLflow or the store did not answer), and the mirror is idempotent, so a retry,
or the next promotion, finishes what a failure left; a failure a retry repeats (MLflow
refused, a damaged registry record, another registry mirroring into the model, a registry
object in a cold storage class, which stays cold for the hours a thaw takes) fails at once.
Every model in ckptflow's registry is synced, so nothing depends on which one was promoted.
"""

import os

from dagster import (
    AssetExecutionContext,
    AssetsDefinition,
    Backoff,
    Failure,
    MaterializeResult,
    MetadataValue,
    RetryPolicy,
    asset,
)

from assets.models import deployed_model
from assets.partitions import partition_keys
from ckptflow.errors import CkptflowError, MirrorError, retrying_may_help
from resources import RegistryResource
from resources.mlflow_registry import MlflowRegistryResource

MIRROR_RETRIES = 3


def mirror_retry_policy() -> RetryPolicy:
    """3 retries, the first after ``CKPTFLOW_MLFLOW_RETRY_DELAY_S`` (default 30 s), doubling."""
    delay = float(os.environ.get("CKPTFLOW_MLFLOW_RETRY_DELAY_S") or 30)
    return RetryPolicy(max_retries=MIRROR_RETRIES, delay=delay, backoff=Backoff.EXPONENTIAL)


def build_mlflow_model() -> AssetsDefinition:
    """The asset, with its retry policy read from the environment when the code location loads."""
    return asset(
        mlflow_model, group_name="models", deps=[deployed_model], kinds={"mlflow"}, retry_policy=mirror_retry_policy()
    )


def mlflow_model(
    context: AssetExecutionContext, registry: RegistryResource, mlflow: MlflowRegistryResource
) -> MaterializeResult:
    """The MLflow model versions and aliases mirroring ckptflow's registry. Each model is
    synced on its own: one that fails (an MLflow error, a damaged record of its own in
    ckptflow's registry) fails the step once the others are mirrored, naming each failure."""
    reg = registry.open()
    mirror = mlflow.open()
    results, failed, retry = [], [], False
    held = partition_keys(context.instance)  # links name the partition this instance holds for each checkpoint
    models = reg.models()
    for model in models:
        try:
            results.append(mirror.sync(reg, model, partition_keys=held))
        except CkptflowError as e:  # MirrorError, or the registry's own RegistryError
            context.log.error(f"{model}: not mirrored: {e}")
            failed.append(f"{model}: {e}")
            retry |= retrying_may_help(e) or (isinstance(e, MirrorError) and e.retry)
    if failed:
        synced = sorted(r.model for r in results)
        raise Failure(
            f"{len(failed)} of {len(models)} models were not mirrored into MLflow ({synced or 'none'} were): "
            + "; ".join(failed),
            allow_retries=retry,  # a retry repeats a refusal, a damaged record, a clash: fail now
        )
    metadata: dict = {"tracking_uri": MetadataValue.url(mlflow.tracking_uri)}
    for r in results:
        context.log.info(f"{r.model} -> MLflow {r.registered_model}: created {r.created or 'none'}, moved {r.moved}")
        metadata[f"{r.model}/registered_model"] = r.registered_model
        metadata[f"{r.model}/link"] = MetadataValue.url(
            f"{mlflow.tracking_uri.rstrip('/')}/#/models/{r.registered_model}"
        )
        metadata[f"{r.model}/versions"] = MetadataValue.json({f"v{k}": v for k, v in r.versions.items()})
        metadata[f"{r.model}/aliases"] = MetadataValue.json(r.aliases)
        metadata[f"{r.model}/changed"] = r.changed
    return MaterializeResult(metadata=metadata)
