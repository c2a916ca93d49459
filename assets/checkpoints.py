"""Per-checkpoint assets: the registered checkpoint, its blocking integrity check,
evaluation, compression and archival. Each body is a few lines over the library.

Flow. The landing sensor adds a partition and requests ``checkpoint`` (with its
integrity check) for it. Everything downstream follows by declarative automation:
``AutomationCondition.eager()`` AND "every blocking check of my dependencies passed",
so a corrupt checkpoint stops at its check and is never evaluated, compressed or
archived. We chose automation conditions over materialization sensors because the
gating on blocking checks, in-progress and missing dependencies is built in and shows
in the UI's automation view per partition.

Backfills: every partitioned asset carries ``BackfillPolicy.multi_run(1)``: one run per
checkpoint, so each partition gets its own metadata (which is what Dagster plots
across partitions) and the runs spread over the run queue's concurrency.

Verdicts are also written to the store as lifecycle records (``ckptflow.lifecycle``),
so the inventory and retention read them without querying Dagster's event log.
"""

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    AutomationCondition,
    BackfillPolicy,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
    asset_check,
)

from assets.partitions import checkpoints_partitions, parse_checkpoint_key
from ckptflow import catalog, lifecycle
from ckptflow import format as fmt
from ckptflow.errors import CkptflowError
from ckptflow.lifecycle import EvaluationRule
from ckptflow.lifecycle.evaluate import numeric
from ckptflow.store import Store
from resources import ArchiveTierResource, CheckpointStoreResource, EvaluatorResource

GROUP = "checkpoints"
BACKFILL = BackfillPolicy.multi_run(max_partitions_per_run=1)
DOWNSTREAM = (AutomationCondition.eager() & AutomationCondition.all_deps_blocking_checks_passed()).with_label(
    "eager, once the checkpoint's integrity check passed"
)
_COMMON = dict(partitions_def=checkpoints_partitions, group_name=GROUP, backfill_policy=BACKFILL, kinds={"ckptflow"})


def _source(hot: Store, archive: ArchiveTierResource, run: str, step: int) -> Store:
    """Where the checkpoint's data is: the hot store, or the archive tier once retention
    expired the hot copy (the partition stays; lifecycle records stay in the hot store)."""
    if run_step_committed(hot, run, step):
        return hot
    arc = archive.open()
    return arc if run_step_committed(arc, run, step) else hot


def run_step_committed(store: Store, run: str, step: int) -> bool:
    return store.exists(fmt.manifest_key(run, step))


def _numbers(values: dict) -> dict:
    return {k: MetadataValue.float(float(v)) for k, v in numeric(values).items()}


@asset(**_COMMON)
def checkpoint(
    context: AssetExecutionContext, store: CheckpointStoreResource, archive: ArchiveTierResource
) -> MaterializeResult:
    """A committed checkpoint (its manifest). Never fails on a bad manifest: the blocking
    integrity check is the one gate, so a corrupt checkpoint shows as a failed check."""
    run, step = parse_checkpoint_key(context.partition_key)
    source = _source(store.open(), archive, run, step)
    try:
        manifest = catalog.read_manifest(source, run, step)
    except CkptflowError as e:
        return MaterializeResult(metadata={"run": run, "step": step, "manifest_error": str(e)})
    info = catalog.CheckpointInfo.from_manifest(manifest)
    return MaterializeResult(
        metadata={
            "run": run,
            "step": MetadataValue.int(step),
            "kind": info.kind,
            "world_size": info.world_size,
            "logical_bytes": MetadataValue.int(info.logical_bytes),
            "stored_bytes": MetadataValue.int(info.stored_bytes),
            "chunks": MetadataValue.int(info.chunks),
            "base_step": info.base_step if info.base_step is not None else -1,
            "created_at": MetadataValue.timestamp(info.created_at),
            "manifest_digest": manifest.digest,
            "tier": source.url,
            **{f"trainer/{k}": v for k, v in _numbers(info.metadata).items()},
        },
    )


