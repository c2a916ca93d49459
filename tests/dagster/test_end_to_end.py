"""The whole lifecycle over a store with several checkpoints, in a real (on-disk) instance."""

from dagster import DagsterInstance, materialize
from dagster_helpers import RUN, corrupt_chunk, write_checkpoints

from assets import checkpoint_key
from ckptflow.registry import Registry
from ckptflow.store import open_store
from pipelines.inprocess import Driver, dynamic_keys


def test_lifecycle_end_to_end(paths, defs, tmp_path):
    write_checkpoints(paths["store"], steps=(10, 20, 30, 40, 50))
    corrupt_chunk(paths["store"], RUN, 30)
    keys = [checkpoint_key(RUN, s) for s in (10, 20, 30, 40, 50)]
    home = tmp_path / "dagster_home"
    home.mkdir()
    with DagsterInstance.local_temp(str(home)) as instance:
        driver = Driver(defs, instance)
        report = driver.drive()
        assert report.landed == keys and dynamic_keys(instance) == keys
        assert report.runs[f"validate_checkpoint[{keys[2]}]"] is False  # the blocking check failed
        assert sum(report.runs.values()) == len(report.runs) - 1
        # nothing downstream ran for the corrupt one; everything ran for the others
        assert not any(keys[2] in name for name, ok in report.runs.items() if not name.startswith("validate"))
        for key in keys[:2] + keys[3:]:
            assert any(f"[{key}]" in name and "evaluation" in name for name in report.runs)

        again = driver.drive()  # a second pass has nothing to do
        assert again.landed == [] and again.runs == {}

        assert defs.resolve_job_def("promotion").execute_in_process(
            instance=instance, run_config={"ops": {"deployed_model": {"config": {"stage": "stable"}}}}).success
        result = materialize([*defs.assets], selection=["checkpoint_inventory"], instance=instance,
                             resources=dict(defs.resources))
        df = result.output_for_node("checkpoint_inventory").set_index("step")
        md = result.asset_materializations_for_node("checkpoint_inventory")[0].metadata

    assert list(df.index) == [10, 20, 30, 40, 50]
    assert df.loc[30, "validation"] == "failed" and "does not match its address" in df.loc[30, "problem"]
    assert set(df.drop(index=30)["validation"]) == {"passed"}
    assert df.loc[30, "tiers"] == "hot" and set(df.drop(index=30)["tiers"]) == {"hot,archive"}
    assert df.drop(index=30)["metric.val_loss"].notna().all() and df["metric.train_loss"].notna().all()
    assert (df.drop(index=30)["compression_ratio"] > 1).all()
    assert df.loc[50, "retention"].startswith("keep") and "newest valid" in df.loc[50, "retention"]
    stable = Registry(open_store(paths["store"])).resolve("tinylm", "stable")
    assert "model alias tinylm:latest, tinylm:stable" in df.loc[stable.step, "retention"]
    assert md["checkpoints"].value == 5 and md["validation_failed"].value == 1
    assert md["archive_stored_bytes"].value > 0 and "| run" in md["table"].value
