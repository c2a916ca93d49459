"""The recovery_metrics asset: checkpoint frequency, time to recovery-ready, recoveries."""

from dagster import materialize

from assets import PARTITIONED, checkpoint_key, integrity
from ckptflow import Checkpointer
from pipelines import demo
from support.corrupt import corrupt_chunk
from support.dagster import RUN


def test_recovery_metrics_counts_recoveries_fallbacks_and_readiness(store_with_checkpoints, defs, resources, instance):
    keys = [checkpoint_key(RUN, s) for s in (10, 20)]
    instance.add_dynamic_partitions("checkpoints", keys)
    for key in keys:  # validation makes these two recovery-ready
        materialize(
            [*PARTITIONED, integrity],
            partition_key=key,
            instance=instance,
            resources=resources,
            selection=["checkpoint"],
            raise_on_error=False,
        )
    corrupt_chunk(store_with_checkpoints, RUN, 40)
    with Checkpointer(store_with_checkpoints, RUN) as ck:
        assert ck.restore(demo.build()).step == 30  # one recovery, with a fallback past step 40

    result = materialize([*defs.assets], selection=["recovery_metrics"], instance=instance, resources=resources)
    df = result.output_for_node("recovery_metrics")
    row = df.set_index("run").loc[RUN]
    assert (row.checkpoints, row.recoveries, row.recoveries_ok, row.fallbacks) == (4, 1, 1, 1)
    assert row.save_interval_s >= 0 and row.ready_s >= 0
    metadata = result.asset_materializations_for_node("recovery_metrics")[0].metadata
    assert metadata["recoveries"].value == 1 and metadata["recovery_success_rate"].value == 1.0
    assert metadata["fallbacks"].value == 1 and "median_ready_s" in metadata
