"""Each per-checkpoint operation as an orchestrator runs it on one landed checkpoint:
which tier to read, which commit the work is about, then the operation.

The tier: retention may have expired the hot copy, leaving the archive's
(``tiers.source_tier``); compression works on hot copies only, and archival has nothing
to do for a checkpoint the archive alone holds. The commit: before the work reads the
checkpoint, ``on_commit`` is told the digest of the commit it is about, so a failure is
recorded against that commit even if the step is committed again before anyone looks
(``lifecycle.attribution``); a commit record that cannot be read tells nothing (the
validation's own read reports why), and stops the other work before it begins. A commit
whose validation verdict failed is never evaluated, compressed or archived
(``FailedValidationError``, before anything is written): an orchestrator's blocking
check holds back only what it requests itself, not a materialization by hand or a
backfill. Lifecycle records go to the hot store whichever tier is read. Evaluators are
named by import path and loaded by the caller's ``load``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.tiers import holds_commit, source_tier
from ckptflow.catalog.verdicts import check_not_failed
from ckptflow.chunks.lossy import ArchiveCodec
from ckptflow.errors import CkptflowError
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.lifecycle.archive import ArchiveReport, Phase, archive
from ckptflow.lifecycle.compress import CompressionReport, compress
from ckptflow.lifecycle.evaluate import (
    TRAINER,
    EvaluationRule,
    Evaluator,
    evaluate,
    evaluator_errors,
)
from ckptflow.lifecycle.validate import validate
from ckptflow.store.base import Store

OnCommit = Callable[[str], None]  # told the manifest digest of the commit about to be processed
Progress = Callable[[int], None]  # told the bytes each piece of the work went over (see each operation)


def tell_commit(source: Store, run: str, step: int, on_commit: OnCommit) -> Manifest | None:
    """Tells ``on_commit`` the digest of the commit in ``source``; returns its manifest, or
    None when it cannot be read (the work's own read reports why)."""
    try:
        manifest = catalog.read_manifest(source, run, step)
    except (CkptflowError, OSError):
        return None
    on_commit(manifest.digest)
    return manifest


def admit_commit(source: Store, hot: Store, run: str, step: int, *, on_commit: OnCommit, work: str) -> Manifest:
    """Tell ``on_commit`` the commit in ``source``, then refuse (``FailedValidationError``) it
    if its validation verdict, recorded in ``hot`` for its digest, failed; returns the commit
    admitted. A commit record that cannot be read raises that read's error: an outage that
    passed before the work's own read would let the work go on with no commit admitted."""
    manifest = catalog.read_manifest(source, run, step)
    on_commit(manifest.digest)
    how = f"leave it: {work} waits for a passing validation of this commit"
    check_not_failed(hot, manifest, allow_failed=False, how_to_allow=how)
    return manifest


@dataclass(frozen=True)
class Validated:
    record: dict[str, Any]  # the validation verdict (``lifecycle.validate``)
    source: Store  # the tier that was verified
    manifest: Manifest | None  # its commit record, when it passed


def content_bytes(hot: Store, run: str, step: int, *, archive: Callable[[], Store] | None = None) -> int | None:
    """The content of the chunks of ``(run, step)`` (in the tier holding it, when
    ``archive`` is given; else in ``hot``): what the ``progress`` of its validation or
    compression counts up to, for a caller to show a percentage. None when its commit
    record cannot be read: the work's own read says why."""
    try:
        source = hot if archive is None else source_tier(hot, run, step, archive)
        return sum(catalog.read_manifest(source, run, step).chunks.values())
    except (CkptflowError, OSError):
        return None


def validate_checkpoint(
    hot: Store,
    run: str,
    step: int,
    *,
    archive: Callable[[], Store],
    on_commit: OnCommit,
    progress: Progress | None = None,
) -> Validated:
    """Verify ``(run, step)`` in the tier that holds it and record the verdict in ``hot``
    (``progress``: ``lifecycle.validate``'s). The commit the run pinned, the one verified and
    the one described must be one: a step committed again in between raises (the verdict
    recorded stays, under the digest it verified; the new commit gets a run of its own)."""
    source = source_tier(hot, run, step, archive)
    pinned = tell_commit(source, run, step, on_commit)
    record = validate(source, run, step, records=hot, progress=progress)
    manifest = catalog.read_manifest(source, run, step) if record["ok"] else None
    digests = {record["manifest_digest"]} - {""}
    digests |= {m.digest for m in (pinned, manifest) if m is not None}
    if len(digests) > 1:
        raise CkptflowError(
            f"run {run!r} step {step} in {source.url} was committed again while it was being validated (commits "
            f"{', '.join(sorted(d[:12] + '…' for d in digests))}); each commit's verdict is recorded under its own "
            "digest: validate the new commit (the landing sensor requests its run)"
        )
    return Validated(record, source, manifest)


def evaluate_checkpoint(
    hot: Store,
    run: str,
    step: int,
    *,
    archive: Callable[[], Store],
    on_commit: OnCommit,
    evaluator: str | None,
    load: Callable[[str], Evaluator],
    key: str,
    rule: EvaluationRule,
) -> dict[str, Any]:
    """Evaluate ``(run, step)`` in the tier that holds it with the run's ``evaluator``
    (None: the trainer's metrics) and record it in ``hot``. The evaluator's own error,
    loading it included, raises ``EvaluatorError`` (``evaluate.evaluator_errors``)."""
    source = source_tier(hot, run, step, archive)
    admitted = admit_commit(source, hot, run, step, on_commit=on_commit, work="its evaluation")
    with evaluator_errors(evaluator, fmt.checkpoint_name(run, step)):
        function = None if evaluator is None else load(evaluator)
        return evaluate(
            source, hot, run, step, function, evaluator_name=evaluator or TRAINER, key=key, rule=rule,
            archive=archive, commit=admitted.digest,
        )  # fmt: skip


def compress_checkpoint(
    hot: Store, run: str, step: int, *, archive: Store, on_commit: OnCommit, progress: Progress | None = None
) -> CompressionReport | None:
    """Compress the hot copy of ``(run, step)`` (``progress``: ``lifecycle.compress``'s);
    None when retention expired it and ``archive`` holds the checkpoint (the archive keeps
    its bytes as they are). A checkpoint neither tier holds goes on to its admission, whose
    read says it was never committed or was deleted: no success about what nobody holds."""
    if not holds_commit(hot, run, step) and holds_commit(archive, run, step):
        return None
    admitted = admit_commit(hot, hot, run, step, on_commit=on_commit, work="its compression")
    return compress(hot, run, step, progress=progress, commit=admitted.digest)


def archive_checkpoint(
    hot: Store,
    cold: Store,
    run: str,
    step: int,
    *,
    on_commit: OnCommit,
    codec: ArchiveCodec,
    evaluator: str | None,
    load: Callable[[str], Evaluator],
    key: str,
    progress: Progress | None = None,
    verifying: Phase | None = None,
) -> ArchiveReport | None:
    """Archive the hot copy of ``(run, step)`` into ``cold`` (``lifecycle.archive``; a
    lossy copy is scored by the run's ``evaluator``; ``progress`` is told the bytes of
    each chunk copied, ``verifying`` begins the re-read of the copy); None when the hot
    copy expired and ``cold`` holds the checkpoint (archived earlier)."""
    if not holds_commit(hot, run, step) and holds_commit(cold, run, step):
        return None
    admitted = admit_commit(hot, hot, run, step, on_commit=on_commit, work="its archival")
    function = None if evaluator is None else load(evaluator)
    return archive(
        hot,
        cold,
        run,
        step,
        progress,
        verifying=verifying,
        codec=codec,
        evaluator=function,
        evaluator_name=evaluator or TRAINER,
        key=key,
        commit=admitted.digest,
    )
