"""The per-checkpoint operations as an orchestrator runs them: the tier read, the commit
told before the work, the skips of an expired hot copy, the refusal of a commit that
failed validation, the evaluator policy."""

import importlib
import os

import pytest

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.verdicts import Subject, read_record
from ckptflow.chunks.lossy import ArchiveCodec
from ckptflow.errors import CkptflowError, EvaluatorError, FailedValidationError, StoreUnavailableError
from ckptflow.format import layout as fmt
from ckptflow.lifecycle import EvaluationRule
from ckptflow.store import open_store
from support.corrupt import corrupt_chunk, flip_byte, manifest_path
from support.states import tiny_state

RUN = "r"
per_checkpoint = importlib.import_module("ckptflow.lifecycle.per_checkpoint")


@pytest.fixture
def tiers(tmp_path):
    """Steps 1, 2, 3 in the hot store; step 1 archived and its hot copy expired."""
    hot, arc = open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "archive"))
    with Checkpointer(hot, RUN) as ck:
        for step in (1, 2, 3):
            ck.save(step, tiny_state(seed=step), metadata={"val_loss": 1.0 / step, "train_loss": 2.0 / step})
    assert lifecycle.archive(hot, arc, RUN, 1).ok
    lifecycle.expire(hot, RUN, 1, keep_records=True)
    return hot, arc


def digest(store, step):
    return catalog.read_manifest(store, RUN, step).digest


def told():
    digests: list[str] = []
    return digests, digests.append


def test_validation_reads_the_tier_holding_the_checkpoint_and_records_in_the_hot_store(tiers):
    hot, arc = tiers
    digests, on_commit = told()
    archived = lifecycle.validate_checkpoint(hot, RUN, 1, archive=lambda: arc, on_commit=on_commit)
    assert archived.source is arc and archived.record["tier"] == arc.url and archived.manifest is not None
    assert digests == [digest(arc, 1)]
    assert lifecycle.read_record(hot, lifecycle.Subject.of(archived.manifest), "validation")["ok"] is True
    fresh = lifecycle.validate_checkpoint(hot, RUN, 2, archive=lambda: arc, on_commit=on_commit)
    assert fresh.source is hot and fresh.manifest.digest == digest(hot, 2)


def test_a_corrupt_checkpoint_is_told_and_fails_without_a_manifest(tiers, tmp_path):
    hot, arc = tiers
    corrupt_chunk(tmp_path / "hot", RUN, 3)
    digests, on_commit = told()
    validated = lifecycle.validate_checkpoint(hot, RUN, 3, archive=lambda: arc, on_commit=on_commit)
    assert validated.manifest is None and not validated.record["ok"] and validated.record["problems"]
    assert digests == [digest(hot, 3)]  # its failure belongs to this commit


def test_an_unreadable_commit_record_is_not_told(tiers, tmp_path):
    hot, arc = tiers
    flip_byte(manifest_path(tmp_path / "hot", RUN, 3))
    digests, on_commit = told()
    validated = lifecycle.validate_checkpoint(hot, RUN, 3, archive=lambda: arc, on_commit=on_commit)
    assert digests == [] and validated.manifest is None and not validated.record["ok"]


def files(root) -> dict[str, tuple[int, int]]:
    return {
        os.path.join(d, f): (os.stat(os.path.join(d, f)).st_size, os.stat(os.path.join(d, f)).st_mtime_ns)
        for d, _, names in os.walk(root)
        for f in names
    }


