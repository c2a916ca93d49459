"""The recovery_metrics asset: checkpoint frequency, time to recovery-ready, recoveries, RPO, RTO."""

import pytest
import torch
from dagster import materialize

from assets import PARTITIONED, checkpoint_key
from ckptflow import Checkpointer, StateMismatchError
from ckptflow.catalog import recovery_log
from pipelines import demo
from support.corrupt import corrupt_chunk
from support.dagster import RUN


def test_recovery_metrics_counts_recoveries_fallbacks_readiness_rpo_and_rto(
    store_with_checkpoints, defs, resources, instance
):
    keys = [checkpoint_key(RUN, s) for s in (10, 20)]
    instance.add_dynamic_partitions("checkpoints", keys)
    for key in keys:  # validation makes these two recovery-ready
        materialize(
            PARTITIONED,
            partition_key=key,
            instance=instance,
            resources=resources,
            selection=["checkpoint"],
            raise_on_error=False,
        )
    corrupt_chunk(store_with_checkpoints, RUN, 40)
    with Checkpointer(store_with_checkpoints, RUN) as ck:
        assert ck.restore(demo.build()).step == 30  # one recovery, with a fallback past step 40
        with pytest.raises(StateMismatchError):  # the caller's error: rejected, not a failed recovery
            ck.restore({"w": torch.zeros(3)})
        infos = {i.step: i for i in ck.list()}
        restore_s = recovery_log.read_all(ck.store, RUN)[0]["duration_s"]

    run_config = {"ops": {"recovery_metrics": {"config": {"detection": "30s"}}}}
    result = materialize(
        [*defs.assets], selection=["recovery_metrics"], instance=instance, resources=resources, run_config=run_config
    )
    df = result.output_for_node("recovery_metrics")
    row = df.set_index("run").loc[RUN]
    assert (row.checkpoints, row.checkpoints_in_window, row.recoveries, row.recoveries_ok, row.fallbacks) == (
        4,
        4,
        1,
        1,
        1,
    )
    assert row.save_interval_s >= 0 and row.ready_s >= 0
    metadata = result.asset_materializations_for_node("recovery_metrics")[0].metadata
    assert metadata["recoveries"].value == 1 and metadata["recovery_success_rate"].value == 1.0
    assert metadata["fallbacks"].value == 1 and metadata["ready_s"].value >= 0
    assert metadata["recoveries_rejected"].value == 1 and row.rejected == 1
    assert "rejected restores" in metadata["table"].value
    # RPO: only 10 and 20 are recovery-ready, so the gap is theirs; 30 and 40 were never validated
    assert metadata["rpo_s"].value == pytest.approx(infos[20].created_at - infos[10].created_at, rel=1e-3, abs=1e-3)
    assert metadata["rto_median_s"].value == pytest.approx(30 + restore_s, rel=1e-3)
    assert metadata["hot_stored_bytes"].value > 0 and metadata["hot_stored"].value.endswith("iB")
    assert metadata[f"{RUN}/checkpoints_in_window"].value == 4 and "| run" in metadata["table"].value
    # the RPO reads as a duration with its target beside it (CKPTFLOW_RPO_TARGET, default 1h)
    assert metadata["rpo_target_s"].value == 3600.0
    rpo = metadata["rpo"].value
    assert rpo.endswith(" (target 60.0 min: met)"), rpo
    # the text is the RPO to 3 digits, rpo_s the same RPO rounded for plotting: 803.5 ms reads 803 in one
    # and 804 in the other, so the two agree within the text's last digit
    shown, unit = rpo.removesuffix(" (target 60.0 min: met)").split()
    per_unit = {"µs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}[unit]
    assert float(shown) * per_unit == pytest.approx(metadata["rpo_s"].value, rel=5e-3)
    assert "(target 60.0 min: met)" in metadata["table"].value


def test_rpo_freshness_check_warns_when_no_checkpoint_became_recovery_ready_within_the_target(
    store_with_checkpoints, defs, resources, instance, monkeypatch
):
    from dagster import AssetCheckSeverity, AssetSelection

    from assets import RPO_FRESHNESS_KEY

    def check(target: str):
        monkeypatch.setenv("CKPTFLOW_RPO_TARGET", target)
        result = materialize(
            [*defs.assets, *defs.asset_checks],
            selection=AssetSelection.checks(RPO_FRESHNESS_KEY),
            instance=instance,
            resources=resources,
        )
        [evaluation] = result.get_asset_check_evaluations()
        return evaluation

    none_ready = check("1h")  # nothing validated yet: nothing to recover to
    assert not none_ready.passed and none_ready.severity == AssetCheckSeverity.WARN
    instance.add_dynamic_partitions("checkpoints", [checkpoint_key(RUN, 40)])
    materialize(
        PARTITIONED,
        partition_key=checkpoint_key(RUN, 40),
        instance=instance,
        resources=resources,
        selection=["checkpoint"],
    )
    fresh = check("1h")
    assert fresh.passed and fresh.metadata["newest_recovery_ready_run"].value == RUN
    stale = check("0s")
    assert not stale.passed and stale.metadata["age_s"].value > 0 and stale.metadata["rpo_target"].value == "0.0 s"
