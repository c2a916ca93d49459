"""The Dagster side of issue 13: ``archived`` with a lossy archive codec (the copy's
loss and metric change as metadata) and the ``storage_cost`` asset."""

from dagster import materialize

from assets import PARTITIONED, archived, checkpoint_key
from ckptflow.catalog import checkpoints as catalog
from ckptflow.reports.stats import store_stats
from ckptflow.store import open_store
from resources import ArchiveResource
from support.corrupt import chunk_path, manifest_path, only_in
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
    # the metadata's words for an item are its row's (no garbage here: the row adds $0, it saves nothing)
    garbage = df.set_index("item").loc["garbage (unreferenced chunk files, until gc)"]
    assert garbage["against_baseline"] == "adds" and garbage["usd_per_month"] == 0
    assert metadata["saving/garbage"].value == "adds $0.00/month: garbage (unreferenced chunk files, until gc)"


def test_storage_cost_rows_say_what_each_item_is_never_a_negative_saving(
    store_with_checkpoints, defs, resources, instance
):
    """Unreferenced chunk files (a step's manifest gone) and a missing chunk (another
    step's, deleted): the table said "saved by garbage" with -N bytes, the unreferenced
    files netted with the missing chunk, so the row was false whichever way it came out.
    Each is a row of its own now, its size a size, the label saying which way it counts."""
    root = store_with_checkpoints
    chunk_path(root, only_in(root, RUN, 40, 10, 20, 30)[0]).unlink()  # referenced by step 40, absent
    manifest_path(root, RUN, 10).unlink()  # step 10's own chunks: unreferenced files
    stats = store_stats(open_store(root))
    assert stats.unreferenced_bytes > 0 and stats.missing_raw_bytes > 0
    result = materialize([*defs.assets], selection=["storage_cost"], instance=instance, resources=resources)
    df = result.output_for_node("storage_cost").set_index("item")
    saved = df[df.index.str.startswith("saved by")]
    assert len(saved) and (saved["bytes"] >= 0).all() and (saved["usd_per_month"] >= 0).all(), df
    garbage = df.loc["garbage (unreferenced chunk files, until gc)"]
    assert garbage["bytes"] == stats.unreferenced_bytes and garbage["against_baseline"] == "adds"
    missing = df.loc["missing chunks (referenced, absent: lost, not saved)"]
    assert missing["bytes"] == stats.missing_raw_bytes and missing["against_baseline"] == "subtracts"
    # the rows still add up: the baseline, less what each item subtracts, plus what each adds
    sign = df["against_baseline"].map({"subtracts": -1, "adds": 1})
    now = df.loc["every checkpoint raw and hot", "usd_per_month"] + (sign * df["usd_per_month"]).sum()
    tiers = df.loc[[i for i in df.index if i.startswith(("hot (", "archive ("))], "usd_per_month"].sum()
    assert abs(now - tiers) < 1e-12
