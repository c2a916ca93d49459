"""Evaluation: score a checkpoint, compare it with the previous one, flag overfitting.

An evaluator is any ``evaluate(state_dict, info) -> {metric: float}``; which one scores
a run is the caller's choice (the Dagster resource maps run names to evaluators). A
checkpoint with no evaluator is evaluated from the metrics the trainer recorded at save
time (``Checkpointer.save(..., metadata={"val_loss": ...})``), marked as such.

The improvement and the overfitting flag compare with the evaluation of the nearest
older step's current commit (a record of a commit it no longer holds describes no
checkpoint), and only if the same evaluator made it: two evaluators' figures are not on
one scale, and a backfill with a new evaluator would otherwise give figures that depend
on the order its runs happened to take. Otherwise there is no improvement figure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.verdicts import Subject, previous_record, read_record, write_record
from ckptflow.errors import CkptflowError, EvaluatorError, ObjectNotFoundError, ObjectTooLargeError
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.format.sealed import MAX_RECORD_BYTES
from ckptflow.policy.scores import finite, scores
from ckptflow.store.base import Store

Evaluator = Callable[[Mapping[str, Any], Mapping[str, Any]], Mapping[str, float]]
TRAINER = "trainer metrics"


@dataclass(frozen=True)
class EvaluationRule:
    """Which metric says "better" (``mode`` min or max) and which one is the training
    metric for the overfitting rule: validation got worse while training got better."""

    val_metric: str = "val_loss"
    train_metric: str = "train_loss"
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")

    def improvement(self, previous: float, current: float) -> float:
        """Positive when ``current`` is better than ``previous``."""
        return previous - current if self.mode == "min" else current - previous


def numeric(values: Mapping[str, Any]) -> dict[str, float]:
    """The scores among ``values`` (``ckptflow.policy.scores.is_score``), as floats."""
    return {str(k): float(v) for k, v in finite(values).items()}


@contextmanager
def evaluator_errors(evaluator: str | None, checkpoint: str) -> Iterator[None]:
    """Around loading and running the evaluator named ``evaluator`` on ``checkpoint``:
    an error of the evaluator's (anyone's code) becomes ``EvaluatorError``, one line
    naming the evaluator, the checkpoint and the error, which fails that checkpoint's
    evaluation and is not worth retrying. ckptflow's own errors (reading the checkpoint
    failed: they say what and where) pass through unchanged, and so does every error
    when no evaluator is configured (``None``: the trainer's metrics are the evaluation)."""
    try:
        yield
    except Exception as e:
        if evaluator is None or isinstance(e, CkptflowError):
            raise
        raise EvaluatorError(f"evaluator {evaluator} failed on {checkpoint}: {type(e).__name__}: {e}"[:2000]) from e


def score(source: Store, manifest: Manifest, evaluator: Evaluator, key: str = "model") -> dict[str, float]:
    """``evaluator``'s metrics for the ``key`` tensors of the commit ``manifest`` (every
    chunk verified). The tensors are read by ``(run, step)``: a step committed again
    after ``manifest`` was read would be scored under its digest, so that raises."""
    from ckptflow.interop.export import load_tensors  # torch only where a model is scored

    tensors, loaded = load_tensors(source, manifest.run, manifest.step, prefix=key.rstrip(".") + ".")
    if loaded.digest != manifest.digest:
        raise CkptflowError(
            f"run {manifest.run!r} step {manifest.step} in {source.url} was committed again while it was being "
            f"evaluated (manifest {manifest.digest[:12]}… is now {loaded.digest[:12]}…); nothing was recorded: "
            "evaluate the new commit"
        )
    info = {
        "run": manifest.run,
        "step": manifest.step,
        "manifest_digest": manifest.digest,
        "metadata": dict(manifest.metadata),
    }
    return numeric(evaluator(tensors, info))


def commit_digest(store: Store, run: str, step: int) -> str | None:
    """The digest of the commit record ``store`` holds at ``(run, step)``; None when it
    holds none, or one larger than any record (a read that fails otherwise is raised)."""
    try:
        return fmt.digest_of(store.get_bounded(fmt.manifest_key(run, step), MAX_RECORD_BYTES))
    except (ObjectNotFoundError, ObjectTooLargeError):
        return None


def evaluate(
    source: Store,
    records: Store,
    run: str,
    step: int,
    evaluator: Evaluator | None = None,
    *,
    evaluator_name: str = "",
    key: str = "model",
    rule: EvaluationRule = EvaluationRule(),
    archive: Callable[[], Store] | None = None,
    commit: str | None = None,
) -> dict[str, Any]:
    """Evaluate ``(run, step)`` held in ``source`` and record it in ``records`` (the hot store).

    With ``evaluator``, the ``key`` entry's tensors are loaded (every chunk verified) and
    scored; without, the trainer's recorded metrics (the commit's metadata, then those its
    ``trainer`` record adds: a Lightning validation after the commit) are the evaluation. The record holds
    the metrics, the improvement of ``rule.val_metric`` over the nearest older evaluated
    checkpoint (the commit an older step of ``run`` holds now: in ``records``, else
    ``source``, else ``archive`` (called to open it, only then)), whether
    that looks like overfitting, and the ``tier`` it was read from
    (the archive, once retention expired the hot copy).

    ``commit``: the digest of the commit the caller admitted (its validation not failed);
    another one there now (the step committed again since) raises before anything is scored.
    """
    manifest = catalog.read_admitted(source, run, step, commit, "evaluation")
    reported = read_record(records, Subject.of(manifest), "trainer") or {}  # scores reported after the commit
    trainer = numeric(scores(manifest.metadata, {"trainer": reported}))  # the rule Best ranks by
    if evaluator is None:
        metrics, by = trainer, TRAINER
    else:
        metrics, by = score(source, manifest, evaluator, key), evaluator_name or "evaluator"
    train = trainer.get(rule.train_metric)

    def held_now(older: int) -> str | None:
        found = commit_digest(records, run, older) or commit_digest(source, run, older)
        return found or (commit_digest(archive(), run, older) if archive is not None else None)

    previous = previous_record(records, run, step, "evaluation", current=held_now)
    if previous is not None and previous[1].get("evaluator") != by:
        previous = None  # another evaluator's figures: not on this one's scale
    improvement = overfitting = None
    if previous and rule.val_metric in metrics and rule.val_metric in (previous[1].get("metrics") or {}):
        improvement = rule.improvement(previous[1]["metrics"][rule.val_metric], metrics[rule.val_metric])
        prev_train = previous[1].get("train")
        overfitting = bool(improvement < 0 and train is not None and prev_train is not None and train < prev_train)
    return write_record(
        records,
        Subject.of(manifest),
        "evaluation",
        {
            "metrics": metrics,
            "train": train,
            "evaluator": by,
            "source": "trainer" if evaluator is None else "evaluator",
            "previous_step": previous[0] if previous else None,
            "improvement": improvement,
            "overfitting": overfitting,
            "val_metric": rule.val_metric,
            "tier": source.url,
        },
    )
