"""Partition keys, and the landing sensor: exactly the new commits, cursor, paging, re-commits."""

import json
import os

import pytest
import torch
from dagster import SensorResult, SkipReason, build_sensor_context, materialize

from assets.checkpoints import checkpoint
from assets.partitions import (
    checkpoint_key,
    drop_checkpoint_partitions,
    in_step_order,
    parse_checkpoint_key,
    partition_keys,
)
from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.errors import StoreUnavailableError
from ckptflow.format.layout import READABLE_FORMATS, legacy_checkpoint_name
from ckptflow.lifecycle.landing import FULL_SCAN_S, SLACK, new_commits
from ckptflow.store import open_store
from pipelines import demo
from resources import CheckpointStoreResource
from sensors.landing import DIGEST_TAG, landing_sensor
from support.corrupt import corrupt_chunk, manifest_path, only_in, reseal_manifest
from support.dagster import RUN, write_checkpoints
from support.faulty_store import FaultyStore


def test_partition_keys_round_trip_read_the_former_names_and_reject_garbage():
    assert checkpoint_key("gpt-small", 1200) == "gpt-small@1200" and checkpoint_key("gpt-small", 0) == "gpt-small@0"
    assert parse_checkpoint_key("gpt-small@1200") == ("gpt-small", 1200) == parse_checkpoint_key("gpt-small@1200")
    assert parse_checkpoint_key("gpt-small__step-000000001200") == ("gpt-small", 1200)  # an older instance's key
    for bad in (
        "gpt",
        "gpt@",
        "@12",
        "gpt@012",  # one name per checkpoint: no leading zeros
        "gpt@1e3",
        "gpt@" + "9" * 13,  # beyond the largest step
        "gpt@١٢",  # digits, but not ASCII ones
        "gpt__step-12",
        "gpt__step-00000000120x",
        "__step-000000000001",
    ):
        with pytest.raises(ValueError):
            parse_checkpoint_key(bad)
    for bad_run in ("a__b", "a@b"):
        with pytest.raises(ValueError):
            checkpoint_key(bad_run, 1)
    assert in_step_order(["r@10", "r@9", "q@100", "r__step-000000000011"]) == [
        "q@100",
        "r@9",
        "r@10",
        "r__step-000000000011",
    ]


def test_an_instance_holding_partitions_under_their_former_names_gets_no_second_partition(
    store_with_checkpoints, resources, instance
):
    """Upgrading: checkpoints an older instance added as ``<run>__step-<12 digits>`` keep
    those partitions (and their history); the landing sensor adds only the others, under
    the current name, and validates a re-commit in the partition it already has."""
    legacy = [legacy_checkpoint_name(RUN, s) for s in (10, 20)]
    instance.add_dynamic_partitions("checkpoints", legacy)
    result = tick(instance, resources)
    [add] = result.dynamic_partitions_requests
    assert list(add.partition_keys) == [checkpoint_key(RUN, s) for s in (30, 40)]
    assert [r.partition_key for r in result.run_requests] == [*legacy, checkpoint_key(RUN, 30), checkpoint_key(RUN, 40)]
    assert {r.tags["checkpoint"] for r in result.run_requests} == {f"{RUN}@{s}" for s in (10, 20, 30, 40)}
    assert partition_keys(instance) == {(RUN, 10): legacy[0], (RUN, 20): legacy[1]}
    instance.add_dynamic_partitions("checkpoints", [checkpoint_key(RUN, 10)])  # both names: the current one wins
    assert partition_keys(instance)[(RUN, 10)] == checkpoint_key(RUN, 10)


def test_dropping_a_checkpoints_partition_drops_it_under_either_name(instance):
    held = [legacy_checkpoint_name(RUN, 10), checkpoint_key(RUN, 20), checkpoint_key(RUN, 30), checkpoint_key(RUN, 40)]
    instance.add_dynamic_partitions("checkpoints", [*held, "not-a-checkpoint"])
    named = [checkpoint_key(RUN, 10), checkpoint_key(RUN, 20), legacy_checkpoint_name(RUN, 40), "not-a-checkpoint"]
    assert drop_checkpoint_partitions(instance, named) == 4
    assert instance.get_dynamic_partitions("checkpoints") == [checkpoint_key(RUN, 30)]


