"""Which commit a failed run belongs to: the one it pinned, else a commit older than the
run itself, else none; and a store that does not answer decides nothing."""

import pytest

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import quarantine
from ckptflow.errors import StoreUnavailableError
from ckptflow.format import layout as fmt
from ckptflow.format.sealed import MAX_RECORD_BYTES
from ckptflow.lifecycle.attribution import CLOCK_SKEW_S, FailedRun, record_failure
from ckptflow.store import open_store
from support.corrupt import flip_byte, manifest_path
from support.faulty_store import FaultyStore
from support.states import tiny_state

RUN = "r"
KEY = fmt.checkpoint_name(RUN, 2)
STEPS = [("evaluation", "evaluator team.eval:score failed"), ("archived", "archive copy does not verify")]


@pytest.fixture
def root(tmp_path):
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN) as ck:
        ck.save(2, tiny_state())
    return root


def current(root: str):
    return catalog.read_manifest(open_store(root), RUN, 2)


def failure(root: str, digest: str) -> dict | None:
    return lifecycle.read_record(open_store(root), lifecycle.Subject(RUN, 2, digest), "failure")


def never_opened():
    raise AssertionError("a run about no checkpoint needs no store")


def test_the_reason_names_every_failed_step_or_says_none_failed():
    assert FailedRun("id", "job", STEPS).reason == (
        "evaluation: evaluator team.eval:score failed; archived: archive copy does not verify"
    )
    assert FailedRun("id", "job", []).reason == "run failed before any step failed"


@pytest.mark.parametrize("checkpoint", [None, "", "not-a-checkpoint"])
def test_a_run_about_no_checkpoint_is_recorded_nowhere(checkpoint):
    done = record_failure(FailedRun("id", "validate_checkpoint", STEPS, checkpoint=checkpoint), never_opened)
    assert done.unattributed is None
    assert ("names no checkpoint partition" if not checkpoint else "which is not a checkpoint name") in done.message


def test_a_pinned_commit_gets_the_failure_even_after_the_step_was_committed_again(root):
    pinned = current(root).digest
    store = open_store(root)  # proved damaged, its manifest moved aside, as a save of the step does then
    quarantine.move_aside(store, RUN, 2, *store.get_versioned(fmt.manifest_key(RUN, 2), MAX_RECORD_BYTES))
    with Checkpointer(root, RUN) as ck:
        ck.save(2, tiny_state())
    assert current(root).digest != pinned  # an earlier commit of the step, since replaced
    failed = FailedRun("id", "evaluation_job", STEPS, checkpoint=KEY, digest=pinned, started_at=0.0)
    done = record_failure(failed, lambda: open_store(root))
    assert done.unattributed is None and done.message.startswith(f"recorded the failure of run id for {KEY}")
    record = failure(root, pinned)
    assert {k: record[k] for k in ("run_id", "job", "steps", "message")} == {
        "run_id": "id",
        "job": "evaluation_job",
        "steps": ["evaluation", "archived"],
        "message": failed.reason,
    }
    assert failure(root, current(root).digest) is None


def test_an_unpinned_run_gets_the_current_commit_only_if_that_is_older_than_the_run(root):
    manifest = current(root)
    late = FailedRun("late", "job", STEPS, checkpoint=KEY, started_at=manifest.created_at + CLOCK_SKEW_S - 1)
    done = record_failure(late, lambda: open_store(root))
    assert "committed (again) after it started" in done.unattributed
    assert failure(root, manifest.digest) is None
    unknown = FailedRun("unknown", "job", STEPS, checkpoint=KEY, started_at=None)
    assert "committed (again) after it started" in record_failure(unknown, lambda: open_store(root)).unattributed
    after = FailedRun("after", "job", STEPS, checkpoint=KEY, started_at=manifest.created_at + CLOCK_SKEW_S + 1)
    assert record_failure(after, lambda: open_store(root)).unattributed is None
    assert failure(root, manifest.digest)["run_id"] == "after"


def test_an_unreadable_commit_record_leaves_the_failure_unattributed(root):
    flip_byte(manifest_path(root, RUN, 2))
    done = record_failure(FailedRun("id", "job", STEPS, checkpoint=KEY, started_at=1e12), lambda: open_store(root))
    assert done.unattributed.startswith("its commit record cannot be read")
    assert KEY in done.message and "not recorded against a commit" in done.message


