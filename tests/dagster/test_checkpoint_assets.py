"""Per-checkpoint assets: metadata, the blocking integrity check, automation gating, backfill,
an evaluator that fails."""

import os

from dagster import (
    AssetPartitionStatus,
    AssetRecordsFilter,
    DagsterEventType,
    evaluate_automation_conditions,
    materialize,
)

from assets import INTEGRITY_KEY, PARTITIONED, archived, checkpoint, checkpoint_key, compressed, evaluation
from assets.partitions import checkpoints_partitions
from ckptflow import lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.format import layout as fmt
from ckptflow.store import open_store
from resources import EvaluatorResource
from support.corrupt import corrupt_chunk, grow_first_tensor, reseal_manifest
from support.dagster import RUN, record

PER_CHECKPOINT = PARTITIONED  # the integrity check is declared on `checkpoint`
KEYS = [checkpoint_key(RUN, s) for s in (10, 20, 30, 40)]


def latest(instance, asset, key):
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=asset.key, asset_partitions=[key]), limit=1
    ).records
    return records[0].asset_materialization.metadata if records else None


def status(instance, asset, keys):
    return instance.get_status_by_partition(asset.key, keys, checkpoints_partitions)


def mat(instance, resources, key, selection=None, **kw):
    return materialize(
        PER_CHECKPOINT,
        partition_key=key,
        instance=instance,
        resources=resources,
        selection=selection,
        raise_on_error=False,
        **kw,
    )


def test_good_checkpoint_flows_through_every_asset(store_with_checkpoints, paths, resources, instance):
    instance.add_dynamic_partitions("checkpoints", KEYS)
    result = mat(instance, resources, KEYS[1])
    assert result.success
    md = latest(instance, checkpoint, KEYS[1])
    assert md["run"].value == RUN and md["step"].value == "20" and md["kind"].value == "full"
    assert md["world_size"].value == "1" and md["chunks"].value > 0 and md["logical_bytes"].value > 0
    assert md["logical"].value.endswith("KiB") and "written_after" not in md  # a full checkpoint reuses nothing
    assert f"{RUN}/trainer/train_loss" in md and len(md["manifest_digest"].value) == 64
    [check] = result.get_asset_check_evaluations()
    assert check.passed and check.asset_check_key == INTEGRITY_KEY
    assert latest(instance, evaluation, KEYS[1])[f"{RUN}/val_loss"].value > 0
    comp = latest(instance, compressed, KEYS[1])
    assert comp["after_bytes"].value < comp["before_bytes"].value and comp["ratio"].value > 1
    assert comp["ratio"].value == round(comp["ratio"].value, 3) and " " in comp["after"].value
    arc = latest(instance, archived, KEYS[1])
    assert arc["verified"].value is True
    assert catalog.verify_checkpoint(open_store(paths["archive"]), RUN, 20).ok
    assert catalog.verify_checkpoint(open_store(paths["store"]), RUN, 20).ok  # still restores after re-encoding
    assert record(paths["store"], 20, "validation")["ok"] is True


def test_corrupt_checkpoint_fails_blocking_check_and_nothing_downstream_runs(
    store_with_checkpoints, resources, instance
):
    instance.add_dynamic_partitions("checkpoints", KEYS)
    corrupt_chunk(store_with_checkpoints, RUN, 30)
    result = mat(instance, resources, KEYS[2])
    [check] = result.get_asset_check_evaluations()
    assert not check.passed and "does not match its address" in check.metadata["problems"].value
    [failure] = [e for e in result.all_events if e.is_step_failure]
    assert failure.step_key == "checkpoint"
    description = failure.step_failure_data.user_failure_data.description
    assert description.startswith(f"integrity check blocked {KEYS[2]}: chunk")
    for asset in (checkpoint, evaluation, compressed, archived):
        assert latest(instance, asset, KEYS[2]) is None, asset.key
    # the corrupt partition is Failed where operators look first; a good one is Materialized
    assert mat(instance, resources, KEYS[1]).success
    assert status(instance, checkpoint, KEYS[1:3]) == {
        KEYS[1]: AssetPartitionStatus.MATERIALIZED,
        KEYS[2]: AssetPartitionStatus.FAILED,
    }
    archive = os.path.join(store_with_checkpoints, "..", "archive")
    assert not os.path.exists(os.path.join(archive, "runs", RUN, "checkpoints", "000000000030"))


