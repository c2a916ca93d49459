"""The Dagster side of issue 13: ``archived`` with a lossy archive codec (the copy's
loss and metric change as metadata) and the ``storage_cost`` asset."""

from dagster import materialize

from assets import PARTITIONED, archived, checkpoint_key
from ckptflow.catalog import checkpoints as catalog
from ckptflow.store import open_store
from resources import ArchiveResource
from support.dagster import RUN, record


def test_a_lossy_archive_codec_records_the_loss_and_the_metric_change(
    store_with_checkpoints, paths, resources, instance
):
    key = checkpoint_key(RUN, 20)
    instance.add_dynamic_partitions("checkpoints", [key])
    lossy = {**resources, "archive": ArchiveResource(url=paths["archive"], archive_codec="bf16+int8")}
    result = materialize(PARTITIONED, partition_key=key, instance=instance, resources=lossy)
    assert result.success
    metadata = next(m for m in result.get_asset_materialization_events() if m.asset_key == archived.key)
    values = metadata.materialization.metadata
    assert values["archive_copy"].value == "lossy" and values["archive_codec"].value == "weights=bf16,optimizer=int8"
    assert "metric_change/val_loss" in values
    copy = catalog.read_manifest(open_store(paths["archive"]), RUN, 20)
    assert copy.lossy["source_digest"] == record(paths["store"], 20, "archive")["manifest_digest"]
    evaluation = record(paths["store"], 20, "archive")["evaluation"]
    assert evaluation["metric_change"]["val_loss"] == values["metric_change/val_loss"].value


def test_storage_cost_prices_each_tier_and_the_savings(store_with_checkpoints, defs, resources, instance):
    result = materialize([*defs.assets], selection=["storage_cost"], instance=instance, resources=resources)
    df = result.output_for_node("storage_cost")
    metadata = result.asset_materializations_for_node("storage_cost")[0].metadata
    # no ">= monthly": this raw store saves nothing, and each chunk's header costs 14 bytes
    assert metadata["hot_monthly_usd"].value > 0 and metadata["baseline_usd"].value > 0
    saved = sum(v.value for k, v in metadata.items() if k.startswith("saved_usd/"))
    assert abs(metadata["baseline_usd"].value - saved - metadata["monthly_usd"].value) < 1e-12
    assert "saved by dedup" in set(df["item"]) and "hot (STANDARD)" in set(df["item"])