def test_a_store_that_does_not_answer_decides_nothing(root):
    store = FaultyStore(open_store(root))

    def unavailable(op, key):
        raise StoreUnavailableError(f"{op} {key}: SlowDown")

    store.fail_if = unavailable
    with pytest.raises(StoreUnavailableError):
        record_failure(FailedRun("id", "job", STEPS, checkpoint=KEY, started_at=1e12), lambda: store)
    assert failure(root, current(root).digest) is None


SKEW_S = 300.0  # a validation worker's clock 5 minutes off the orchestrator's


def _made_good(root: str) -> bool:
    from ckptflow.reports.recoverable import made_good

    subject = lifecycle.Subject.of(current(root))
    records = {kind: lifecycle.read_record(open_store(root), subject, kind) for kind in ("failure", "validation")}
    return made_good(records["failure"], {k: v for k, v in records.items() if v is not None})


def _validated_by_clock(root: str, clock: float) -> None:
    lifecycle.write_record(
        open_store(root), lifecycle.Subject.of(current(root)), "validation", {"ok": True, "recorded_at": clock}
    )


def test_a_verdict_written_before_the_failure_by_a_clock_running_ahead_does_not_make_it_good(root):
    """A validation passed at t=1000 on a worker whose clock ran 5 minutes ahead (recorded
    at 1300); a re-validation failed at t=1100 by the orchestrator's clock. Comparing the two
    clocks, the old verdict looked later than the failure: the failure counted as made good
    and the checkpoint no longer needed attention, though no run had redone the work."""
    _validated_by_clock(root, 1000.0 + SKEW_S)
    failed = FailedRun("id", "job", [("checkpoint", "chunk hash")], checkpoint=KEY, digest=current(root).digest,
                       failed_at=1100.0, made_good_by=("validation",))  # fmt: skip
    record_failure(failed, lambda: open_store(root))
    assert not _made_good(root)
    _validated_by_clock(root, 1250.0 + SKEW_S)  # a re-run after the failure was recorded, on that worker again
    assert _made_good(root)


def test_a_verdict_written_after_the_failure_by_a_clock_running_behind_makes_it_good(root):
    """The re-run after the failure (t=1200) ran on a worker whose clock is 5 minutes behind
    (recorded at 900): compared with the failure's time (1100) it looked older, so no re-run
    on that worker could ever make the failure good."""
    failed = FailedRun("id", "job", [("checkpoint", "chunk hash")], checkpoint=KEY, digest=current(root).digest,
                       failed_at=1100.0, made_good_by=("validation",))  # fmt: skip
    record_failure(failed, lambda: open_store(root))
    assert not _made_good(root)
    _validated_by_clock(root, 1200.0 - SKEW_S)
    assert _made_good(root)


def test_a_verdict_a_later_run_wrote_before_the_failure_was_recorded_makes_it_good(root):
    """The sensor recorded the failure late, after a re-run (begun after the failed run, by
    the orchestrator's order) had written the verdict: that verdict is the re-run's."""
    _validated_by_clock(root, 1200.0 - SKEW_S)
    failed = FailedRun("id", "job", [("checkpoint", "chunk hash")], checkpoint=KEY, digest=current(root).digest,
                       failed_at=1100.0, made_good_by=("validation",),
                       made_good_already={current(root).digest: ("validation",)})  # fmt: skip
    record_failure(failed, lambda: open_store(root))
    assert _made_good(root)


def test_a_pinned_commit_retention_expired_since_gets_no_record(root):
    """The failure read after retention expired the commit (a lagging or replaying sensor):
    its ``failure.json`` was written under the deleted step, the only object left of it."""
    pinned = current(root).digest
    lifecycle.expire(open_store(root), RUN, 2)
    failed = FailedRun("id", "evaluation_job", STEPS, checkpoint=KEY, digest=pinned, started_at=0.0)
    done = record_failure(failed, lambda: open_store(root))
    assert done.unattributed is None  # it was about that commit, which is gone
    assert f"not recorded: commit {pinned[:12]}… was expired by retention since" in done.message
    assert failure(root, pinned) is None and not list(open_store(root).list("lifecycle/"))