def test_a_commit_that_failed_validation_is_neither_evaluated_compressed_nor_archived(tiers, tmp_path):
    """Materialized by hand or by a backfill, where no blocking check stands in the way:
    each refuses with the verdict, after telling its commit, and writes nothing."""
    hot, arc = tiers
    corrupt_chunk(tmp_path / "hot", RUN, 3)
    assert not lifecycle.validate(hot, RUN, 3)["ok"]
    before = files(tmp_path)
    digests, on_commit = told()

    def load(path):
        raise AssertionError("no evaluator is configured")

    works = {  # the trainer's metrics: no chunk read that could fail on the damage
        "evaluation": lambda: lifecycle.evaluate_checkpoint(
            hot, RUN, 3, archive=lambda: arc, on_commit=on_commit, evaluator=None, load=load,
            key="model", rule=EvaluationRule(),
        ),
        "compression": lambda: lifecycle.compress_checkpoint(hot, RUN, 3, archive=arc, on_commit=on_commit),
        "archival": lambda: lifecycle.archive_checkpoint(
            hot, arc, RUN, 3, on_commit=on_commit, codec=ArchiveCodec.parse("exact"), evaluator=None, load=load,
            key="model",
        ),
    }  # fmt: skip
    for what, work in works.items():
        with pytest.raises(FailedValidationError, match=rf"run '{RUN}' step 3 failed validation .*its {what} waits"):
            work()
    assert files(tmp_path) == before
    assert digests == [digest(hot, 3)] * 3


def test_an_expired_hot_copy_is_not_compressed(tiers):
    hot, arc = tiers
    digests, on_commit = told()
    assert lifecycle.compress_checkpoint(hot, RUN, 1, archive=arc, on_commit=on_commit) is None
    assert digests == []
    report = lifecycle.compress_checkpoint(hot, RUN, 2, archive=arc, on_commit=on_commit)
    assert report is not None and report.chunks > 0 and digests == [digest(hot, 2)]


def test_a_checkpoint_neither_tier_holds_is_an_error_not_a_skipped_compression(tiers):
    """Hot copy expired and never archived (or a step never committed): compression
    returned None, "retention expired it, the archive keeps its bytes", so the compressed
    asset reported success about a checkpoint nobody holds. Now its admission says so."""
    hot, arc = tiers
    lifecycle.expire(hot, RUN, 2, keep_records=True)  # step 2 was never archived
    assert not arc.exists(fmt.manifest_key(RUN, 2))
    digests, on_commit = told()
    for step in (2, 99):
        with pytest.raises(CkptflowError, match=rf"no manifest at .*{step:012d}.*never committed \(or was deleted\)"):
            lifecycle.compress_checkpoint(hot, RUN, step, archive=arc, on_commit=on_commit)
    assert digests == []


def test_archival_skips_what_the_archive_alone_holds_and_loads_the_runs_evaluator(tiers):
    hot, arc = tiers
    loaded: list[str] = []

    def load(path):
        loaded.append(path)
        return lambda tensors, info: {"score": 1.0}

    def run(step, evaluator):
        return lifecycle.archive_checkpoint(
            hot, arc, RUN, step, on_commit=lambda d: None, codec=ArchiveCodec.parse("exact"),
            evaluator=evaluator, load=load, key="model",
        )  # fmt: skip

    assert run(1, "team.eval:score") is None and loaded == []
    assert run(2, None).ok and loaded == []
    assert run(3, "team.eval:score").ok and loaded == ["team.eval:score"]
    assert catalog.read_manifest(arc, RUN, 3).digest == digest(hot, 3)


def evaluate(hot, arc, step, evaluator, load):
    return lifecycle.evaluate_checkpoint(
        hot, RUN, step, archive=lambda: arc, on_commit=lambda d: None, evaluator=evaluator, load=load,
        key="model", rule=EvaluationRule(),
    )  # fmt: skip


def test_evaluation_without_an_evaluator_is_the_trainers_metrics(tiers):
    hot, arc = tiers

    def load(path):
        raise AssertionError("no evaluator is configured")

    record = evaluate(hot, arc, 1, None, load)  # the archive's copy
    assert record["source"] == "trainer" and record["metrics"] == {"val_loss": 1.0, "train_loss": 2.0}


