"""What happens to a checkpoint after it is committed, one module per operation.

Each operation works on stores only (no Dagster) and writes its own record, keyed by the
manifest digest of the checkpoint it looked at (``records``). The Dagster assets and
jobs call these and turn the results into metadata and partitions.
"""

from ckptflow.catalog.verdicts import KINDS, Subject, read_record, records_by_subject, write_record
from ckptflow.lifecycle.archive import ArchiveReport, archive
from ckptflow.lifecycle.compress import CompressionReport, compress
from ckptflow.lifecycle.evaluate import EvaluationRule, Evaluator, evaluate
from ckptflow.lifecycle.expire import ExpireError, expire
from ckptflow.lifecycle.per_checkpoint import (
    Validated,
    archive_checkpoint,
    compress_checkpoint,
    content_bytes,
    evaluate_checkpoint,
    validate_checkpoint,
)
from ckptflow.lifecycle.repair import RepairReport, repair
from ckptflow.lifecycle.retention_apply import (
    RetentionReport,
    apply_retention,
    archive_only_beyond,
    copy_matches,
    current_plan,
)
from ckptflow.lifecycle.scrub import ScrubReport, scrub, scrub_archive_only
from ckptflow.lifecycle.validate import found_damage, validate

__all__ = [
    "KINDS",
    "ArchiveReport",
    "CompressionReport",
    "EvaluationRule",
    "Evaluator",
    "ExpireError",
    "RepairReport",
    "RetentionReport",
    "ScrubReport",
    "Subject",
    "Validated",
    "apply_retention",
    "archive_only_beyond",
    "archive",
    "archive_checkpoint",
    "compress",
    "compress_checkpoint",
    "content_bytes",
    "repair",
    "copy_matches",
    "current_plan",
    "evaluate",
    "evaluate_checkpoint",
    "expire",
    "read_record",
    "records_by_subject",
    "scrub",
    "scrub_archive_only",
    "found_damage",
    "validate",
    "validate_checkpoint",
    "write_record",
]
