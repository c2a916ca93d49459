"""Promotion and rollback: a checkpoint becomes a model version, aliases move.

The whole request is validated when it is built (``PromotionRequest``), before anything
is exported, registered or moved, so a bad stage or dtype changes nothing.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from ckptflow import catalog, inventory
from ckptflow import format as fmt
from ckptflow.errors import PromotionError
from ckptflow.export import DTYPES, export_safetensors
from ckptflow.lifecycle.records import Subject, read_record
from ckptflow.lifecycle.validate import validate
from ckptflow.quantize import export_int8
from ckptflow.registry import ModelVersion, Registry
from ckptflow.retention import Ref, rank_by_metric
from ckptflow.store.base import Store

STAGES = ("latest", "stable")
EXPORT_DTYPES = ("", *DTYPES, "int8")


@dataclass(frozen=True)
class PromotionRequest:
    """What to promote. ``checkpoint`` None: the best validated checkpoint by ``metric``.
    ``stage`` "latest" moves only ``latest``; "stable" also makes it stable (the old stable
    becomes ``fallback``). ``dtype`` "" keeps the saved dtypes; "int8" quantizes weights."""

    model: str
    checkpoint: Ref | None = None
    metric: str = "val_loss"
    mode: str = "min"
    stage: str = "latest"
    dtype: str = ""
    key: str = "model"

    def __post_init__(self) -> None:
        fmt.validate_run(self.model)
        if self.checkpoint is not None:
            fmt.validate_run(self.checkpoint[0])
            fmt.validate_step(self.checkpoint[1])
        problems = []
        if self.stage not in STAGES:
            problems.append(f"stage {self.stage!r} is not one of {STAGES}")
        if self.dtype not in EXPORT_DTYPES:
            problems.append(f"dtype {self.dtype!r} is not one of {EXPORT_DTYPES}")
        if self.mode not in ("min", "max"):
            problems.append(f"mode {self.mode!r} is not 'min' or 'max'")
        if not self.key:
            problems.append("key is empty: name the state entry holding the weights (e.g. 'model')")
        if problems:
            raise PromotionError("promotion refused before anything was written: " + "; ".join(problems))


def choose_checkpoint(entries: list[inventory.Entry], metric: str, mode: str) -> inventory.Entry:
    """The best checkpoint by ``metric`` among those that passed validation and are hot."""
    by_ref = {e.ref: e for e in entries if e.validation == "passed" and "hot" in e.tiers}
    ranked = rank_by_metric([e.candidate() for e in by_ref.values()], metric, mode)
    if not ranked:
        raise PromotionError(f"no validated checkpoint has an evaluation metric {metric!r}; evaluate some first")
    return by_ref[ranked[0].ref]


def promote(hot: Store, registry: Registry, request: PromotionRequest) -> ModelVersion:
    """Export the chosen checkpoint, register it as the next version of ``request.model``
    and move ``latest`` (and, for stage "stable", ``stable`` and ``fallback``)."""
    if request.checkpoint is None:
        run, step = choose_checkpoint(inventory.collect(hot), request.metric, request.mode).ref
    else:
        run, step = request.checkpoint
    manifest = catalog.read_manifest(hot, run, step)
    subject = Subject.of(manifest)
    validation = read_record(hot, subject, "validation") or validate(hot, run, step)
    if not validation.get("ok") or validation.get("manifest_digest") != manifest.digest:
        raise PromotionError(
            f"refusing to promote {run} step {step}: it failed validation ({validation.get('problems')})"
        )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "model.safetensors")
        if request.dtype == "int8":
            result = export_int8(hot, run, step, out, key=request.key)
        else:
            result = export_safetensors(hot, run, out, step=step, key=request.key, dtype=request.dtype or None)
        with open(result.path, "rb") as f:
            weights = f.read()
    evaluation = read_record(hot, subject, "evaluation") or {}
    trainer = dict(manifest.metadata)
    version = registry.register(
        request.model,
        run=run,
        step=step,
        manifest_digest=manifest.digest,
        artifact_bytes=weights,
        dtype=request.dtype or None,
        training_config={
            "kind": manifest.kind,
            "world_size": manifest.world_size,
            "codec": manifest.codec,
            **(trainer.get("config") or {}),
        },
        data={"trainer": trainer.get("data", "see the training run"), "evaluated_by": evaluation.get("evaluator")},
        metrics={
            **{k: v for k, v in trainer.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
            **(evaluation.get("metrics") or {}),
        },
    )
    if request.stage == "stable":
        registry.promote(request.model, version.version)
    return version


def rollback(registry: Registry, model: str) -> ModelVersion:
    """``stable`` <- ``fallback``; returns the version now stable."""
    registry.rollback(model)
    return registry.resolve(model, "stable")