def test_evaluation_compares_with_an_older_step_only_the_archive_holds(tiers):
    """Step 1's current commit is the archive's (its hot copy expired): step 2 compares
    with its evaluation."""
    hot, arc = tiers

    def load(path):
        raise AssertionError("no evaluator is configured")

    evaluate(hot, arc, 1, None, load)
    record = evaluate(hot, arc, 2, None, load)
    assert (record["previous_step"], record["improvement"]) == (1, pytest.approx(0.5))


def test_an_evaluator_that_raises_or_cannot_be_loaded_fails_with_one_line(tiers):
    hot, arc = tiers

    def broken(tensors, info):
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(EvaluatorError, match=rf"evaluator team.eval:score failed on {fmt.checkpoint_name(RUN, 2)}: "):
        evaluate(hot, arc, 2, "team.eval:score", lambda path: broken)

    def missing(path):
        raise ModuleNotFoundError("No module named 'team'")

    with pytest.raises(EvaluatorError, match="ModuleNotFoundError: No module named 'team'"):
        evaluate(hot, arc, 2, "team.eval:score", missing)
    record = evaluate(hot, arc, 2, "team.eval:score", lambda path: lambda tensors, info: {"val_loss": 0.25})
    assert record["evaluator"] == "team.eval:score" and record["metrics"] == {"val_loss": 0.25}


def counted():
    calls: list[int] = []  # list.append: safe from the verifying threads
    return calls, calls.append


def test_progress_adds_up_to_what_each_operation_reports(tiers):
    """The callbacks an orchestrator logs progress with: validation and compression
    count each chunk's content, toward the total ``content_bytes`` gives up front;
    archival counts the bytes it copies."""
    hot, arc = tiers
    assert lifecycle.content_bytes(hot, RUN, 1) is None  # expired from hot: the archive holds it
    assert lifecycle.content_bytes(hot, RUN, 1, archive=lambda: arc) == sum(
        catalog.read_manifest(arc, RUN, 1).chunks.values()
    )
    calls, progress = counted()
    record = lifecycle.validate_checkpoint(
        hot, RUN, 1, archive=lambda: arc, on_commit=lambda d: None, progress=progress
    ).record
    assert sum(calls) == record["bytes_checked"] == lifecycle.content_bytes(hot, RUN, 1, archive=lambda: arc) > 0
    assert len(calls) == record["chunks_checked"]
    calls, progress = counted()
    compressed = lifecycle.compress_checkpoint(hot, RUN, 2, archive=arc, on_commit=lambda d: None, progress=progress)
    assert sum(calls) == compressed.bytes_raw == lifecycle.content_bytes(hot, RUN, 2) > compressed.bytes_after
    calls, progress = counted()
    archived = lifecycle.archive_checkpoint(
        hot, arc, RUN, 2, on_commit=lambda d: None, codec=ArchiveCodec.parse("exact"), evaluator=None,
        load=lambda path: None, key="model", progress=progress,
    )  # fmt: skip
    assert archived.chunks_copied > 0 and sum(calls) == archived.bytes_copied and len(calls) == archived.chunks_copied


def test_a_step_committed_again_while_it_is_validated_fails_the_run_pinned_to_the_first(tiers, tmp_path, monkeypatch):
    """The run pinned commit A (its tag, its failure record); the job saved the step again (B)
    while it verified. It returned B's verdict and manifest as the materialization of the
    run about A: the partition's metadata described a commit the run was not about."""
    hot, arc = tiers
    corrupt_chunk(tmp_path / "hot", RUN, 3)
    first = digest(hot, 3)
    real = per_checkpoint.validate

    def saved_again_meanwhile(store, run, step, **kwargs):
        with Checkpointer(hot, RUN) as ck:  # the job resumes past the damaged step, then saves it anew
            assert ck.restore(tiny_state(seed=0)).step == 2
            ck.save(3, tiny_state(seed=30))
        return real(store, run, step, **kwargs)

    monkeypatch.setattr(per_checkpoint, "validate", saved_again_meanwhile)
    pinned, on_commit = told()
    with pytest.raises(CkptflowError, match="committed again while it was being validated"):
        lifecycle.validate_checkpoint(hot, RUN, 3, archive=lambda: arc, on_commit=on_commit)
    assert pinned == [first] and digest(hot, 3) != first
    assert lifecycle.validate(hot, RUN, 3)["ok"]  # the new commit's own verdict


