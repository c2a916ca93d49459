"""Partition keys, and the landing sensor: exactly the new partitions, cursor, paging."""

import json
import os

import pytest
from dagster import SensorResult, SkipReason, build_sensor_context

from assets.partitions import checkpoint_key, parse_checkpoint_key
from ckptflow.store import open_store
from sensors.landing import landing_sensor, new_checkpoints
from dagster_helpers import RUN, write_checkpoints


def test_partition_keys_round_trip_and_reject_garbage():
    assert checkpoint_key("gpt-small", 1200) == "gpt-small__step-000000001200"
    assert parse_checkpoint_key("gpt-small__step-000000001200") == ("gpt-small", 1200)
    for bad in ("gpt", "gpt__step-12", "gpt__step-00000000120x", "__step-000000000001"):
        with pytest.raises(ValueError):
            parse_checkpoint_key(bad)
    with pytest.raises(ValueError):
        checkpoint_key("a__b", 1)


def tick(instance, resources, cursor=None):
    return landing_sensor(build_sensor_context(instance=instance, cursor=cursor, resources={"store": resources["store"]}))


def test_sensor_adds_exactly_new_partitions_advances_cursor_and_is_idle_after(store_with_checkpoints, resources, instance):
    result = tick(instance, resources)
    assert isinstance(result, SensorResult)
    keys = [checkpoint_key(RUN, s) for s in (10, 20, 30, 40)]
    [add] = result.dynamic_partitions_requests
    assert add.partitions_def_name == "checkpoints" and list(add.partition_keys) == keys
    assert [r.partition_key for r in result.run_requests] == keys
    assert [r.run_key for r in result.run_requests] == keys
    assert json.loads(result.cursor) == {RUN: 40}

    again = tick(instance, resources, result.cursor)
    assert isinstance(again, SkipReason)

    write_checkpoints(store_with_checkpoints, steps=(10, 20, 30, 40, 50))
    write_checkpoints(store_with_checkpoints, steps=(5,), run="other")
    third = tick(instance, resources, result.cursor)
    assert list(third.dynamic_partitions_requests[0].partition_keys) == [checkpoint_key("other", 5), checkpoint_key(RUN, 50)]
    assert json.loads(third.cursor) == {RUN: 50, "other": 5}


def test_sensor_ignores_uncommitted_steps_and_pages(store_with_checkpoints):
    store = open_store(store_with_checkpoints)
    os.makedirs(os.path.join(store_with_checkpoints, "runs", RUN, "checkpoints", "000000000050", "ranks"))
    found, cursor = new_checkpoints(store, {}, limit=3)
    assert found == [(RUN, 10), (RUN, 20), (RUN, 30)] and cursor == {RUN: 30}
    found, cursor = new_checkpoints(store, cursor, limit=3)
    assert found == [(RUN, 40)] and cursor == {RUN: 40}  # step 50 has no commit record
    assert new_checkpoints(store, cursor, limit=3) == ([], {RUN: 40})


def test_sensor_passes_over_partitions_the_instance_already_has(store_with_checkpoints, resources, instance):
    instance.add_dynamic_partitions("checkpoints", [checkpoint_key(RUN, s) for s in (10, 20)])
    result = tick(instance, resources)
    assert list(result.dynamic_partitions_requests[0].partition_keys) == [checkpoint_key(RUN, s) for s in (30, 40)]
    instance.add_dynamic_partitions("checkpoints", [checkpoint_key(RUN, s) for s in (30, 40)])
    again = tick(instance, resources)  # e.g. a daemon on an instance the demo filled: nothing to run, cursor moves
    assert not again.run_requests and not again.dynamic_partitions_requests
    assert json.loads(again.cursor) == {RUN: 40} and "already registered" in again.skip_reason.skip_message
