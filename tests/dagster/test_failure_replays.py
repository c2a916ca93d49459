"""A replay of the failure sensor (its cursor reset, a run deleted from the instance since)
never rewrites the failure record the first pass left: neither the failure's own, nor a
later run's."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from dagster import materialize

from assets import PARTITIONED, evaluation
from resources import EvaluatorResource
from support.dagster import RUN, subject
from support.failure_sensor import KEY, evaluation_failed, failure, needs_attention, tick


def test_a_replay_does_not_reopen_a_failure_made_good_by_a_run_deleted_since(
    store_with_checkpoints, resources, instance
):
    """Recorded, made good by a re-run, then the re-run deleted from the instance (run
    retention, or by hand) and the sensor's cursor reset: the replay wrote the record anew,
    seeing the re-run's evaluation as the one that stood at the failure and no later run
    that wrote it, so the failure needed attention again though the work was redone."""
    failed = evaluation_failed(instance, resources)
    tick(instance, resources)
    digest = subject(store_with_checkpoints, 40).digest
    first = failure(store_with_checkpoints, digest)
    rerun = materialize(PARTITIONED, partition_key=KEY, instance=instance, resources=resources, selection=[evaluation])
    assert rerun.success and needs_attention(store_with_checkpoints) is None
    instance.delete_run(rerun.run_id)
    tick(instance, resources, "-1")
    assert failure(store_with_checkpoints, digest) == first  # the record of that failure, as first written
    assert needs_attention(store_with_checkpoints) is None
    assert failure(store_with_checkpoints, digest)["run_id"] == failed.run_id


@pytest.mark.parametrize("deleted", [False, True], ids=["listed", "deleted from the instance"])
def test_a_replay_does_not_write_an_older_failure_over_a_later_one(
    store_with_checkpoints, resources, instance, monkeypatch, deleted
):
    """Two failures of the commit's evaluation, the first made good by a re-run, the second
    open; the cursor reset. The replay wrote the first failure over the second's record:
    the checkpoint no longer needed attention until a later tick reached the second. So it
    did once the second run was deleted from the instance by hand (or recorded by another
    deployment sharing the store): the instance's order of runs no longer names it."""
    monkeypatch.setattr("sensors.failures.PER_TICK", 1)
    evaluation_failed(instance, resources)
    cursor = tick(instance, resources)
    assert materialize(PARTITIONED, partition_key=KEY, instance=instance, resources=resources, selection=[evaluation])
    second = evaluation_failed(instance, resources)
    tick(instance, resources, cursor)
    digest = subject(store_with_checkpoints, 40).digest
    recorded = failure(store_with_checkpoints, digest)
    assert recorded["run_id"] == second.run_id and "failed: evaluation" in needs_attention(store_with_checkpoints)
    if deleted:
        instance.delete_run(second.run_id)
    tick(instance, resources, "-1")  # replays the first failure only (one a tick)
    assert failure(store_with_checkpoints, digest) == recorded
    assert "failed: evaluation" in needs_attention(store_with_checkpoints)


STARTED, RELEASE = threading.Event(), threading.Event()


def failing_once_released(state_dict, info):
    """An evaluator that fails, once the test lets it: its run began before, fails after."""
    STARTED.set()
    assert RELEASE.wait(60)
    raise RuntimeError("evaluator crashed after a long wait")


def test_a_replay_does_not_write_a_failure_over_one_of_a_run_begun_after_it_deleted_from_the_instance(
    store_with_checkpoints, resources, instance
):
    """A long evaluation begins, a second one begins after it and fails first, then the long
    one fails: the second's record stands (a run begun after). The second run then deleted
    from the instance and the cursor reset, the replay judged by the failures' clocks (the
    long one failed later) and wrote the long run's failure over it: a replay that rewrote
    what the first pass kept. A run the instance no longer lists is ordered by when it began."""
    instance.add_dynamic_partitions("checkpoints", [KEY])
    slow = {**resources, "evaluator": EvaluatorResource(evaluators={RUN: f"{__name__}:failing_once_released"})}
    STARTED.clear(), RELEASE.clear()
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(
            materialize, PARTITIONED, partition_key=KEY, instance=instance, resources=slow, selection=[evaluation],
            raise_on_error=False,
        )  # fmt: skip
        assert STARTED.wait(60)
        second = evaluation_failed(instance, resources)
        RELEASE.set()
        assert not long.result().success
    tick(instance, resources)
    digest = subject(store_with_checkpoints, 40).digest
    recorded = failure(store_with_checkpoints, digest)
    assert recorded["run_id"] == second.run_id
    instance.delete_run(second.run_id)
    tick(instance, resources, "-1")
    assert failure(store_with_checkpoints, digest) == recorded
