"""Promotion, alias moves and rollback; retention; scrub; the run-failure sensor."""

import os

import pytest
import torch
from dagster import DagsterEventType, build_sensor_context, materialize
from safetensors.torch import load_file

from assets import PARTITIONED, checkpoint, checkpoint_key, evaluation
from assets.partitions import in_step_order, parse_checkpoint_key
from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.gc import gc
from ckptflow.chunks import damaged
from ckptflow.format import layout as fmt
from ckptflow.interop.registry import Registry
from ckptflow.store import open_store
from pipelines import demo
from sensors import failure_sensor
from sensors.failures import FAILURE_TAG
from support.corrupt import corrupt_chunk, only_in, reseal_manifest
from support.dagster import RUN, record, scrub_all, subject

KEYS = [checkpoint_key(RUN, s) for s in (10, 20, 30, 40)]


def evaluate_all(instance, resources, keys=KEYS):
    instance.add_dynamic_partitions("checkpoints", keys)
    for key in keys:
        materialize(
            PARTITIONED,
            partition_key=key,
            instance=instance,
            resources=resources,
            selection=[checkpoint, evaluation],
            raise_on_error=False,
        )


def deploy(defs, instance, job="promotion", **config):
    run_config = {
        "ops": {"deployed_model": {"config": {"action": "promote" if job == "promotion" else "rollback", **config}}}
    }
    return defs.resolve_job_def(job).execute_in_process(instance=instance, run_config=run_config, raise_on_error=False)