@asset_check(asset=checkpoint, blocking=True, partitions_def=checkpoints_partitions)
def integrity(
    context: AssetCheckExecutionContext, store: CheckpointStoreResource, archive: ArchiveTierResource
) -> AssetCheckResult:
    """Manifest checksum and structure, every rank record, every chunk present and
    matching its hash. Blocking: nothing downstream runs on a checkpoint that fails it."""
    run, step = parse_checkpoint_key(context.partition_key)
    hot = store.open()
    record = lifecycle.validate(_source(hot, archive, run, step), run, step, records=hot)
    return AssetCheckResult(
        passed=bool(record["ok"]),
        severity=AssetCheckSeverity.ERROR,
        metadata={
            "chunks_checked": record["chunks_checked"],
            "bytes_checked": record["bytes_checked"],
            "tier": record["tier"],
            "manifest_digest": record["manifest_digest"],
            "problems": MetadataValue.md("\n".join(f"- {p}" for p in record["problems"]) or "none"),
        },
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
    previous evaluated checkpoint, and an overfitting flag."""
    run, step = parse_checkpoint_key(context.partition_key)
    hot = store.open()
    name, function = evaluator.evaluator_for(run)
    rule = EvaluationRule(evaluator.val_metric, evaluator.train_metric, evaluator.mode)
    record = lifecycle.evaluate(
        _source(hot, archive, run, step), hot, run, step, function, evaluator_name=name, key=evaluator.key, rule=rule
    )
    if record["overfitting"]:
        context.log.warning(f"{context.partition_key}: {rule.val_metric} got worse while {rule.train_metric} improved")
    extra = (
        {}
        if record["improvement"] is None
        else {f"improvement/{rule.val_metric}": MetadataValue.float(record["improvement"])}
    )
    return MaterializeResult(
        metadata={
            **_numbers(record["metrics"]),
            **extra,
            "overfitting": bool(record["overfitting"]),
            "evaluator": record["evaluator"],
            "manifest_digest": record["manifest_digest"],
        }
    )


@asset(deps=[checkpoint], automation_condition=DOWNSTREAM, **_COMMON)
def compressed(context: AssetExecutionContext, store: CheckpointStoreResource) -> MaterializeResult:
    """Re-encode the checkpoint's chunks with byte-grouped zstd. Chunk addresses hash the
    raw bytes, so nothing that references them changes; every chunk is verified first."""
    run, step = parse_checkpoint_key(context.partition_key)
    hot = store.open()
    if not run_step_committed(hot, run, step):
        return MaterializeResult(metadata={"skipped": "hot copy expired (archive only); the archive keeps its bytes"})
    report = lifecycle.compress(hot, run, step)
    return MaterializeResult(
        metadata={
            "chunks": report.chunks,
            "reencoded": report.reencoded,
            "bytes_before": MetadataValue.int(report.bytes_before),
            "bytes_after": MetadataValue.int(report.bytes_after),
            "ratio": MetadataValue.float(report.ratio or 1.0),
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
    what was lost, and the run's evaluator scores it next to the exact checkpoint."""
    run, step = parse_checkpoint_key(context.partition_key)
    hot, arc = store.open(), archive.open()
    if not run_step_committed(hot, run, step) and run_step_committed(arc, run, step):
        return MaterializeResult(metadata={"archive": arc.url, "skipped": "hot copy expired; archived earlier"})
    name, function = evaluator.evaluator_for(run)
    report = lifecycle.archive(
        hot, arc, run, step, codec=archive.codec(), evaluator=function, evaluator_name=name, key=evaluator.key
    )
    if not report.ok:
        raise Failure(
            f"archive copy of {context.partition_key} in {arc.url} does not verify",
            metadata={"problems": MetadataValue.md("\n".join(f"- {p}" for p in report.problems[:20]))},
        )
    return MaterializeResult(
        metadata={
            "archive": arc.url,
            "manifest_key": fmt.manifest_key(run, step),
            "chunks_copied": report.chunks_copied,
            "chunks_already_there": report.chunks_present,
            "bytes_copied": MetadataValue.int(report.bytes_copied),
            "verified": True,
            "chunks_verified": report.chunks_verified,
            "verified_by": report.verified_by,
            "manifest_digest": report.digest,
            **_lossy_metadata(report),
        }
    )


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
