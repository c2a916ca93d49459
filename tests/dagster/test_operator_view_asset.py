"""The operator's view in the Dagster layer (issue 24): ``recoverability`` answers "is
training recoverable right now?", one price per tier across the reports, a corrupt
partition's reason in short fields, the trainer's loss beside the evaluator's, and the
short ``checkpoint`` run tag."""

import json

import pytest
from dagster import AssetRecordsFilter, materialize

from assets import PARTITIONED, checkpoint, checkpoint_key, evaluation
from assets.partitions import CHECKPOINT_TAG
from support.corrupt import corrupt_chunk
from support.dagster import RUN

KEYS = [checkpoint_key(RUN, s) for s in (10, 20, 30, 40)]
VIEWS = ["checkpoint_inventory", "storage_cost", "recoverability"]


def test_the_operator_view_counts_what_needs_attention_and_prices_tiers_once(
    store_with_checkpoints, defs, resources, instance
):
    instance.add_dynamic_partitions("checkpoints", KEYS)
    corrupt_chunk(store_with_checkpoints, RUN, 30)
    runs = {
        key: materialize(PARTITIONED, partition_key=key, instance=instance, resources=resources, raise_on_error=False)
        for key in KEYS[:3]
    }
    assert runs[KEYS[0]].success and runs[KEYS[1]].success and not runs[KEYS[2]].success

    # the corrupt partition: the reason in one-line fields, on the failure and on an observation of the partition
    [failure] = [e for e in runs[KEYS[2]].all_events if e.is_step_failure]
    data = failure.step_failure_data.user_failure_data
    assert data.metadata["failed_check"].value == "integrity: chunk hash"
    assert data.metadata["chunk"].value.endswith("…") and "\n" not in data.metadata["reason"].value
    [observed] = instance.fetch_observations(
        AssetRecordsFilter(asset_key=checkpoint.key, asset_partitions=[KEYS[2]]), limit=1
    ).records
    assert observed.asset_observation.metadata["reason"].value == data.metadata["reason"].value
    [check] = runs[KEYS[2]].get_asset_check_evaluations()
    assert check.description.startswith(f"{RUN} step 30 needs attention: chunk hash: chunk ")
    # per-run keys: the check's plots never join two runs into one line
    [good] = runs[KEYS[0]].get_asset_check_evaluations()
    assert f"{RUN}/chunks" in good.metadata and "chunks_checked" not in good.metadata

    # every per-checkpoint run carries the checkpoint's short name as a tag: its partition key
    for step, (key, result) in zip((10, 20, 30), runs.items()):
        assert instance.get_run_by_id(result.run_id).tags[CHECKPOINT_TAG] == key == f"{RUN}@{step}"

    # the evaluator scores held-out data; the trainer's loss stands beside it
    evaluated = (
        instance.fetch_materializations(
            AssetRecordsFilter(asset_key=evaluation.key, asset_partitions=[KEYS[1]]), limit=1
        )
        .records[0]
        .asset_materialization.metadata
    )
    assert evaluated[f"{RUN}/train_loss"].value > 0 and evaluated[f"{RUN}/val_loss"].value > 0

    views = materialize([*defs.assets], selection=VIEWS, instance=instance, resources=resources)
    md = {name: views.asset_materializations_for_node(name)[0].metadata for name in VIEWS}
    assert md["storage_cost"]["archive_monthly_usd"].value > 0
    for tier in ("hot", "archive"):  # one source of truth: the same figure in all three
        figures = {name: md[name][f"{tier}_monthly_usd"].value for name in VIEWS}
        assert len(set(figures.values())) == 1, (tier, figures)
        assert len({md[name][f"{tier}_cost"].value for name in VIEWS}) == 1

    view = md["recoverability"]
    assert view["attention"].value == "1 of 4 checkpoints need attention"
    assert view["recoverable"].value.startswith("yes: every run (1) has a recovery-ready checkpoint")
    assert "chunk hash: chunk " in view["needing_attention"].value
    [row] = view["status"].value.records
    assert row.data["newest ready"] == "step 20" and row.data["tier"] == "hot+archive"
    assert row.data["attention"] == "1 of 4 need attention" and row.data["RPO (target)"].endswith("met)")
    assert view[f"{RUN}/attention"].value == 1 and view["checkpoints_needing_attention"].value == 1


def test_a_configured_price_list_is_the_one_every_view_prices_with(store_with_checkpoints, defs, resources, instance):
    from resources import PricingResource

    instance.add_dynamic_partitions("checkpoints", KEYS[:2])
    for key in KEYS[:2]:
        assert materialize(PARTITIONED, partition_key=key, instance=instance, resources=resources).success
    figures: dict[str, dict[str, float]] = {}
    for label, pricing in (
        ("defaults", PricingResource()),
        ("on-prem", PricingResource(prices={"ONPREM": 0.5}, hot_class="ONPREM")),
    ):
        views = materialize(
            [*defs.assets], selection=VIEWS, instance=instance, resources={**resources, "pricing": pricing}
        )
        md = {name: views.asset_materializations_for_node(name)[0].metadata for name in VIEWS}
        assert len({md[name]["hot_monthly_usd"].value for name in VIEWS}) == 1, (label, md)
        figures[label] = {tier: md["recoverability"][f"{tier}_monthly_usd"].value for tier in ("hot", "archive")}
    assert figures["on-prem"]["hot"] > figures["defaults"]["hot"] > 0
    assert figures["on-prem"]["hot"] / figures["defaults"]["hot"] == pytest.approx(0.5 / 0.023)
    assert figures["on-prem"]["archive"] == figures["defaults"]["archive"]  # the archive's class kept its price


def test_the_price_list_comes_from_the_file_ckptflow_prices_names(tmp_path, monkeypatch):
    from ckptflow.errors import CkptflowError
    from resources import PricingResource

    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"prices": {"ONPREM": 0.01}, "tiers": {"hot": "ONPREM"}}))
    monkeypatch.setenv("CKPTFLOW_PRICES", str(prices))
    pricing = PricingResource.from_env()
    assert pricing.hot_class == "ONPREM" and pricing.prices["ONPREM"] == 0.01 and pricing.archive_class == "GLACIER_IR"
    prices.write_text(json.dumps({"tiers": {"hot": "PLATINUM"}}))
    with pytest.raises(CkptflowError, match="CKPTFLOW_PRICES=.*PLATINUM.*name a JSON file"):
        PricingResource.from_env()
    monkeypatch.delenv("CKPTFLOW_PRICES")
    assert PricingResource.from_env() == PricingResource()