def tick(instance, resources, cursor=None):
    return landing_sensor(
        build_sensor_context(instance=instance, cursor=cursor, resources={"store": resources["store"]})
    )


def digest(root, run, step):
    return catalog.read_manifest(open_store(root), run, step).digest


def test_sensor_adds_exactly_new_partitions_advances_cursor_and_is_idle_after(
    store_with_checkpoints, resources, instance
):
    result = tick(instance, resources)
    assert isinstance(result, SensorResult)
    keys = [checkpoint_key(RUN, s) for s in (10, 20, 30, 40)]
    [add] = result.dynamic_partitions_requests
    assert add.partitions_def_name == "checkpoints" and list(add.partition_keys) == keys
    assert [r.partition_key for r in result.run_requests] == keys
    # the run key names the commit (its manifest digest), and the run carries the digest as a tag
    assert [r.run_key for r in result.run_requests] == [
        f"{k}@{digest(store_with_checkpoints, RUN, s)[:16]}" for k, s in zip(keys, (10, 20, 30, 40))
    ]
    assert result.run_requests[0].tags[DIGEST_TAG] == digest(store_with_checkpoints, RUN, 10)
    instance.add_dynamic_partitions("checkpoints", keys)

    again = tick(instance, resources, result.cursor)
    assert not again.run_requests and not again.dynamic_partitions_requests

    write_checkpoints(store_with_checkpoints, steps=(10, 20, 30, 40, 50))
    write_checkpoints(store_with_checkpoints, steps=(5,), run="other")
    third = tick(instance, resources, again.cursor)
    assert list(third.dynamic_partitions_requests[0].partition_keys) == [
        checkpoint_key("other", 5),
        checkpoint_key(RUN, 50),
    ]
    assert sorted(r.partition_key for r in third.run_requests) == [checkpoint_key("other", 5), checkpoint_key(RUN, 50)]


def sealed_as(root, step: int, version: int) -> None:
    """Step ``step``'s manifest sealed again as ``version``, its commit record time kept."""
    path = manifest_path(root, RUN, step)
    mtime = path.stat().st_mtime
    reseal_manifest(root, RUN, step, lambda record: record.update(format_version=version))
    os.utime(path, (mtime, mtime))


def test_a_commit_landed_unread_gets_its_validation_run_once_the_code_location_reads_it(
    store_with_checkpoints, resources, instance
):
    """Trainers upgraded before the code location: step 40 lands as a partition whose run
    says to upgrade. After the upgrade, the next full listing requests its validation in
    that partition under its digest, with no second partition."""
    sealed_as(store_with_checkpoints, 40, max(READABLE_FORMATS) + 1)
    first = tick(instance, resources)
    unread = first.run_requests[-1]
    assert unread.partition_key == checkpoint_key(RUN, 40) and DIGEST_TAG not in unread.tags
    assert unread.run_key.startswith(f"{checkpoint_key(RUN, 40)}@unreadable-")
    instance.add_dynamic_partitions("checkpoints", list(first.dynamic_partitions_requests[0].partition_keys))

    sealed_as(store_with_checkpoints, 40, max(READABLE_FORMATS))
    cursor = json.loads(first.cursor)
    assert tick(instance, resources, first.cursor).run_requests == []  # a quick tick: waits for a full listing
    cursor["full_at"] -= FULL_SCAN_S
    after = tick(instance, resources, json.dumps(cursor))
    [request] = after.run_requests
    assert request.partition_key == checkpoint_key(RUN, 40) and not after.dynamic_partitions_requests
    assert request.tags[DIGEST_TAG] == digest(store_with_checkpoints, RUN, 40)
    assert request.run_key == f"{checkpoint_key(RUN, 40)}@{digest(store_with_checkpoints, RUN, 40)[:16]}"


