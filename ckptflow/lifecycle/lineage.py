"""A checkpoint's lineage for a deployed model: what was committed and what is known of it."""

from __future__ import annotations

from dataclasses import replace

from ckptflow.catalog.verdicts import Subject, read_record
from ckptflow.format.manifest import Manifest
from ckptflow.interop.export.card import Lineage
from ckptflow.store.base import Store

_VALIDATION_FIELDS = ("ok", "problems", "chunks_checked", "bytes_checked", "tier", "recorded_at")


def lineage_of(store: Store, manifest: Manifest) -> Lineage:
    """The commit's own lineage (``Lineage.of``) with its validation and evaluation
    records in ``store`` (the hot store holds them)."""
    subject = Subject.of(manifest)
    validation = read_record(store, subject, "validation") or {}
    evaluation = read_record(store, subject, "evaluation") or {}
    own = Lineage.of(manifest)
    return replace(
        own,
        validation={k: validation[k] for k in _VALIDATION_FIELDS if k in validation},
        evaluation={
            "evaluator": evaluation.get("evaluator"),
            "metrics": {**own.evaluation["metrics"], **(evaluation.get("metrics") or {})},
        },
    )
