"""The run-failure sensor records a failure against the commit the run processed, never
against a step committed again since, and retries a store that does not answer."""

import pytest
import torch
from dagster import DagsterEventType, asset, materialize

from assets import PARTITIONED, compressed, evaluation
from assets.partitions import DIGEST_TAG, checkpoints_partitions
from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog.verdicts import step_prefix
from ckptflow.errors import StoreUnavailableError
from ckptflow.reports import recoverable
from ckptflow.store import open_store
from pipelines import demo
from resources import CheckpointStoreResource, EvaluatorResource
from sensors.failures import UNATTRIBUTED_TAG, TickRuns, record_failure
from support.corrupt import corrupt_chunk, only_in
from support.dagster import RUN, subject
from support.failure_sensor import KEY, evaluation_failed, failure, needs_attention, tick
from support.faulty_store import FaultyStore


@asset(partitions_def=checkpoints_partitions)
def doomed() -> None:
    """A run about a checkpoint that fails before it reads anything (so carries no digest)."""
    raise RuntimeError("failed before reading the checkpoint")


def recommit(store: str) -> None:
    """Restore rejects step 40, training falls back to 30 and saves step 40 again."""
    corrupt_chunk(store, RUN, 40, only_in(store, RUN, 40, 30)[0])
    torch.manual_seed(1)
    state = demo.build()
    with Checkpointer(store, RUN) as ck:
        assert ck.restore(state).step == 30
        ck.save(40, state, metadata={"train_loss": 0.5})


def fail_untagged(instance):
    result = materialize([doomed], partition_key=KEY, instance=instance, raise_on_error=False)
    assert not result.success and DIGEST_TAG not in instance.get_run_by_id(result.run_id).tags
    return result.run_id


def test_a_failure_belongs_to_the_commit_the_run_processed(store_with_checkpoints, resources, instance):
    instance.add_dynamic_partitions("checkpoints", [KEY])
    first = subject(store_with_checkpoints, 40).digest
    broken = {**resources, "evaluator": EvaluatorResource(evaluators={RUN: "no.such.module:evaluate"})}
    run = materialize(
        PARTITIONED, partition_key=KEY, instance=instance, resources=broken, selection=[evaluation],
        raise_on_error=False,
    )  # fmt: skip
    assert not run.success and instance.get_run_by_id(run.run_id).tags[DIGEST_TAG] == first
    recommit(store_with_checkpoints)  # before the sensor looks (it lags, or starts later)
    second = subject(store_with_checkpoints, 40).digest
    assert second != first
    tick(instance, resources)
    assert failure(store_with_checkpoints, first)["run_id"] == run.run_id
    assert failure(store_with_checkpoints, second) is None  # the new commit has failed nothing


def test_an_untagged_run_is_attributed_only_to_a_commit_older_than_itself(
    store_with_checkpoints, resources, instance, monkeypatch
):
    monkeypatch.setattr("ckptflow.lifecycle.attribution.CLOCK_SKEW_S", 0.0)  # one clock in a test
    instance.add_dynamic_partitions("checkpoints", [KEY])
    first = subject(store_with_checkpoints, 40).digest
    before = fail_untagged(instance)
    recommit(store_with_checkpoints)
    second = subject(store_with_checkpoints, 40).digest
    cursor = tick(instance, resources)
    assert failure(store_with_checkpoints, first) is None and failure(store_with_checkpoints, second) is None
    assert "committed (again) after it started" in instance.get_run_by_id(before).tags[UNATTRIBUTED_TAG]
    after = fail_untagged(instance)  # a run that started after the new commit was about it
    tick(instance, resources, cursor)
    assert failure(store_with_checkpoints, second)["run_id"] == after


