"""The MLflow Model Registry that ckptflow's registry is mirrored into (opt-in).

Configured by ``CKPTFLOW_MLFLOW_TRACKING_URI`` (or ``build_definitions(mlflow=...)``): when
it is set, the code location gains the ``mlflow_model`` asset, which the promotion and
rollback jobs materialize after ``deployed_model``. The work is
``ckptflow.interop.mlflow_registry.MlflowMirror``; ``mlflow`` is imported only in its runs.
"""

import os

from dagster import ConfigurableResource
from pydantic import Field

from ckptflow.interop.mlflow_registry import MlflowMirror


def mlflow_uri_from_env() -> str:
    return os.environ.get("CKPTFLOW_MLFLOW_TRACKING_URI", "")


class MlflowRegistryResource(ConfigurableResource):
    """Where ckptflow's model versions and aliases are mirrored."""

    tracking_uri: str = Field(description="MLflow tracking (and registry) server URL, e.g. http://mlflow:5000")
    registered_model: str = Field(default="{model}", description="MLflow model name of a ckptflow model")
    experiment: str = Field(default="ckptflow-models", description="MLflow experiment of the runs holding the files")
    partition_link: str = Field(
        default="", description="URL template of a checkpoint partition's page ({partition_key}, {run}, {step})"
    )
    attempts: int = Field(default=4, description="tries of each MLflow call within one step, before it fails")

    def open(self) -> MlflowMirror:
        return MlflowMirror(
            self.tracking_uri,
            registered_model=self.registered_model,
            experiment=self.experiment,
            partition_link=self.partition_link,
            attempts=self.attempts,
        )