def test_downstream_materialized_by_hand_refuses_a_checkpoint_that_failed_validation(
    store_with_checkpoints, resources, instance
):
    """``dagster asset materialize --select evaluation`` (or a backfill) runs no blocking
    check: each downstream asset refuses the failed commit itself, and records nothing.
    Evaluated from the trainer's metrics, so no read of the damaged chunk would stop it."""
    instance.add_dynamic_partitions("checkpoints", KEYS)
    corrupt_chunk(store_with_checkpoints, RUN, 30)
    assert not mat(instance, resources, KEYS[2], selection=[checkpoint]).success
    trainer_metrics = {**resources, "evaluator": EvaluatorResource(evaluators={})}
    for asset in (evaluation, compressed, archived):
        result = mat(instance, trainer_metrics, KEYS[2], selection=[asset])
        [failure] = [e for e in result.all_events if e.is_step_failure]
        description = failure.step_failure_data.user_failure_data.description
        assert description.startswith(f"run '{RUN}' step 30 failed validation"), asset.key
        assert latest(instance, asset, KEYS[2]) is None, asset.key
    assert [record(store_with_checkpoints, 30, what) for what in ("evaluation", "compression", "archive")] == [None] * 3
    archive = os.path.join(store_with_checkpoints, "..", "archive")
    assert not os.path.exists(os.path.join(archive, "runs", RUN, "checkpoints", "000000000030"))


def test_evaluation_names_the_tier_it_read(store_with_checkpoints, paths, resources, instance):
    """Step 20 archived and its hot copy expired: it is evaluated from the archive, and
    its metadata says so, as the checkpoint's does; step 10 from the hot store."""
    hot, arc = open_store(paths["store"]), open_store(paths["archive"])
    assert lifecycle.archive(hot, arc, RUN, 20).ok
    lifecycle.expire(hot, RUN, 20, keep_records=True)
    instance.add_dynamic_partitions("checkpoints", KEYS)
    for key, tier in ((KEYS[0], hot.url), (KEYS[1], arc.url)):
        assert mat(instance, resources, key, selection=[checkpoint, evaluation]).success
        assert latest(instance, checkpoint, key)["tier"].value == tier
        assert latest(instance, evaluation, key)["tier"].value == tier


def test_compression_skips_an_archived_checkpoint_and_fails_one_no_tier_holds(
    store_with_checkpoints, paths, resources, instance
):
    """Step 20's hot copy expired without an archive copy: the compressed asset succeeded
    with "skipped: ... the archive keeps its bytes" about a checkpoint nobody holds. Now
    it fails saying so; step 10, archived then expired from hot, is still skipped."""
    hot, arc = open_store(paths["store"]), open_store(paths["archive"])
    assert lifecycle.archive(hot, arc, RUN, 10).ok
    for step in (10, 20):
        lifecycle.expire(hot, RUN, step, keep_records=True)
    instance.add_dynamic_partitions("checkpoints", KEYS)
    assert mat(instance, resources, KEYS[0], selection=[compressed]).success
    assert "the archive keeps its bytes" in latest(instance, compressed, KEYS[0])["skipped"].value
    result = mat(instance, resources, KEYS[1], selection=[compressed])
    assert not result.success and latest(instance, compressed, KEYS[1]) is None
    (failure,) = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    error = failure.step_failure_data.error.to_string()  # the library's error is the step error's cause
    assert "ManifestError: no manifest at" in error and "000000000020" in error, error
    assert "never committed (or was deleted)" in error


def test_automation_requests_downstream_only_for_checkpoints_that_passed(store_with_checkpoints, defs, instance):
    cursor = evaluate_automation_conditions(defs=defs, instance=instance).cursor  # the daemon was already running
    instance.add_dynamic_partitions("checkpoints", KEYS[:3])
    corrupt_chunk(store_with_checkpoints, RUN, 30)
    validate = defs.resolve_job_def("validate_checkpoint")
    for key in KEYS[:3]:
        validate.execute_in_process(instance=instance, partition_key=key, raise_on_error=False)
    result = evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
    assert result.get_requested_partitions(evaluation.key) == set(KEYS[:2])
    assert result.get_requested_partitions(compressed.key) == set(KEYS[:2])
    # archived follows compression in the same tick (eager sees compressed will be requested)
    assert result.get_requested_partitions(archived.key) == set(KEYS[:2])