def test_promotion_alias_moves_and_rollback_with_lineage(
    store_with_checkpoints, defs, resources, instance, paths, tmp_path
):
    evaluate_all(instance, resources)
    store = open_store(paths["store"])
    best = min(KEYS, key=lambda k: record(store, parse_checkpoint_key(k)[1], "evaluation")["metrics"]["val_loss"])

    first = deploy(defs, instance, stage="stable", partition_key=KEYS[0])
    assert first.success
    md = first.asset_materializations_for_node("deployed_model")[0].metadata
    assert md["source_partition"].value == KEYS[0] and md["alias/stable"].value == 1 and md["alias/latest"].value == 1
    manifest = catalog.read_manifest(store, RUN, 10)
    digest = manifest.digest
    assert md["manifest_digest"].value == digest
    assert md["training_config"].value["world_size"] == manifest.world_size
    assert (md["stable"].value, md["fallback"].value) == (f"v1 from {KEYS[0]} (manifest {digest[:12]}…)", "not set")

    second = deploy(defs, instance, stage="stable", dtype="bf16")  # best by val_loss
    assert second.success
    reg = Registry(store)
    v2 = reg.get("tinylm", 2)
    assert v2.partition_key == best and v2.dtype == "bf16" and v2.lineage["evaluation"]["metrics"]["val_loss"] > 0
    assert reg.aliases("tinylm") == {"latest": 2, "stable": 2, "fallback": 1}
    md = second.asset_materializations_for_node("deployed_model")[0].metadata
    for alias, version in (("latest", 2), ("stable", 2), ("fallback", 1)):  # all three, with their sources
        assert md[f"alias/{alias}"].value == version
        assert md[f"alias/{alias}/source_partition"].value == reg.get("tinylm", version).partition_key
        assert md[alias].value.startswith(f"v{version} from {reg.get('tinylm', version).partition_key}")
    reg.download(v2, tmp_path / "v2")
    tensors = load_file(str(tmp_path / "v2" / "model.safetensors"))
    assert tensors["head.weight"].dtype == torch.bfloat16

    # int8 needs a config.json declaring it, and TinyLM records no model config: refused, nothing moves
    refused = deploy(defs, instance, stage="latest", partition_key=KEYS[3], dtype="int8")
    assert not refused.success
    [failure] = [e for e in refused.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    assert "records no model config" in str(failure.event_specific_data.error.message)
    assert reg.aliases("tinylm") == {"latest": 2, "stable": 2, "fallback": 1}
    assert deploy(defs, instance, stage="latest", partition_key=KEYS[3], dtype="fp16").success
    assert reg.aliases("tinylm") == {"latest": 3, "stable": 2, "fallback": 1}
    reg.download(reg.get("tinylm", 3), tmp_path / "v3")
    assert load_file(str(tmp_path / "v3" / "model.safetensors"))["head.weight"].dtype == torch.float16

    rolled = deploy(defs, instance, job="rollback")
    assert rolled.success
    assert reg.aliases("tinylm") == {"latest": 3, "stable": 1, "fallback": 2}
    md = rolled.asset_materializations_for_node("deployed_model")[0].metadata
    assert md["action"].value == "rollback" and md["source_partition"].value == KEYS[0]
    assert md["alias/fallback/source_partition"].value == best and md["alias/stable"].value == 1


def test_a_bad_promotion_config_fails_the_job_before_anything_is_written(store_with_checkpoints, defs, instance):
    for bad in ({"stage": "production"}, {"dtype": "int4"}, {"mode": "best"}):
        result = deploy(defs, instance, partition_key=KEYS[0], **bad)
        assert not result.success
        [failure] = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
        assert "before anything was written" in str(failure.event_specific_data.error.message)
    store = open_store(store_with_checkpoints)
    assert Registry(store).models() == [] and not list(store.list("registry/"))


def test_promotion_refuses_a_corrupt_checkpoint(store_with_checkpoints, defs, resources, instance):
    corrupt_chunk(store_with_checkpoints, RUN, 30)
    evaluate_all(instance, resources)
    result = deploy(defs, instance, partition_key=KEYS[2])
    assert not result.success
    assert Registry(open_store(store_with_checkpoints)).models() == []


def test_retention_job_expires_checkpoints_partitions_and_gcs(
    store_with_checkpoints, defs, defs_with_retention, resources, instance, paths
):
    evaluate_all(instance, resources)
    assert deploy(defs, instance, stage="stable", partition_key=KEYS[0]).success  # published: kept forever
    store = open_store(paths["store"])
    chunks_before = len(list(store.list("chunks/")))
    defs = defs_with_retention(recent_days=0, full_days=0, best_k=1, gc_grace="0s")
    views = materialize(
        [*defs.assets],
        selection=["retention_plan", "checkpoint_inventory"],
        instance=instance,
        resources=dict(defs.resources),
    )
    df = views.output_for_node("retention_plan")
    assert set(df[df.action == "keep"].step) >= {10, 40}
    doomed = set(df[df.action == "delete"].step)
    assert doomed  # the policy deletes something, and the inventory says so of the same checkpoints
    rows = views.output_for_node("checkpoint_inventory")
    assert set(rows[rows.retention.str.startswith("delete")].step) == doomed

    result = defs.resolve_job_def("retention_job").execute_in_process(instance=instance)
    assert result.success
    out = result.output_for_node("apply_retention")
    kept = {s for s in (10, 20, 30, 40) if store.exists(fmt.manifest_key(RUN, s))}
    assert {10, 40} <= kept and len(kept) < 4  # published + newest kept; best-1 may add one
    assert in_step_order(out["expired"]) == [checkpoint_key(RUN, s) for s in (10, 20, 30, 40) if s not in kept]
    logged = [e.user_message for e in instance.all_logs(result.run_id) if e.user_message.startswith("expired ")]
    assert logged == [
        f"expired {len(out['expired'])} checkpoint(s) and dropped their partitions: "
        + (out["expired"][0] if len(out["expired"]) == 1 else f"{out['expired'][0]} .. {out['expired'][-1]}")
    ]  # one line per batch, not per checkpoint
    assert set(instance.get_dynamic_partitions("checkpoints")) == {checkpoint_key(RUN, s) for s in kept}
    assert out["gc_bytes"] > 0 and len(list(store.list("chunks/"))) < chunks_before
    for step in kept:
        assert catalog.verify_checkpoint(store, RUN, step).ok
    assert not list(store.list(f"lifecycle/{RUN}/{parse_checkpoint_key(out['expired'][0])[1]:012d}/"))


def test_scrub_records_verdicts_and_fails_on_corruption(store_with_checkpoints, defs, instance):
    assert scrub_all(defs, instance).success
    rotten = corrupt_chunk(store_with_checkpoints, RUN, 20)
    result = scrub_all(defs, instance, raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    assert failure.step_failure_data.user_failure_data.metadata["hot_damaged_chunks"].value == 1
    store = open_store(store_with_checkpoints)
    assert record(store, 20, "validation")["ok"] is False
    assert record(store, 10, "validation")["ok"] is True
    assert set(damaged.records(store)) == {rotten}  # the training job's next save writes it anew


def test_scrub_repairs_a_damaged_chunk_from_the_archive_copy_and_passes(store_with_checkpoints, defs, paths, instance):
    store, archive_tier = open_store(store_with_checkpoints), open_store(paths["archive"])
    assert lifecycle.archive(store, archive_tier, RUN, 20).ok
    rotten = corrupt_chunk(store_with_checkpoints, RUN, 20)
    result = scrub_all(defs, instance)
    assert result.success
    [materialized] = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_OUTPUT]
    metadata = materialized.event_specific_data.metadata
    assert metadata["hot_repaired_by_copy"].value == 1 and metadata["hot_chunks_repaired"].value == 1
    assert metadata["corrupt"].value == 0
    assert record(store, 20, "validation")["ok"] is True  # validated again after the repair
    assert rotten not in damaged.records(store) and catalog.verify_checkpoint(store, RUN, 20).ok


def test_scrub_verifies_what_only_the_archive_holds_and_fails_on_its_rot(store_with_checkpoints, defs, paths, instance):
    """Step 20 archived and its hot copy expired: the archive's copy is its only one, so
    the nightly scrub verifies it there (the verdict in the hot store) and fails on its
    rot; the archive copy of 10, which the hot tier still holds, is scrubbed in hot."""
    hot, arc = open_store(store_with_checkpoints), open_store(paths["archive"])
    for step in (10, 20):
        assert lifecycle.archive(hot, arc, RUN, step).ok
    only_20 = only_in(store_with_checkpoints, RUN, 20, 10, 30, 40)[0]
    lifecycle.expire(hot, RUN, 20, keep_records=True)
    gc(hot, grace=0)  # no sound copy of its own chunks is left in hot
    sound = scrub_all(defs, instance)
    verdict = lifecycle.Subject(RUN, 20, catalog.read_manifest(arc, RUN, 20).digest)
    assert lifecycle.read_record(hot, verdict, "validation")["tier"] == arc.url
    rotten = corrupt_chunk(paths["archive"], RUN, 20, only_20)
    result = scrub_all(defs, instance, raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    data = failure.step_failure_data.user_failure_data
    assert f"{checkpoint_key(RUN, 20)} (archive): chunk" in data.metadata["corrupt"].value
    assert data.metadata["archive_damaged_chunks"].value == 1 and rotten in damaged.records(arc)
    assert lifecycle.read_record(hot, verdict, "validation")["ok"] is False
    assert not any(lifecycle.read_record(hot, subject(hot, s), "validation")["tier"] == arc.url for s in (10, 30, 40))
    [output] = [e for e in sound.all_events if e.event_type == DagsterEventType.STEP_OUTPUT]
    metadata = output.event_specific_data.metadata
    assert (metadata["hot_checked"].value, metadata["archive_checked"].value, metadata["corrupt"].value) == (3, 1, 0)


def test_scrub_fails_without_retries_on_a_checkpoint_a_newer_ckptflow_wrote(store_with_checkpoints, defs, instance):
    """Not an outage (waiting will not read it) and not damage (no failed verdict): upgrade.
    A damaged chunk only that checkpoint lists is left for later, not called GC's to delete."""
    store = open_store(store_with_checkpoints)
    rotten = only_in(store_with_checkpoints, RUN, 20, 10, 30, 40)[0]
    damaged.note(store, rotten, "found by a reader")
    reseal_manifest(store_with_checkpoints, RUN, 20, lambda r: r.update(format_version=max(fmt.READABLE_FORMATS) + 1))
    result = scrub_all(defs, instance, raise_on_error=False)
    assert not result.success
    assert not [e for e in result.all_events if e.event_type == DagsterEventType.STEP_UP_FOR_RETRY]
    (failure,) = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    data = failure.step_failure_data.user_failure_data
    assert (
        "1 checkpoint(s)" in data.description and "newer ckptflow" in data.description and "upgrade" in data.description
    )
    assert f"{RUN} step 20" in data.metadata["newer_format"].value
    assert record(store, 10, "validation")["ok"] is True  # the others were scrubbed
    logs = [e.user_message for e in instance.all_logs(result.run_id)]
    assert any("1 damaged hot chunk(s) not repaired yet: a checkpoint that may list them" in m for m in logs)
    assert rotten in damaged.records(store)


def test_failure_sensor_records_runs_that_failed_before_it_started_and_tags_them(
    store_with_checkpoints, resources, instance
):
    from resources import EvaluatorResource

    instance.add_dynamic_partitions("checkpoints", KEYS[:2])
    corrupt_chunk(store_with_checkpoints, RUN, 20)
    broken = {**resources, "evaluator": EvaluatorResource(evaluators={RUN: "no.such.module:evaluate"})}
    failed = [
        materialize(
            PARTITIONED,
            partition_key=key,
            instance=instance,
            resources=broken,
            selection=selection,
            raise_on_error=False,
        )
        for key, selection in ((KEYS[0], [checkpoint, evaluation]), (KEYS[1], [checkpoint]))
    ]
    assert not any(r.success for r in failed)

    def tick(cursor):
        with build_sensor_context(instance=instance, cursor=cursor, resources={"store": resources["store"]}) as context:
            failure_sensor(context)
            return context.cursor

    cursor = tick(None)  # its first tick: both runs failed before it existed
    evaluation_failure = record(store_with_checkpoints, 10, "failure")
    assert evaluation_failure["run_id"] == failed[0].run_id and evaluation_failure["steps"] == ["evaluation"]
    assert "evaluator no.such.module:evaluate failed" in evaluation_failure["message"]
    integrity_failure = record(store_with_checkpoints, 20, "failure")
    assert integrity_failure["message"].startswith(f"checkpoint: integrity check blocked {KEYS[1]}: chunk")
    tags = instance.get_run_by_id(failed[1].run_id).tags
    assert tags[FAILURE_TAG].startswith(f"checkpoint: integrity check blocked {KEYS[1]}")
    digest = subject(store_with_checkpoints, 10).digest
    os.remove(os.path.join(store_with_checkpoints, "lifecycle", RUN, "000000000010", digest, "failure.json"))
    assert tick(cursor) == cursor and record(store_with_checkpoints, 10, "failure") is None  # each run once


@pytest.mark.parametrize("action", ["nonsense"])
def test_bad_deploy_action_fails(defs, instance, action, store_with_checkpoints):
    run_config = {"ops": {"deployed_model": {"config": {"action": action}}}}
    assert (
        not defs.resolve_job_def("promotion")
        .execute_in_process(instance=instance, run_config=run_config, raise_on_error=False)
        .success
    )


@pytest.mark.parametrize("archive_partitions", [10_000, 0])
def test_retention_job_expires_only_hot_copies_of_verified_archived_checkpoints(
    store_with_checkpoints, defs_with_retention, instance, paths, archive_partitions
):
    """10: archived and verified -> only its hot copy goes (records stay; its partition
    too unless ``archive_partitions`` archive-only checkpoints newer than it keep theirs);
    20: pinned, archive-only by ``hot_days`` but archived somewhere else -> stays hot;
    30: not archived -> gone entirely; 40: newest valid -> hot."""
    hot, arc = open_store(paths["store"]), open_store(paths["archive"])
    instance.add_dynamic_partitions("checkpoints", KEYS)
    for step in (10, 20):
        assert lifecycle.archive(hot, arc, RUN, step).ok
    lifecycle.write_record(hot, subject(hot, 10), "archive", {"url": arc.url, "ok": True})
    lifecycle.write_record(hot, subject(hot, 20), "archive", {"url": "s3://elsewhere/ckpts", "ok": True})
    archived_chunks = {i.key for i in arc.list("chunks/")}
    first = subject(hot, 10)
    defs = defs_with_retention(
        recent_days=0, full_days=0, best_k=0, gc_grace="0s", hot_days=0, pinned=[KEYS[1]],
        archive_partitions=archive_partitions,
    )  # fmt: skip
    result = defs.resolve_job_def("retention_job").execute_in_process(instance=instance)
    out = result.output_for_node("apply_retention")
    assert out["hot_copies_expired"] == [KEYS[0]] and out["left_hot"] == [KEYS[1]] and out["expired"] == [KEYS[2]]
    assert [i.step for i in catalog.list_checkpoints(hot, RUN)] == [20, 40]
    partitioned = {KEYS[1], KEYS[3]} | ({KEYS[0]} if archive_partitions else set())
    assert set(instance.get_dynamic_partitions("checkpoints")) == partitioned
    assert lifecycle.read_record(hot, first, "archive")["ok"] is True  # its records stay with it
    assert {i.key for i in arc.list("chunks/")} == archived_chunks  # hot GC never touches the archive
    assert catalog.verify_checkpoint(arc, RUN, 10).ok and catalog.verify_checkpoint(hot, RUN, 20).ok


def test_retention_keeps_the_partition_of_a_step_whose_earlier_commit_the_archive_holds(
    store_with_checkpoints, defs_with_retention, instance, paths
):
    """Step 40 archived (commit A), then its hot copy damaged: training falls back to 30
    and commits 40 again (B) and 50. Retention expires B, never archived; the archive
    still holds A, so ``tinylm@40`` keeps its partition (archive-only now)."""
    hot, arc = open_store(paths["store"]), open_store(paths["archive"])
    assert lifecycle.archive(hot, arc, RUN, 40).ok
    corrupt_chunk(store_with_checkpoints, RUN, 40, only_in(store_with_checkpoints, RUN, 40, 30)[0])
    state = demo.build()
    with Checkpointer(hot, RUN) as ck:
        assert ck.restore(state).step == 30
        for step in (40, 50):
            ck.save(step, state, metadata={"train_loss": 0.1})
    keys = [*KEYS, checkpoint_key(RUN, 50)]
    instance.add_dynamic_partitions("checkpoints", keys)
    defs = defs_with_retention(recent_days=0, full_days=0, best_k=0, gc_grace="0s")
    out = defs.resolve_job_def("retention_job").execute_in_process(instance=instance).output_for_node("apply_retention")
    assert not hot.exists(fmt.manifest_key(RUN, 40)) and catalog.verify_checkpoint(arc, RUN, 40).ok
    assert KEYS[3] in instance.get_dynamic_partitions("checkpoints")
    assert out["hot_commits_expired"] == [KEYS[3]] and KEYS[3] not in out["expired"]


@pytest.mark.parametrize("kind", ["ephemeral", "on disk"])
def test_partitions_are_dropped_in_batches_and_only_those_named(tmp_path, kind):
    from dagster import DagsterInstance

    from assets.partitions import DROP_BATCH, drop_checkpoint_partitions
    from resources.dagster_private import sql_event_storage

    if kind == "ephemeral":
        context = DagsterInstance.ephemeral()
    else:
        os.makedirs(tmp_path / "home")
        context = DagsterInstance.local_temp(tempdir=str(tmp_path / "home"))
    with context as inst:
        assert sql_event_storage(inst) is not None  # the batched path, on Dagster's SQLite storages
        keys = [checkpoint_key(RUN, step) for step in range(2 * DROP_BATCH + 7)]
        inst.add_dynamic_partitions("checkpoints", keys)
        inst.add_dynamic_partitions("elsewhere", keys[:3])
        doomed = keys[1 : 2 * DROP_BATCH + 2] + [checkpoint_key(RUN, 10**6)]  # one that never existed
        assert drop_checkpoint_partitions(inst, doomed) == 2 * DROP_BATCH + 1
        assert list(inst.get_dynamic_partitions("checkpoints")) == [keys[0], *keys[2 * DROP_BATCH + 2 :]]
        assert list(inst.get_dynamic_partitions("elsewhere")) == keys[:3]
        assert drop_checkpoint_partitions(inst, doomed) == 0


def test_a_promotion_names_the_partition_an_older_instance_holds_for_its_checkpoint(
    store_with_checkpoints, defs, instance
):
    legacy = fmt.legacy_checkpoint_name(RUN, 10)  # added by a ckptflow that named partitions so
    instance.add_dynamic_partitions("checkpoints", [legacy])
    first = deploy(defs, instance, stage="stable", partition_key=legacy)
    assert first.success
    md = first.asset_materializations_for_node("deployed_model")[0].metadata
    assert md["source_partition"].value == legacy and md["alias/stable/source_partition"].value == legacy
    assert md["stable"].value.startswith(f"v1 from {legacy} ")
    second = deploy(defs, instance, stage="latest", partition_key=checkpoint_key(RUN, 20))  # held under neither name
    md = second.asset_materializations_for_node("deployed_model")[0].metadata
    assert md["source_partition"].value == checkpoint_key(RUN, 20) == f"{RUN}@20"
    assert md["alias/stable/source_partition"].value == legacy


def test_a_retention_policy_gc_cannot_read_fails_the_job_before_anything_is_expired(
    store_with_checkpoints, defs, instance, paths
):
    from resources import RetentionResource

    store = open_store(paths["store"])
    before = sorted(i.key for i in store.list("runs/"))
    bad = RetentionResource(recent_days=0, full_days=0, best_k=0, gc_grace="one hour")  # constructed, not loaded
    result = defs.resolve_job_def("retention_job").execute_in_process(
        instance=instance, resources={"retention": bad}, raise_on_error=False
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.is_failure).event_specific_data.error.message
    assert "gc_grace: duration 'one hour' is not understood" in failure and "nothing was expired" in failure
    assert sorted(i.key for i in store.list("runs/")) == before
