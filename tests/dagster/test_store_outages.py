"""A store that does not answer is no verdict: the ``checkpoint`` asset and the scrub job
retry it, record no failed integrity check and overwrite no earlier verdict; evaluation,
compression and archival retry it too, and succeed once it answers."""

import pytest
from dagster import DagsterEventType, materialize

from assets import PARTITIONED, archived, checkpoint, checkpoint_key, compressed, evaluation
from ckptflow import lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.errors import ColdObjectError, StoreUnavailableError
from ckptflow.format.layout import manifest_key
from ckptflow.store import open_store
from pipelines.jobs import scrub_job
from resources import ArchiveResource, CheckpointStoreResource
from support.dagster import RUN, record
from support.faulty_store import FaultyStore

KEY = checkpoint_key(RUN, 20)


class Brownout:
    """Chunk reads of every store the resources open fail while ``failures`` lasts (-1: forever)."""

    def __init__(self, monkeypatch):
        self.failures = 0
        self.raised = 0
        opened = CheckpointStoreResource.open

        def open_flaky(resource):
            flaky = FaultyStore(opened(resource))
            flaky.fail_if = self.fail_if
            return flaky

        monkeypatch.setattr(CheckpointStoreResource, "open", open_flaky)

    def fail_if(self, op: str, key: str) -> bool:
        if key.startswith("chunks/") and self.failures != 0:
            self.failures -= self.failures > 0
            self.raised += 1
            raise StoreUnavailableError(f"S3 GetObject of {key} failed after 10 attempts: SlowDown")
        return False


@pytest.fixture
def brownout(monkeypatch):
    return Brownout(monkeypatch)


def quick(resources):
    """Retries without the production waits."""
    return {**resources, "store": CheckpointStoreResource(url=resources["store"].url, unavailable_wait_s=0)}


def events(result, kind):
    return [e for e in result.all_events if e.event_type == kind]


def test_validation_in_an_outage_is_retried_records_no_failed_check_and_passes_after(
    store_with_checkpoints, resources, instance, brownout
):
    instance.add_dynamic_partitions("checkpoints", [KEY])
    brownout.failures = -1
    run = materialize(
        PARTITIONED, partition_key=KEY, instance=instance, resources=quick(resources), selection=[checkpoint],
        raise_on_error=False,
    )  # fmt: skip
    assert not run.success and brownout.raised
    assert len(events(run, DagsterEventType.STEP_UP_FOR_RETRY)) == resources["store"].unavailable_retries
    assert run.get_asset_check_evaluations() == []  # the partition holds no failed integrity check
    [failure] = events(run, DagsterEventType.STEP_FAILURE)
    description = failure.step_failure_data.user_failure_data.description
    assert "could not verify" in description and open_store(store_with_checkpoints).url in description
    assert "SlowDown" in description and "integrity check blocked" not in description
    assert record(store_with_checkpoints, 20, "validation") is None  # the landing sensor would still ask

    brownout.failures = 1  # one more failed read, then the store answers: the retry passes in the same run
    run = materialize(
        PARTITIONED, partition_key=KEY, instance=instance, resources=quick(resources), selection=[checkpoint],
        raise_on_error=False,
    )  # fmt: skip
    assert run.success and len(events(run, DagsterEventType.STEP_UP_FOR_RETRY)) == 1
    [check] = run.get_asset_check_evaluations()
    assert check.passed
    assert record(store_with_checkpoints, 20, "validation")["ok"] is True


def scrub_everything(instance, resources):
    """A scrub job of every checkpoint, however young, with retries without the waits."""
    return scrub_job.execute_in_process(
        instance=instance,
        run_config={"ops": {"scrub_checkpoints": {"config": {"older_than_days": 0}}}},
        resources={"store": quick(resources)["store"], "archive": resources["archive"]},
        raise_on_error=False,
    )