def test_a_store_that_does_not_answer_is_retried_next_tick(store_with_checkpoints, resources, instance, monkeypatch):
    monkeypatch.setattr("ckptflow.lifecycle.attribution.CLOCK_SKEW_S", 0.0)
    instance.add_dynamic_partitions("checkpoints", [KEY])
    run_id = fail_untagged(instance)
    opened = CheckpointStoreResource.open
    down = {"now": True}

    def flaky_open(resource):
        store = FaultyStore(opened(resource))
        store.fail_if = lambda op, key: down["now"] and unavailable(key)
        return store

    monkeypatch.setattr(CheckpointStoreResource, "open", flaky_open)
    cursor = tick(instance, resources)
    assert cursor in (None, "-1")  # not past the run whose failure is unrecorded
    down["now"] = False
    tick(instance, resources, cursor)
    assert failure(store_with_checkpoints, subject(store_with_checkpoints, 40).digest)["run_id"] == run_id


def unavailable(key: str) -> bool:
    raise StoreUnavailableError(f"S3 GetObject of {key} failed after 10 attempts: SlowDown")


@pytest.mark.parametrize("sensor_late", [False, True], ids=["recorded-then-rerun", "rerun-then-recorded"])
def test_a_failure_that_a_later_run_made_good_no_longer_needs_attention(
    store_with_checkpoints, resources, instance, sensor_late
):
    """The operator re-runs a failed partition (the evaluator fixed): the checkpoint no
    longer needs attention, whether the sensor recorded the failure before the re-run or
    after it (it lags, or the daemon started later); the record stays, as history."""
    failed = evaluation_failed(instance, resources)
    assert not failed.success
    if not sensor_late:
        tick(instance, resources)
        assert "failed: evaluation: evaluator" in needs_attention(store_with_checkpoints)
    rerun = materialize(PARTITIONED, partition_key=KEY, instance=instance, resources=resources, selection=[evaluation])
    assert rerun.success
    if sensor_late:
        tick(instance, resources)
    assert failure(store_with_checkpoints, subject(store_with_checkpoints, 40).digest)["run_id"] == failed.run_id
    assert needs_attention(store_with_checkpoints) is None


def test_a_failure_that_no_later_run_made_good_still_needs_attention(store_with_checkpoints, resources, instance):
    """A later run of other work (compression) does not make a failed evaluation good."""
    evaluation_failed(instance, resources)
    tick(instance, resources)
    assert materialize(PARTITIONED, partition_key=KEY, instance=instance, resources=resources, selection=[compressed])
    assert "failed: evaluation: evaluator" in needs_attention(store_with_checkpoints)


@pytest.mark.parametrize("cursor", ["not-a-number", '{"after": 12}', "12.5"])
def test_a_cursor_that_is_not_an_integer_starts_over_with_a_warning(
    store_with_checkpoints, resources, instance, capfd, cursor
):
    """An older version's cursor, or one typed in the UI: ``int(cursor)`` raised ValueError
    on every tick, forever. Now the sensor warns and records from the beginning again;
    recording a failure twice leaves the same record, and a failure made good stays good."""
    failed = evaluation_failed(instance, resources)
    handled = tick(instance, resources)
    digest = subject(store_with_checkpoints, 40).digest
    first = failure(store_with_checkpoints, digest)
    assert materialize(PARTITIONED, partition_key=KEY, instance=instance, resources=resources, selection=[evaluation])
    assert needs_attention(store_with_checkpoints) is None  # the re-run made it good
    capfd.readouterr()
    again = tick(instance, resources, cursor)
    logged = capfd.readouterr().err  # the sensor's log (dagster's own handler, on stderr)
    assert again == handled  # past the same failure event: a valid cursor again
    assert f"WARNING - failure_sensor: its cursor {cursor!r} is not a run-failure event's storage id" in logged
    assert "restarting from the beginning" in logged
    replayed = failure(store_with_checkpoints, digest)
    assert replayed["run_id"] == failed.run_id and replayed["recorded_at"] >= first["recorded_at"]
    then = ("recorded_at", "records_seen", "made_good_already")  # when it was written, and what stood then
    assert {k: v for k, v in replayed.items() if k not in then} == {
        k: v for k, v in first.items() if k not in then
    }  # the same record: the time it was written, and what it found then, aside
    assert needs_attention(store_with_checkpoints) is None  # made good by the time of the failure, not of its record


