"""The tags a mirrored MLflow version carries, without a server (the mirror itself is
tested against a real ``mlflow server`` in test_mlflow_registry.py)."""

from ckptflow.format.layout import checkpoint_name, legacy_checkpoint_name
from ckptflow.interop.mlflow_registry import lineage_tags
from ckptflow.interop.registry import ModelVersion

LINK = "http://dagster/assets/checkpoint?partition={partition_key}&run={run}&step={step}"


def version(step: int = 40) -> ModelVersion:
    return ModelVersion("m", 1, "r", step, checkpoint_name("r", step), "d" * 64, {"model.safetensors": {"sha256": "e"}})


def test_the_partition_link_names_the_checkpoints_name_by_default():
    tags = lineage_tags(version(), partition_link=LINK)
    assert tags["ckptflow.partition_key"] == "r@40"
    assert tags["ckptflow.partition_link"] == "http://dagster/assets/checkpoint?partition=r@40&run=r&step=40"


def test_the_partition_link_names_the_partition_an_older_instance_holds():
    held = legacy_checkpoint_name("r", 40)
    tags = lineage_tags(version(), partition_link=LINK, partition_key=held)
    assert tags["ckptflow.partition_key"] == held == "r__step-000000000040"
    assert tags["ckptflow.partition_link"] == f"http://dagster/assets/checkpoint?partition={held}&run=r&step=40"
    assert tags["ckptflow.run"] == "r" and tags["ckptflow.step"] == "40"
