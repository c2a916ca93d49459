"""A checkpoint partition shows the run's declared lineage: its datasets and training config."""

from __future__ import annotations

from dagster import AssetRecordsFilter, materialize
from torch import nn

from assets import PARTITIONED, checkpoint, checkpoint_key
from ckptflow import Checkpointer, Dataset, RunLineage


def test_the_partition_metadata_shows_the_datasets_and_config(paths, resources, instance):
    lineage = RunLineage(
        config={"lr": 0.1, "arch": "tiny"},
        datasets=[Dataset("s3://corpus/train", version="v3"), Dataset("file:///eval", digest="sha256:abc")],
    )
    with Checkpointer(paths["store"], "lin", lineage=lineage) as ck:
        ck.save(5, {"model": nn.Linear(4, 4)})
    key = checkpoint_key("lin", 5)
    instance.add_dynamic_partitions("checkpoints", [key])
    result = materialize(PARTITIONED, partition_key=key, instance=instance, resources=resources, selection=[checkpoint])
    assert result.success
    [record] = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=checkpoint.key, asset_partitions=[key]), limit=1
    ).records
    md = record.asset_materialization.metadata
    assert md["datasets"].value == "- s3://corpus/train (version v3)\n- file:///eval (digest sha256:abc)"
    assert md["training_config"].value == {"lr": 0.1, "arch": "tiny"}