def test_a_later_run_about_another_commit_of_the_step_does_not_make_the_failure_good(
    store_with_checkpoints, resources, instance
):
    """Step 40's commit was evaluated, then its re-evaluation failed; the step was committed
    again and the new commit evaluated, all before the sensor recorded the failure. The
    later run of the partition wrote the new commit's evaluation, not the failed one's, yet
    it counted as having written the failed commit's (``made_good_already`` by partition):
    the evaluation that stood from before the failure made it good though no run redid it."""
    instance.add_dynamic_partitions("checkpoints", [KEY])
    assert materialize(PARTITIONED, partition_key=KEY, instance=instance, resources=resources, selection=[evaluation])
    first = subject(store_with_checkpoints, 40)
    evaluated = lifecycle.read_record(open_store(store_with_checkpoints), first, "evaluation")
    failed = evaluation_failed(instance, resources)
    assert not failed.success
    recommit(store_with_checkpoints)
    assert materialize(PARTITIONED, partition_key=KEY, instance=instance, resources=resources, selection=[evaluation])
    tick(instance, resources)
    recorded = failure(store_with_checkpoints, first.digest)
    assert recorded["run_id"] == failed.run_id and recorded["made_good_already"] == []
    records = {"evaluation": lifecycle.read_record(open_store(store_with_checkpoints), first, "evaluation")}
    assert records["evaluation"] == evaluated  # the one from before the failure: nothing redid it
    assert not recoverable.made_good(recorded, records)


def records_of_step(store: str, step: int) -> list[str]:
    """Every lifecycle record object of ``step`` the store holds, whichever commit's."""
    return [i.key for i in open_store(store).list(step_prefix(RUN, step))]


def test_a_failure_of_a_checkpoint_retention_deleted_writes_no_record(store_with_checkpoints, resources, instance):
    """The sensor lags (or the daemon starts later, or replays its history): by the time it
    reads the failure, retention has expired the checkpoint and its records. The failure was
    written anyway, a ``failure.json`` under a step no store holds, which nothing deletes."""
    failed = evaluation_failed(instance, resources)
    digest = subject(store_with_checkpoints, 40).digest
    lifecycle.expire(open_store(store_with_checkpoints), RUN, 40)
    assert records_of_step(store_with_checkpoints, 40) == []
    cursor = tick(instance, resources)
    assert records_of_step(store_with_checkpoints, 40) == [] and failure(store_with_checkpoints, digest) is None
    assert cursor not in (None, "-1")  # handled: the next tick does not try it again
    tags = instance.get_run_by_id(failed.run_id).tags
    assert UNATTRIBUTED_TAG not in tags  # it was about that commit: the commit is gone, not unknown


def test_replaying_history_does_not_bring_back_the_records_of_an_expired_checkpoint(
    store_with_checkpoints, resources, instance
):
    """Recorded, then expired with its records, then the cursor reset (set in the UI): the
    replay wrote the failure record again, under the deleted step."""
    failed = evaluation_failed(instance, resources)
    digest = subject(store_with_checkpoints, 40).digest
    handled = tick(instance, resources)
    assert failure(store_with_checkpoints, digest)["run_id"] == failed.run_id
    lifecycle.expire(open_store(store_with_checkpoints), RUN, 40)
    assert records_of_step(store_with_checkpoints, 40) == []
    assert tick(instance, resources, "-1") == handled
    assert records_of_step(store_with_checkpoints, 40) == []


def test_an_archive_only_checkpoints_failure_is_still_recorded(store_with_checkpoints, resources, instance):
    """Retention expired the hot copy and kept its records (the archive holds it): a
    failure about it is recorded next to them, as before."""
    failed = evaluation_failed(instance, resources)
    digest = subject(store_with_checkpoints, 40).digest
    hot = open_store(store_with_checkpoints)
    assert lifecycle.validate(hot, RUN, 40)["ok"]
    lifecycle.expire(hot, RUN, 40, keep_records=True)
    assert records_of_step(store_with_checkpoints, 40)  # its validation record, kept
    tick(instance, resources)
    assert failure(store_with_checkpoints, digest)["run_id"] == failed.run_id