def test_a_commit_landed_once_it_reads_is_not_landed_again_by_each_full_listing(
    store_with_checkpoints, resources, instance
):
    """Step 10, committed long before the rest (behind the watermark by over ``SLACK``),
    landed unread, then read at a full listing: it landed under its digest, but was not
    kept ``pending`` as a commit landed at once is, so every full listing after it found
    it behind the watermark with no validation record and landed it again (another
    '1 new commit record(s)', another run request) until its validation recorded one."""
    path = manifest_path(store_with_checkpoints, RUN, 10)
    old = path.stat().st_mtime - 2 * SLACK
    os.utime(path, (old, old))
    sealed_as(store_with_checkpoints, 10, max(READABLE_FORMATS) + 1)
    first = tick(instance, resources)
    assert first.run_requests[0].run_key.startswith(f"{checkpoint_key(RUN, 10)}@unreadable-")
    instance.add_dynamic_partitions("checkpoints", list(first.dynamic_partitions_requests[0].partition_keys))
    sealed_as(store_with_checkpoints, 10, max(READABLE_FORMATS))

    def full_tick(cursor: str):
        state = json.loads(cursor)
        state["full_at"] -= FULL_SCAN_S
        return tick(instance, resources, json.dumps(state))

    read = full_tick(first.cursor)
    assert [r.run_key for r in read.run_requests] == [
        f"{checkpoint_key(RUN, 10)}@{digest(store_with_checkpoints, RUN, 10)[:16]}"
    ]
    assert full_tick(read.cursor).run_requests == []  # not landed again: it waits for its validation
    assert [RUN, 10] in [p[:2] for p in json.loads(read.cursor)["pending"]]


def test_sensor_ignores_uncommitted_steps_and_pages_oldest_first(store_with_checkpoints):
    store = open_store(store_with_checkpoints)
    os.makedirs(os.path.join(store_with_checkpoints, "runs", RUN, "checkpoints", "000000000050", "ranks"))
    found, cursor = new_commits(store, {}, limit=3)
    assert [c.key for c in found] == [checkpoint_key(RUN, s) for s in (10, 20, 30)]
    found, cursor = new_commits(store, cursor, limit=3)
    assert [c.key for c in found] == [checkpoint_key(RUN, 40)]  # step 50 has no commit record
    assert new_commits(store, cursor, limit=3)[0] == []


def test_a_step_committed_again_is_landed_again(store_with_checkpoints, resources, instance):
    """Restore rejects step 40, training falls back to 30 and saves step 40 again: the new
    commit (a new digest) gets its own validation run although its partition exists."""
    first = tick(instance, resources)
    instance.add_dynamic_partitions("checkpoints", [r.partition_key for r in first.run_requests])
    old = digest(store_with_checkpoints, RUN, 40)
    corrupt_chunk(store_with_checkpoints, RUN, 40, only_in(store_with_checkpoints, RUN, 40, 30)[0])
    torch.manual_seed(1)
    state = demo.build()
    with Checkpointer(store_with_checkpoints, RUN) as ck:
        assert ck.restore(state).step == 30
        ck.save(40, state, metadata={"train_loss": 0.5})  # moves the rejected commit aside
    new = digest(store_with_checkpoints, RUN, 40)
    assert new != old
    again = tick(instance, resources, first.cursor)
    assert not again.dynamic_partitions_requests  # the partition exists
    [request] = again.run_requests
    assert (
        request.partition_key == checkpoint_key(RUN, 40) and request.run_key == f"{checkpoint_key(RUN, 40)}@{new[:16]}"
    )


def test_a_validated_commit_is_spared_its_run_only_where_its_partition_was_materialized_for_it(
    store_with_checkpoints, resources, instance
):
    """Step 10 went through the landing path of this instance (its ``checkpoint``
    partition materialized for its digest); step 20 was validated before the sensor
    ticked (scrub with ``older_than_days=0``, a promotion by partition key). Only 10 is
    spared a run: 20 without one would never be materialized, so never evaluated,
    compressed or archived."""
    instance.add_dynamic_partitions("checkpoints", [checkpoint_key(RUN, 10)])
    materialized = materialize(
        [checkpoint], partition_key=checkpoint_key(RUN, 10), resources=resources, instance=instance
    )
    assert materialized.success
    lifecycle.validate(open_store(store_with_checkpoints), RUN, 20)
    result = tick(instance, resources)
    assert list(result.dynamic_partitions_requests[0].partition_keys) == [checkpoint_key(RUN, s) for s in (20, 30, 40)]
    assert [r.partition_key for r in result.run_requests] == [checkpoint_key(RUN, s) for s in (20, 30, 40)]


