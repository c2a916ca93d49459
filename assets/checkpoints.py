"""Per-checkpoint assets: the validated checkpoint (with its blocking integrity check),
evaluation, compression and archival. Each body is a few lines over the library.

Flow. The landing sensor adds a partition and requests ``checkpoint`` for it.
``checkpoint`` materializes only a checkpoint that passed its integrity check: a corrupt
one records the failed check (with the exact problem) and then fails the step, so its
partition is *Failed* on the asset's Partitions tab and in the graph's partition
counts, while every good checkpoint is *Materialized*. A store that could not be read
proves nothing: the step is retried later (``CheckpointStoreResource.retrying_outages``)
and no check result or verdict is recorded; so are evaluation, compression and archival
in an outage (an evaluator's own error fails its partition, never retried). The check is declared on the
asset (``check_specs``) because the same verification decides both.

Everything downstream follows by declarative automation: ``AutomationCondition.eager()``
AND "every blocking check of my dependencies passed", so a corrupt checkpoint is never
evaluated, compressed or archived. Evaluation and archival are requested by two
automation sensors (``pipelines/definitions.py``), so they run in separate runs: a
failing evaluator fails its own run and partition, never the compression and archival
of the same checkpoint.

Backfills: every partitioned asset carries ``BackfillPolicy.multi_run(1)``: one run per
checkpoint, so each partition gets its own metadata (which is what Dagster plots
across partitions) and the runs spread over the run queue's concurrency.

Verdicts are also written to the store as lifecycle records (``ckptflow.lifecycle``),
so the inventory and retention read them without querying Dagster's event log. Each
run is tagged with the digest of the commit it processes (``pin_commit``), so its
failure is recorded against that commit.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypedDict

from dagster import (
    AssetCheckKey,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetObservation,
    AutomationCondition,
    BackfillPolicy,
    DynamicPartitionsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from assets.metadata import bullet_list, metrics, ratio, size, throughput
from assets.partitions import checkpoints_partitions, parse_checkpoint_key, pin_commit
from assets.progress import ProgressLog, logged_phase, logged_progress
from ckptflow import lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.errors import EvaluatorError, FailedValidationError
from ckptflow.format import layout as fmt
from ckptflow.lifecycle import EvaluationRule
from ckptflow.reports import recoverable
from ckptflow.reports.units import human_bytes
from resources import ArchiveTierResource, CheckpointStoreResource, EvaluatorResource
from resources.evaluator import load_function

GROUP = "checkpoints"
BACKFILL = BackfillPolicy.multi_run(max_partitions_per_run=1)
DOWNSTREAM = (AutomationCondition.eager() & AutomationCondition.all_deps_blocking_checks_passed()).with_label(
    "eager, once the checkpoint's integrity check passed"
)


class _PerCheckpoint(TypedDict):
    """The arguments every per-checkpoint asset is declared with (typed, so ``@asset`` checks them)."""

    partitions_def: DynamicPartitionsDefinition
    group_name: str
    backfill_policy: BackfillPolicy
    kinds: set[str]


_COMMON = _PerCheckpoint(
    partitions_def=checkpoints_partitions, group_name=GROUP, backfill_policy=BACKFILL, kinds={"ckptflow"}
)

INTEGRITY = AssetCheckSpec(
    "integrity",
    asset="checkpoint",
    blocking=True,
    partitions_def=checkpoints_partitions,
    description="Manifest checksum and structure, every rank record, every chunk present and matching its hash.",
)
INTEGRITY_KEY = AssetCheckKey(AssetKey("checkpoint"), INTEGRITY.name)


def _describe(manifest) -> dict:
    info = catalog.CheckpointInfo.from_manifest(manifest)
    described = {
        "run": info.run,
        "step": str(info.step),
        "kind": info.kind,
        "world_size": str(info.world_size),
        **size("logical", info.logical_bytes),
        **size("stored", info.stored_bytes),
        "chunks": MetadataValue.int(info.chunks),
        "created_at": MetadataValue.timestamp(info.created_at),
        "manifest_digest": manifest.digest,
        **metrics(info.metadata, prefix=f"{info.run}/trainer/"),  # per run: one plotted line each
    }
    described.update(_lineage(info.metadata))
    if info.kind == "incremental" and info.base_step is not None:
        described["written_after"] = (
            f"step {info.base_step}: chunks unchanged since that checkpoint were reused, not rewritten"
        )
    return described


def _reason_metadata(reason: recoverable.Reason) -> dict[str, MetadataValue]:
    """Why a checkpoint failed its integrity check, as one-line text fields (no Markdown to open)."""
    return {
        "reason": MetadataValue.text(reason.line()),
        "failed_check": MetadataValue.text(f"integrity: {reason.check}"),
        "chunk": MetadataValue.text(f"{reason.chunk}…" if reason.chunk else "-"),
    }


@contextmanager
def _refusing_failed_commits() -> Iterator[None]:
    """A commit whose validation failed fails the partition with the verdict, never retried:
    a blocking check holds back what the automation requests, not a materialization by
    hand or a backfill, so the library refuses it (``lifecycle.per_checkpoint``)."""
    try:
        yield
    except FailedValidationError as e:
        raise Failure(description=str(e), allow_retries=False) from None


def _lineage(trainer: dict) -> dict:
    """The run's declared lineage (``ckptflow.RunLineage``): its datasets one per line and
    its training config, when the checkpoint recorded them."""
    out: dict = {}
    data = trainer.get("data")
    if isinstance(data, list) and data:
        lines = [
            f"{d.get('uri')} ({', '.join(f'{k} {v}' for k, v in sorted(d.items()) if k != 'uri')})"
            for d in data
            if isinstance(d, dict)
        ]
        out["datasets"] = bullet_list(lines)
    if isinstance(trainer.get("config"), dict):
        out["training_config"] = MetadataValue.json(trainer["config"])
    return out


@asset(check_specs=[INTEGRITY], **_COMMON)
def checkpoint(context: AssetExecutionContext, store: CheckpointStoreResource, archive: ArchiveTierResource):
    """A committed checkpoint that passed its blocking integrity check (manifest checksum
    and structure, every rank record, every chunk re-hashed). A *Failed* partition is one
    checkpoint that needs attention, not a broken pipeline: ``recoverability`` counts
    them ("N of M need attention") and says whether every run can recover now. The
    partition's Events view gives the reason (which chunk, which check); the blocking
    ``integrity`` check keeps it from being evaluated, compressed or archived. One that
    could not be read is retried, with no verdict. Progress (bytes re-read of the total,
    the rate) is logged as it goes; the time and rate are metadata of the check and of
    the materialization."""
    run, step = parse_checkpoint_key(context.partition_key)
    hot = store.open()
    total = lifecycle.content_bytes(hot, run, step, archive=archive.open)
    with (
        logged_progress(context, f"validating {context.partition_key}", total=total) as meter,
        store.retrying_outages(context),
    ):
        validated = lifecycle.validate_checkpoint(
            hot, run, step, archive=archive.open, on_commit=pin_commit(context), progress=meter
        )
    record = validated.record
    timed = throughput("validation", record["bytes_checked"], meter.seconds)
    problems = record["problems"] or ([] if record["ok"] else ["no problem recorded"])
    reason = recoverable.reason_of(problems[0]) if problems else None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    check = AssetCheckResult(
        check_name=INTEGRITY.name,
        passed=bool(record["ok"]),
        severity=AssetCheckSeverity.ERROR,  # ERROR: a blocking check blocks downstream only at this severity
        description=(
            f"{run} step {step} needs attention: {reason.line()}{more}"
            if reason
            else f"{record['chunks_checked']} chunks re-hashed, every one matches"
        ),
        metadata={
            # per-run keys: the check's plots draw one line per run, never one line through two runs
            f"{run}/chunks": MetadataValue.int(record["chunks_checked"]),
            f"{run}/bytes": MetadataValue.int(record["bytes_checked"]),
            "checked": MetadataValue.text(human_bytes(record["bytes_checked"])),  # plotted per run, above
            **timed,
            "tier": record["tier"],
            "manifest_digest": record["manifest_digest"],
            **(_reason_metadata(reason) if reason else {}),
            # one problem as plain text (no "[Show Markdown]" to click), several as a list
            **(
                {"problems": MetadataValue.text(problems[0]) if len(problems) == 1 else bullet_list(problems)}
                if problems
                else {}
            ),
        },
    )
    if validated.manifest is None:
        assert reason is not None
        yield check
        # the partition's own page: an observation with the reason in short text fields
        # (a failed step shows only "Run … failed" there; its error is behind a click)
        yield AssetObservation(
            asset_key=context.asset_key,
            partition=context.partition_key,
            description=f"blocked by the integrity check: {reason.line()}{more}",
            metadata=_reason_metadata(reason),
        )
        raise Failure(
            description=f"integrity check blocked {context.partition_key}: {reason.line()}{more}",
            metadata=_reason_metadata(reason),
            allow_retries=False,
        )
    yield MaterializeResult(
        metadata={**_describe(validated.manifest), "tier": validated.source.url, **timed}, check_results=[check]
    )


@asset(deps=[checkpoint], automation_condition=DOWNSTREAM, **_COMMON)
def evaluation(
    context: AssetExecutionContext,
    store: CheckpointStoreResource,
    archive: ArchiveTierResource,
    evaluator: EvaluatorResource,
) -> MaterializeResult:
    """Metrics from the run's evaluator (or, for a run with none, the trainer's recorded
    metrics), as numeric metadata plotted across partitions; the change against the
    previous evaluated checkpoint, and an overfitting flag. An evaluator that fails
    fails this partition only, with its error."""
    run, step = parse_checkpoint_key(context.partition_key)
    hot = store.open()
    rule = EvaluationRule(evaluator.val_metric, evaluator.train_metric, evaluator.mode)
    with store.retrying_outages(context), _refusing_failed_commits():
        try:
            record = lifecycle.evaluate_checkpoint(
                hot,
                run,
                step,
                archive=archive.open,
                on_commit=pin_commit(context),
                evaluator=evaluator.name_for(run),
                load=load_function,
                key=evaluator.key,
                rule=rule,
            )
        except EvaluatorError as e:  # this partition's, said in one line, never retried
            raise Failure(description=str(e), allow_retries=False) from e.__cause__
    if record["overfitting"]:
        context.log.warning(f"{context.partition_key}: {rule.val_metric} got worse while {rule.train_metric} improved")
    # keyed by run, so each run's values plot as a line of their own (two models' losses are no one series)
    per_run = f"{run}/"
    improvement = {f"improvement/{rule.val_metric}": record["improvement"]}
    extra = {} if record["improvement"] is None else metrics(improvement, prefix=per_run)
    # the trainer's own metric beside the evaluator's (an evaluator scores held-out data only)
    trained = {} if record.get("train") is None else {rule.train_metric: record["train"]}
    return MaterializeResult(
        metadata={
            **metrics({**trained, **record["metrics"]}, prefix=per_run),
            **extra,
            "overfitting": bool(record["overfitting"]),
            "evaluator": record["evaluator"],
            "source": "the trainer's recorded metrics" if record["source"] == "trainer" else "evaluator",
            "tier": record["tier"],
            "manifest_digest": record["manifest_digest"],
        }
    )


@asset(deps=[checkpoint], automation_condition=DOWNSTREAM, **_COMMON)
def compressed(
    context: AssetExecutionContext, store: CheckpointStoreResource, archive: ArchiveTierResource
) -> MaterializeResult:
    """Re-encode the checkpoint's chunks with byte-grouped zstd. Chunk addresses hash the
    raw bytes, so nothing that references them changes; every chunk is verified first.
    Progress is logged as it goes; the content's size, the time and the rate are metadata."""
    run, step = parse_checkpoint_key(context.partition_key)
    hot = store.open()
    total = lifecycle.content_bytes(hot, run, step)
    with (
        logged_progress(context, f"compressing {context.partition_key}", total=total) as meter,
        store.retrying_outages(context),
        _refusing_failed_commits(),
    ):
        report = lifecycle.compress_checkpoint(
            hot, run, step, archive=archive.open(), on_commit=pin_commit(context), progress=meter
        )
    if report is None:
        return MaterializeResult(metadata={"skipped": "hot copy expired (archive only); the archive keeps its bytes"})
    return MaterializeResult(
        metadata={
            "chunks": report.chunks,
            "reencoded": report.reencoded,
            **size("before", report.bytes_before),
            **size("after", report.bytes_after),
            "ratio": ratio(report.ratio),
            **size("content", report.bytes_raw),
            **throughput("compression", report.bytes_raw, meter.seconds),
        }
    )