def test_backfill_reevaluates_several_partitions_with_a_new_evaluator(store_with_checkpoints, resources, instance):
    assert all(a.backfill_policy.max_partitions_per_run == 1 for a in PARTITIONED)
    instance.add_dynamic_partitions("checkpoints", KEYS)
    for key in KEYS:  # first pass: register + validate
        assert materialize(
            PER_CHECKPOINT,
            partition_key=key,
            instance=instance,
            resources=resources,
            selection=[checkpoint, evaluation],
        ).success
    first = {k: latest(instance, evaluation, k)[f"{RUN}/val_loss"].value for k in KEYS}
    new = {**resources, "evaluator": EvaluatorResource(evaluators={RUN: f"{__name__}:constant_evaluator"})}
    for key in KEYS[1:]:  # the backfill: a range of old partitions, evaluation only
        assert materialize(
            PER_CHECKPOINT, partition_key=key, instance=instance, resources=new, selection=[evaluation]
        ).success
    assert latest(instance, evaluation, KEYS[0])[f"{RUN}/val_loss"].value == first[KEYS[0]]
    for key in KEYS[1:]:
        md = latest(instance, evaluation, key)
        assert md[f"{RUN}/val_loss"].value == 0.5 and md["evaluator"].value.endswith("constant_evaluator")
    assert latest(instance, evaluation, KEYS[2])[f"{RUN}/improvement/val_loss"].value == 0.0


def test_a_failing_evaluator_fails_its_partition_with_its_error_and_nothing_else(
    store_with_checkpoints, resources, instance
):
    """The demo's TinyLM evaluator pointed at a model that is not a TinyLM: evaluation fails
    for that partition, with the evaluator's error, while compression and archival (their
    own run, as the automation sensors request them) succeed."""
    instance.add_dynamic_partitions("checkpoints", KEYS[:1])
    wrong = {**resources, "evaluator": EvaluatorResource(evaluators={RUN: f"{__name__}:wrong_model"})}
    assert mat(instance, wrong, KEYS[0], selection=[checkpoint]).success
    evaluated = mat(instance, wrong, KEYS[0], selection=[evaluation])
    archival = mat(instance, wrong, KEYS[0], selection=[compressed, archived])
    assert not evaluated.success and archival.success
    [failure] = [e for e in evaluated.all_events if e.is_step_failure]
    description = failure.step_failure_data.user_failure_data.description
    assert description.startswith(f"evaluator {__name__}:wrong_model failed on {KEYS[0]}: RuntimeError")
    assert "Unexpected key(s) in state_dict" in description
    assert status(instance, evaluation, KEYS[:1]) == {KEYS[0]: AssetPartitionStatus.FAILED}
    assert latest(instance, archived, KEYS[0])["verified"].value is True


def wrong_model(state_dict, info):
    import torch

    torch.nn.Linear(3, 3).load_state_dict(dict(state_dict))
    return {"val_loss": 0.0}


def constant_evaluator(state_dict, info):
    assert "embed.weight" in state_dict and info["step"] > 0
    return {"val_loss": 0.5}


def test_integrity_check_refuses_a_manifest_whose_shards_do_not_cover_a_tensor(
    store_with_checkpoints, resources, instance
):
    """The check applies the rules restore applies (``Manifest.parse``): sealed but wrong fails."""
    instance.add_dynamic_partitions("checkpoints", KEYS)
    reseal_manifest(store_with_checkpoints, RUN, 20, grow_first_tensor)
    result = mat(instance, resources, KEYS[1])
    [check] = result.get_asset_check_evaluations()
    assert not check.passed and "do not tile it: no piece covers" in check.metadata["problems"].value
    for asset in (evaluation, compressed, archived):
        assert latest(instance, asset, KEYS[1]) is None, asset.key


def test_a_checkpoint_a_newer_ckptflow_wrote_gets_no_verdict_and_says_upgrade(
    store_with_checkpoints, resources, instance
):
    """Not damage: the partition records no failed check and no validation record; the run
    fails (not retried: waiting does not help) naming the format and what to do."""
    instance.add_dynamic_partitions("checkpoints", KEYS)
    reseal_manifest(store_with_checkpoints, RUN, 20, lambda r: r.update(format_version=max(fmt.READABLE_FORMATS) + 1))
    result = mat(instance, resources, KEYS[1])
    assert not result.success and result.get_asset_check_evaluations() == []
    [failure] = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    assert "newer ckptflow" in str(failure.step_failure_data.error) and "upgrade" in str(
        failure.step_failure_data.error
    )
    assert not [e for e in result.all_events if e.event_type == DagsterEventType.STEP_UP_FOR_RETRY]
    store = open_store(store_with_checkpoints)
    digest = fmt.digest_of(store.get(fmt.manifest_key(RUN, 20)))
    assert lifecycle.read_record(store, lifecycle.Subject(RUN, 20, digest), "validation") is None