def test_a_quick_tick_lists_from_the_frontier_and_a_full_listing_finds_what_is_behind_it(store_with_checkpoints):
    """Steps 10..40 landed. A quick tick lists each run from its newest landed step only;
    a commit at an older step (behind the frontier) is found by the full listing of the
    next ``FULL_SCAN_S``; one at the frontier step or past it at once."""
    inner = open_store(store_with_checkpoints)
    store = FaultyStore(inner, count_reads=True)
    landed, cursor = new_commits(store, {}, limit=100, now=0.0)
    assert [c.key for c in landed] == [checkpoint_key(RUN, s) for s in (10, 20, 30, 40)]
    assert cursor["frontier"] == {RUN: 40}
    store.reset_counts()
    assert new_commits(store, cursor, limit=100, now=1.0)[0] == []
    listings = [(op, key) for _, op, key in store.log if op.startswith("list")]
    assert listings == [("list", "runs/"), ("list_after", f"runs/{RUN}/checkpoints/")]
    write_checkpoints(store_with_checkpoints, steps=(50,))
    with Checkpointer(inner, RUN) as ck:  # behind the frontier
        ck.save(25, demo.build(), metadata={"train_loss": 1.0})
    quick, cursor = new_commits(store, cursor, limit=100, now=2.0)
    assert [c.key for c in quick] == [checkpoint_key(RUN, 50)]
    assert new_commits(store, cursor, limit=100, now=3.0)[0] == []
    full, cursor = new_commits(store, cursor, limit=100, now=2.0 + FULL_SCAN_S)
    assert [c.key for c in full] == [checkpoint_key(RUN, 25)]
    assert new_commits(store, cursor, limit=100, now=4.0 + FULL_SCAN_S)[0] == []


def test_a_paged_backlog_keeps_the_frontier_at_the_oldest_commit_left(store_with_checkpoints):
    store = open_store(store_with_checkpoints)
    first, cursor = new_commits(store, {}, limit=2, now=0.0)
    assert [c.key for c in first] == [checkpoint_key(RUN, s) for s in (10, 20)]
    assert cursor["frontier"] == {RUN: 30}
    rest, cursor = new_commits(store, cursor, limit=2, now=1.0)  # a quick tick
    assert [c.key for c in rest] == [checkpoint_key(RUN, s) for s in (30, 40)]


def test_a_store_that_does_not_answer_skips_the_tick_keeping_the_cursor(
    store_with_checkpoints, resources, instance, monkeypatch
):
    """The listing raised StoreUnavailableError through ``landing.land``: the tick failed
    with a traceback. Now it skips saying the store is unavailable and will be retried, the
    cursor unchanged, and the next tick after the outage lands what is new."""
    first = tick(instance, resources)
    instance.add_dynamic_partitions("checkpoints", [r.partition_key for r in first.run_requests])
    write_checkpoints(store_with_checkpoints, steps=(10, 20, 30, 40, 50))
    opened = CheckpointStoreResource.open

    def unavailable(resource):
        down = FaultyStore(opened(resource))
        down.fail_if = lambda op, key: op.startswith("list") and _raise_unavailable(op, key)
        return down

    monkeypatch.setattr(CheckpointStoreResource, "open", unavailable)
    context = build_sensor_context(instance=instance, cursor=first.cursor, resources={"store": resources["store"]})
    skipped = landing_sensor(context)
    assert isinstance(skipped, SkipReason), skipped
    assert "unavailable" in skipped.skip_message and "retried" in skipped.skip_message
    assert "SlowDown" in skipped.skip_message  # what the store said
    assert context.cursor == first.cursor
    monkeypatch.setattr(CheckpointStoreResource, "open", opened)
    after = tick(instance, resources, context.cursor)
    assert [r.partition_key for r in after.run_requests] == [checkpoint_key(RUN, 50)]


def _raise_unavailable(op: str, key: str) -> bool:
    raise StoreUnavailableError(f"S3 {op} of {key} failed after 10 attempts: SlowDown")