def test_scrub_in_an_outage_is_retried_and_keeps_every_verdict(store_with_checkpoints, resources, instance, brownout):
    def scrub():
        return scrub_everything(instance, resources)

    assert scrub().success
    before = {step: record(store_with_checkpoints, step, "validation") for step in (10, 20, 30, 40)}
    assert all(r["ok"] is True for r in before.values())
    brownout.failures = -1
    result = scrub()
    assert not result.success and events(result, DagsterEventType.STEP_UP_FOR_RETRY)
    [failure] = events(result, DagsterEventType.STEP_FAILURE)
    assert "could not be read" in failure.step_failure_data.user_failure_data.description
    assert {step: record(store_with_checkpoints, step, "validation") for step in before} == before


@pytest.mark.parametrize(
    "asset, kind",
    [(evaluation, "evaluation"), (compressed, "compression"), (archived, "archive")],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_an_outage_while_evaluating_compressing_or_archiving_is_retried_and_passes_after(
    store_with_checkpoints, resources, instance, brownout, asset, kind
):
    instance.add_dynamic_partitions("checkpoints", [KEY])

    def attempt():
        return materialize(
            PARTITIONED, partition_key=KEY, instance=instance, resources=quick(resources), selection=[asset],
            raise_on_error=False,
        )  # fmt: skip

    brownout.failures = -1  # retried, then failed with what could not be read; nothing recorded
    run = attempt()
    assert not run.success
    assert len(events(run, DagsterEventType.STEP_UP_FOR_RETRY)) == resources["store"].unavailable_retries
    [failure] = events(run, DagsterEventType.STEP_FAILURE)
    assert "SlowDown" in failure.step_failure_data.user_failure_data.description
    assert record(store_with_checkpoints, 20, kind) is None

    brownout.failures, brownout.raised = 1, 0  # one more failed read, then the store answers: the retry passes
    run = attempt()
    assert run.success and brownout.raised == 1 and len(events(run, DagsterEventType.STEP_UP_FOR_RETRY)) == 1
    assert record(store_with_checkpoints, 20, kind) is not None


THAW = "ckptflow thaw s3://bucket/hot --run run --step 20"


def cold_hot_tier(monkeypatch, *, unavailable: str | None = None) -> list[str]:
    """The hot tier's chunks in a cold storage class (each read says how to thaw), and the
    object ``unavailable`` (if any) not answering; the cold chunks read, as they are read."""
    opened = CheckpointStoreResource.open
    cold_reads: list[str] = []

    def fail_if(op: str, key: str) -> bool:
        if key == unavailable and op == "get":
            raise StoreUnavailableError(f"{key}: SlowDown (simulated)")
        if key.startswith("chunks/") and op == "get":
            cold_reads.append(key)
            raise ColdObjectError(f"{key} is in DEEP_ARCHIVE and must be restored before it can be read: run `{THAW}`")
        return False

    def open_cold(resource):
        cold = FaultyStore(opened(resource))
        cold.fail_if = fail_if
        return cold

    monkeypatch.setattr(CheckpointStoreResource, "open", open_cold)
    return cold_reads


@pytest.mark.parametrize(
    "asset, kind",
    [(checkpoint, "validation"), (evaluation, "evaluation"), (compressed, "compression"), (archived, "archive")],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_cold_object_fails_the_step_at_once_with_the_thaw_instruction(
    store_with_checkpoints, resources, instance, monkeypatch, asset, kind
):
    """A thaw takes hours: a retry minutes later reads the same cold object, so the step
    is not retried; it fails with how to thaw, and records nothing (a cold object proves nothing)."""
    cold_reads = cold_hot_tier(monkeypatch)
    instance.add_dynamic_partitions("checkpoints", [KEY])
    run = materialize(
        PARTITIONED, partition_key=KEY, instance=instance, resources=quick(resources), selection=[asset],
        raise_on_error=False,
    )  # fmt: skip
    assert not run.success and cold_reads
    assert events(run, DagsterEventType.STEP_UP_FOR_RETRY) == []
    [failure] = events(run, DagsterEventType.STEP_FAILURE)
    assert THAW in failure.step_failure_data.user_failure_data.description
    assert run.get_asset_check_evaluations() == []
    assert record(store_with_checkpoints, 20, kind) is None


def failure_said(result) -> str:
    [failure] = events(result, DagsterEventType.STEP_FAILURE)
    assert not result.success
    return failure.step_failure_data.user_failure_data.description


def test_scrub_that_meets_a_cold_object_fails_at_once_with_the_thaw_instruction(
    store_with_checkpoints, resources, instance, monkeypatch
):
    """A hot checkpoint's chunks moved to a cold storage class: the scrub job retried them
    as an outage (each retry re-reading the whole tier to meet the same cold objects). It
    fails without retries now, saying how to thaw, and keeps every verdict."""
    assert scrub_everything(instance, resources).success
    before = {step: record(store_with_checkpoints, step, "validation") for step in (10, 20, 30, 40)}
    cold_hot_tier(monkeypatch)
    result = scrub_everything(instance, resources)
    assert events(result, DagsterEventType.STEP_UP_FOR_RETRY) == []
    description = failure_said(result)
    assert "4 checkpoint(s)" in description and "cold storage class" in description and THAW in description
    assert {step: record(store_with_checkpoints, step, "validation") for step in before} == before


def test_a_scrub_meeting_an_outage_and_a_cold_object_fails_saying_how_to_thaw(
    store_with_checkpoints, resources, instance, monkeypatch
):
    """An outage is retried; a cold object is not helped by it. With both in the hot tier
    the job retried and then failed with "could not be read" alone: the cold checkpoints'
    thaw instruction, the one thing an operator must do, was never said."""
    assert scrub_everything(instance, resources).success
    cold_hot_tier(monkeypatch, unavailable=manifest_key(RUN, 20))
    description = failure_said(scrub_everything(instance, resources))
    assert "could not be read" in description and "cold storage class" in description and THAW in description


def test_a_scrub_retried_after_an_outage_reads_again_only_what_it_had_not_verified(
    store_with_checkpoints, resources, instance, monkeypatch
):
    """Hot holds 10, 30 and 40; only the archive holds 20. Step 30's manifest does not
    answer once: the job retries. Each retry re-read both tiers from the start (every
    chunk of 10 and 40 again, and the archive's 20, archive reads billed per byte); the
    retry resumes now: it reads 30 alone, and the verdicts of the first attempt stand."""
    hot, arc = open_store(store_with_checkpoints), open_store(resources["archive"].url)
    assert lifecycle.archive(hot, arc, RUN, 20).ok
    lifecycle.expire(hot, RUN, 20, keep_records=True)
    chunks = {
        step: len(catalog.read_manifest(hot if step != 20 else arc, RUN, step).chunks) for step in (10, 20, 30, 40)
    }
    reads = {"hot": 0, "archive": 0}
    outage = [manifest_key(RUN, 30)]

    def counted(tier, opened):
        def fail_if(op: str, key: str) -> bool:
            if op == "get" and key in outage:
                outage.remove(key)
                raise StoreUnavailableError(f"{key}: SlowDown (simulated)")
            reads[tier] += op == "get" and key.startswith("chunks/")
            return False

        def open_counted(resource):
            store = FaultyStore(opened(resource))
            store.fail_if = fail_if
            return store

        return open_counted

    monkeypatch.setattr(CheckpointStoreResource, "open", counted("hot", CheckpointStoreResource.open))
    monkeypatch.setattr(ArchiveResource, "open", counted("archive", ArchiveResource.open))
    result = scrub_everything(instance, resources)
    assert result.success and len(events(result, DagsterEventType.STEP_UP_FOR_RETRY)) == 1
    assert reads == {"hot": chunks[10] + chunks[30] + chunks[40], "archive": chunks[20]}
    [output] = events(result, DagsterEventType.STEP_OUTPUT)
    metadata = output.event_specific_data.metadata
    assert metadata["hot_checked"].value == 3 and metadata["hot_resumed"].value == 2
    assert metadata["archive_checked"].value == 1 and metadata["archive_resumed"].value == 1
    assert all(record(store_with_checkpoints, step, "validation")["ok"] is True for step in (10, 30, 40))