WORKS = {
    "evaluation": lambda hot, arc, on_commit: lifecycle.evaluate_checkpoint(
        hot, RUN, 3, archive=lambda: arc, on_commit=on_commit, evaluator=None, load=None, key="model",
        rule=EvaluationRule(),
    ),
    "compression": lambda hot, arc, on_commit: lifecycle.compress_checkpoint(
        hot, RUN, 3, archive=arc, on_commit=on_commit
    ),
    "archival": lambda hot, arc, on_commit: lifecycle.archive_checkpoint(
        hot, arc, RUN, 3, on_commit=on_commit, codec=ArchiveCodec(), evaluator=None, load=None, key="model"
    ),
}  # fmt: skip


@pytest.mark.parametrize("work", sorted(WORKS))
def test_a_step_committed_again_after_its_admission_is_left_alone(tiers, tmp_path, monkeypatch, work):
    """Admitted as commit A (its validation not failed); saved again (B) before the work read
    it: B, whose validation nobody had looked at, was evaluated, compressed or archived,
    and recorded, by the run pinned to A."""
    hot, arc = tiers
    corrupt_chunk(tmp_path / "hot", RUN, 3)
    real = per_checkpoint.admit_commit

    def saved_again_after(*args, **kwargs):
        admitted = real(*args, **kwargs)
        with Checkpointer(hot, RUN) as ck:
            assert ck.restore(tiny_state(seed=0)).step == 2
            ck.save(3, tiny_state(seed=30), metadata={"val_loss": 0.1})
        return admitted

    monkeypatch.setattr(per_checkpoint, "admit_commit", saved_again_after)
    pinned, on_commit = told()
    with pytest.raises(CkptflowError, match=f"committed again since it was admitted for {work}"):
        WORKS[work](hot, arc, on_commit)
    assert len(pinned) == 1 and pinned[0] != digest(hot, 3)
    record = {"evaluation": "evaluation", "compression": "compression", "archival": "archive"}[work]
    assert read_record(hot, Subject(RUN, 3, digest(hot, 3)), record) is None
    assert not arc.exists(fmt.manifest_key(RUN, 3))


@pytest.mark.parametrize("work", sorted(WORKS))
def test_a_commit_record_unread_at_admission_is_not_worked_on(tiers, monkeypatch, work):
    """Admission's read of the commit record met an outage that passed before the work's
    own read: the work went on with no commit admitted, so a commit whose validation
    failed was evaluated, compressed or archived (and recorded), its run pinned to none."""
    hot, arc = tiers
    lifecycle.write_record(hot, Subject(RUN, 3, digest(hot, 3)), "validation", {"ok": False, "problems": ["bad"]})
    real, calls = catalog.read_manifest, []

    def outage_once(store, run, step):
        calls.append(step)
        if len(calls) == 1:
            raise StoreUnavailableError("S3 GetObject failed after 10 attempts: SlowDown")
        return real(store, run, step)

    monkeypatch.setattr(catalog, "read_manifest", outage_once)
    pinned, on_commit = told()
    with pytest.raises(StoreUnavailableError):
        WORKS[work](hot, arc, on_commit)
    monkeypatch.undo()
    record = {"evaluation": "evaluation", "compression": "compression", "archival": "archive"}[work]
    assert read_record(hot, Subject(RUN, 3, digest(hot, 3)), record) is None
    assert not arc.exists(fmt.manifest_key(RUN, 3)) and pinned == []
