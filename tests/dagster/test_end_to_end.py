"""The whole lifecycle over a store with several checkpoints, in a real (on-disk) instance,
with the archive tier in a local directory and then on the moto S3 server (dagster-aws
``S3Resource`` -> ckptflow's S3 backend, objects in GLACIER_IR)."""

import json
from datetime import datetime, timedelta, timezone

import pytest
import torch
from dagster import DagsterInstance, materialize

from assets import checkpoint_key
from assets.partitions import in_step_order
from ckptflow import Checkpointer
from ckptflow.catalog import checkpoints as catalog
from ckptflow.format import layout as fmt
from ckptflow.interop.registry import Registry
from ckptflow.store import open_store
from pipelines import demo
from pipelines.inprocess import Driver, dynamic_keys
from resources import ArchiveResource, S3ArchiveResource
from support.corrupt import corrupt_chunk
from support.dagster import EVALUATORS, RUN, write_checkpoints
from support.dagster import record as read


# the S3 archive runs in `make test-e2e`: each variant takes 15-25 s of Dagster's automation
# evaluation, and the S3 archive's own tests (test_s3_archive, tests/lifecycle) run in `make test`
@pytest.fixture(params=[pytest.param("local", marks=pytest.mark.slow), pytest.param("s3", marks=pytest.mark.slow)])
def archive_defs(request, paths, monkeypatch):
    """Definitions as `dagster dev` would load them, archive chosen by ``CKPTFLOW_ARCHIVE``."""
    monkeypatch.setenv("CKPTFLOW_STORE", paths["store"])
    monkeypatch.setenv("CKPTFLOW_EVALUATORS", json.dumps(EVALUATORS))
    if request.param == "local":
        monkeypatch.setenv("CKPTFLOW_ARCHIVE", paths["archive"])
    else:
        endpoint, bucket = request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket")
        monkeypatch.setenv("CKPTFLOW_ARCHIVE", f"s3://{bucket}/archive")
        monkeypatch.setenv("CKPTFLOW_S3_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("CKPTFLOW_ARCHIVE_STORAGE_CLASS", "GLACIER_IR")
    from pipelines.definitions import build_definitions

    return request.param, build_definitions("local")


def test_lifecycle_end_to_end(paths, archive_defs, tmp_path, monkeypatch):
    kind, defs = archive_defs
    archive_resource = defs.resources["archive"]
    assert isinstance(archive_resource, S3ArchiveResource if kind == "s3" else ArchiveResource)
    archive = archive_resource.open()
    write_checkpoints(paths["store"], steps=(10, 20, 30, 40, 50))
    corrupt_chunk(paths["store"], RUN, 30)
    keys = [checkpoint_key(RUN, s) for s in (10, 20, 30, 40, 50)]
    home = tmp_path / "dagster_home"
    home.mkdir()
    with DagsterInstance.local_temp(str(home)) as instance:
        now = [datetime.now(timezone.utc)]  # the automation's clock: a cron tick passes only when the test moves it
        driver = Driver(defs, instance, clock=lambda: now[0])
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
        now[0] += timedelta(minutes=10)  # a */10 cron tick passes: the summaries refresh, nothing else
        refreshed = driver.drive()
        summaries = "checkpoint_advice,checkpoint_inventory,recoverability,recovery_metrics,retention_plan,storage_cost"
        assert refreshed.landed == [] and refreshed.runs == {f"{summaries}[None]": True}

        assert (
            defs.resolve_job_def("promotion")
            .execute_in_process(
                instance=instance, run_config={"ops": {"deployed_model": {"config": {"stage": "stable"}}}}
            )
            .success
        )
        result = materialize(
            [*defs.assets], selection=["checkpoint_inventory"], instance=instance, resources=dict(defs.resources)
        )
        df = result.output_for_node("checkpoint_inventory").set_index("step")
        md = result.asset_materializations_for_node("checkpoint_inventory")[0].metadata

    assert list(df.index) == [10, 20, 30, 40, 50]
    recover_to = md["recover_to"].value.splitlines()  # per run: latest, validated, best
    assert [c.strip() for c in recover_to[0].split("|")[1:5]] == ["run", "latest", "validated", "best"]
    assert [c.strip() for c in recover_to[2].split("|")[2:4]] == ["50", "50"]
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
    if kind == "s3":
        client = archive.client
        listed = client.list_objects_v2(Bucket=archive.bucket, Prefix="archive/")["Contents"]
        assert listed and {o["StorageClass"] for o in listed} == {"GLACIER_IR"}
    for step in (10, 20, 40, 50):
        assert catalog.verify_checkpoint(archive, RUN, step).ok
        record = read(paths["store"], step, "archive")
        assert record["ok"] and record["url"] == archive.url and record["verified_by"] == "re-read"
        assert record["chunks_verified"] == len(catalog.read_manifest(archive, RUN, step).chunks)
    policy = tmp_path / "retention.json"  # the deployment's policy (the retention resource)
    policy.write_text(json.dumps({"recent_days": 0, "full_days": 0, "best_k": 1, "gc_grace": "0s", "hot_days": 0}))
    monkeypatch.setenv("CKPTFLOW_RETENTION", str(policy))
    from pipelines.definitions import build_definitions

    tiered_retention(build_definitions("local"), paths, archive, home)


def tiered_retention(defs, paths, archive, home):
    """Retention with ``hot_days=0``: archived checkpoints keep only their archive copy
    (the newest valid one stays hot), the corrupt unarchived one goes entirely; hot GC
    leaves the archive whole, and an expired hot copy's checkpoint restores from it exactly."""
    hot = open_store(paths["store"])
    expected = demo.build()
    with Checkpointer(hot, RUN) as ck:
        ck.restore(expected, step=40)
    with DagsterInstance.local_temp(str(home)) as instance:
        result = defs.resolve_job_def("retention_job").execute_in_process(instance=instance)
        assert result.success
        out = result.output_for_node("apply_retention")
        partitions = set(dynamic_keys(instance))
        # an archive-only partition still re-materializes (e.g. a backfill with a new evaluator): data from the archive
        again = materialize(
            [*defs.assets, *defs.asset_checks],
            instance=instance,
            resources=dict(defs.resources),
            partition_key=checkpoint_key(RUN, 40),
            selection=["checkpoint", "evaluation", "compressed"],
        )
        assert again.success
        assert again.asset_materializations_for_node("checkpoint")[0].metadata["tier"].value == archive.url
        check = again.get_asset_check_evaluations()[0]
        assert check.passed and check.metadata["tier"].value == archive.url
    assert out["expired"] == [checkpoint_key(RUN, 30)] and out["left_hot"] == []
    assert in_step_order(out["hot_copies_expired"]) == [checkpoint_key(RUN, s) for s in (10, 20, 40)]
    assert partitions == {checkpoint_key(RUN, s) for s in (10, 20, 40, 50)}  # still exist, in the archive
    assert [i.step for i in catalog.list_checkpoints(hot, RUN)] == [50] and out["gc_bytes"] > 0
    for step in (10, 20, 40, 50):
        assert catalog.verify_checkpoint(archive, RUN, step).ok
    state = demo.build()
    with Checkpointer(hot, RUN, tiers=[archive]) as ck:
        result = ck.restore(state, step=40)
        assert result.tier == archive.url
        assert ck.restore(demo.build()).step == 50
    for name, tensor in expected["model"].state_dict().items():
        assert torch.equal(state["model"].state_dict()[name], tensor), name
    for step in (10, 20, 40):
        assert not hot.exists(fmt.manifest_key(RUN, step))