@pytest.mark.parametrize(
    "tags, why",
    [
        ({DIGEST_TAG: "not-a-digest"}, "its ckptflow/manifest_digest tag 'not-a-digest' is not a manifest's sha256"),
        ({DIGEST_TAG: "0" * 64}, "no commit of tinylm@40 has that digest"),
    ],
    ids=["malformed", "another-commit"],
)
def test_a_run_whose_digest_tag_names_no_commit_of_its_checkpoint_is_unattributed(
    store_with_checkpoints, resources, instance, tags, why
):
    """A digest tag set by hand (a relaunch with edited tags): a malformed one made the write
    raise ("cannot be recorded", no tag saying why); a well-formed one of no commit of the step
    wrote a failure record under a commit that does not exist."""
    instance.add_dynamic_partitions("checkpoints", [KEY])
    result = materialize([doomed], partition_key=KEY, instance=instance, raise_on_error=False, tags=tags)
    assert not result.success
    cursor = tick(instance, resources)
    assert cursor not in (None, "-1")
    assert why in instance.get_run_by_id(result.run_id).tags[UNATTRIBUTED_TAG]
    digest = subject(store_with_checkpoints, 40).digest
    assert failure(store_with_checkpoints, digest) is None
    assert [k for k in records_of_step(store_with_checkpoints, 40) if k.endswith("/failure.json")] == []


def counting(monkeypatch, instance, method: str) -> list[tuple]:
    """Every call of the real ``instance.<method>``, by its arguments (the reads a tick makes)."""
    calls: list[tuple] = []
    real = getattr(instance, method)

    def counted(*args, **kwargs):
        calls.append(args + tuple(kwargs.values()))
        return real(*args, **kwargs)

    monkeypatch.setattr(instance, method, counted)
    return calls


def test_a_tick_reads_each_later_runs_events_once(store_with_checkpoints, resources, instance, monkeypatch):
    """A tick that saw N failures of a partition read the events of every run begun after
    each of them: N failures then one re-run read 4+3+2+1 logs of successes (O(N x later
    runs)) and queried the runs three times per failure. Now each finished run's successes
    are read once per tick, the partition's runs once per failure (a run may begin while the
    tick goes on), and the records are the same."""
    failed = [evaluation_failed(instance, resources).run_id for _ in range(4)]
    rerun = materialize(PARTITIONED, partition_key=KEY, instance=instance, resources=resources, selection=[evaluation])
    assert rerun.success
    logs = counting(monkeypatch, instance, "all_logs")
    queries = counting(monkeypatch, instance, "get_run_records")
    tick(instance, resources)
    successes = [call[0] for call in logs if call[-1] == DagsterEventType.STEP_SUCCESS]
    assert sorted(successes) == sorted([*failed[1:], rerun.run_id])  # each later run once
    assert len(queries) <= 2 * len(failed)  # per failure, its partition's runs: by its tag, and by a range
    recorded = failure(store_with_checkpoints, subject(store_with_checkpoints, 40).digest)
    assert recorded["run_id"] == failed[-1] and recorded["made_good_already"] == ["evaluation"]
    assert needs_attention(store_with_checkpoints) is None


def test_a_re_run_that_succeeds_while_a_tick_goes_on_makes_the_failures_recorded_after_it_good(
    store_with_checkpoints, resources, instance
):
    """Two failures of the commit's evaluation in one tick's backlog; a re-run of it succeeds
    after the tick recorded the first and before the second (a tick of 200 failures reads the
    store for minutes). The tick read the partition's runs and their successes once, at the
    first failure: the second's record saw the re-run's evaluation as standing at the failure
    and no later run that wrote it, so it needed attention for good though the work was redone.
    What a failure's record counts is read for that failure, as each was before the cache."""
    first, second = (evaluation_failed(instance, resources) for _ in range(2))
    runs = TickRuns(instance)
    record_failure(runs, instance.get_run_by_id(first.run_id), resources["store"])
    rerun = materialize(PARTITIONED, partition_key=KEY, instance=instance, resources=resources, selection=[evaluation])
    assert rerun.success
    record_failure(runs, instance.get_run_by_id(second.run_id), resources["store"])
    recorded = failure(store_with_checkpoints, subject(store_with_checkpoints, 40).digest)
    assert recorded["run_id"] == second.run_id and recorded["made_good_already"] == ["evaluation"]
    assert needs_attention(store_with_checkpoints) is None