@asset(deps=[compressed], automation_condition=DOWNSTREAM, **_COMMON)
def archived(
    context: AssetExecutionContext,
    store: CheckpointStoreResource,
    archive: ArchiveTierResource,
    evaluator: EvaluatorResource,
) -> MaterializeResult:
    """Copy to the archive tier with the same commit protocol, then verify it there
    (every chunk re-read from the archive and checked against its address; by size in
    a cold storage class). After compression, so the archive holds the smaller encoding.
    With a lossy ``archive_codec`` the copy is rounded as configured, its manifest says
    what was lost, and the run's evaluator scores it next to the exact checkpoint.
    Progress (bytes copied, the rate) is logged as it goes; the archival's time, and the
    bytes copied per second of it (verification and commit included), are metadata. The
    re-read of the copy is logged as a phase of its own (bytes of the total, the rate),
    with its bytes, time and rate as metadata (``reread_…``)."""
    run, step = parse_checkpoint_key(context.partition_key)
    hot, arc = store.open(), archive.open()
    with (
        logged_progress(context, f"archiving {context.partition_key} to {arc.url}") as meter,
        logged_phase(context, f"verifying the copy of {context.partition_key} in {arc.url}") as verifying,
        store.retrying_outages(context),
        _refusing_failed_commits(),
    ):
        report = lifecycle.archive_checkpoint(
            hot,
            arc,
            run,
            step,
            on_commit=pin_commit(context),
            codec=archive.codec(),
            evaluator=evaluator.name_for(run),
            load=load_function,
            key=evaluator.key,
            progress=meter,
            verifying=verifying,
        )
    if report is None:
        return MaterializeResult(metadata={"archive": arc.url, "skipped": "hot copy expired; archived earlier"})
    if not report.ok:
        raise Failure(
            f"archive copy of {context.partition_key} in {arc.url} does not verify: {report.problems[0]}",
            metadata={"problems": bullet_list(report.problems)},
        )
    return MaterializeResult(
        metadata={
            "archive": arc.url,
            "manifest_key": fmt.manifest_key(run, step),
            "chunks_copied": report.chunks_copied,
            "chunks_already_there": report.chunks_present,
            "chunks_reencoded": report.chunks_reencoded,
            **size("copied", report.bytes_copied),
            **throughput("archival", report.bytes_copied, meter.seconds),
            "verified": True,
            "chunks_verified": report.chunks_verified,
            "verified_by": report.verified_by,
            **(_reread_metadata(verifying.meter) if verifying.meter else {}),
            "manifest_digest": report.digest,
            **_lossy_metadata(report),
        }
    )


def _reread_metadata(meter: ProgressLog) -> dict:
    """The re-read of an archive copy: its bytes, time and rate (a cold tier re-reads nothing)."""
    return {**size("reread", meter.done), **throughput("reread", meter.done, meter.seconds)}


def _lossy_metadata(report: lifecycle.ArchiveReport) -> dict:
    """What a lossy copy lost and, re-evaluated, what that cost in each metric."""
    if report.lossy is None:
        return {"archive_copy": "exact"}
    change = (report.evaluation or {}).get("metric_change") or {}
    return {
        "archive_copy": "lossy",
        "archive_codec": report.lossy.get("codec", ""),
        "archive_digest": report.archive_digest,
        "lossy_error": MetadataValue.json(report.lossy.get("error") or {}),
        **{f"metric_change/{k}": MetadataValue.float(float(v)) for k, v in change.items()},
    }
