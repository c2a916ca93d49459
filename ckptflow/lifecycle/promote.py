"""Promotion, rollback and rebuild: a checkpoint becomes a model version, aliases move.

The whole request is validated when it is built (``PromotionRequest``), before anything
is exported, registered or moved, so a bad stage or dtype changes nothing. A promotion
exports a model directory (``ckptflow.interop.export``), uploads its files streamed and
content-addressed, then claims a version and moves the aliases in one compare-and-swap
(``ckptflow.interop.registry``). Exports are deterministic, so a version whose files were
deleted is rebuilt from its source checkpoint (hot or archive) and checked against the
hashes it recorded.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.choice import NOT_VALIDATED, failed_why
from ckptflow.catalog.verdicts import Subject, read_record
from ckptflow.chunks.leases import PROMOTION_WAIT, PROMOTIONS, Heartbeat, shared_lease
from ckptflow.chunks.lossy import describe as describe_lossy
from ckptflow.errors import CkptflowError, PromotionError, RegistryError, StoreUnavailableError, is_damage
from ckptflow.format import layout as fmt
from ckptflow.interop.export import ExportOptions, Lineage, export_safetensors, option_problems
from ckptflow.interop.registry import ModelVersion, Registry, sha256_file

if TYPE_CHECKING:
    from ckptflow.interop.mlflow_registry import MlflowMirror
from ckptflow.lifecycle.lineage import lineage_of
from ckptflow.lifecycle.validate import validate
from ckptflow.policy.retention import Ref, rank_by_metric
from ckptflow.policy.scores import no_score, one_scale, scale_of
from ckptflow.reports import inventory
from ckptflow.store.base import Store

STAGES = ("latest", "stable")


@dataclass(frozen=True)
class PromotionRequest:
    """What to promote. ``checkpoint`` None: the best validated checkpoint by ``metric``.
    ``stage`` "latest" moves only ``latest``; "stable" also makes it stable (the old stable
    becomes ``fallback``). ``dtype`` "" keeps the saved dtypes; "int8" quantizes the
    nn.Linear weights (``ckptflow.interop.export.quantize``)."""

    model: str
    checkpoint: Ref | None = None
    _: KW_ONLY
    metric: str = "val_loss"
    mode: str = "min"
    stage: str = "latest"
    dtype: str = ""
    key: str = "model"
    allow_fp16_overflow: bool = False

    def __post_init__(self) -> None:
        fmt.validate_run(self.model)
        if self.checkpoint is not None:
            fmt.validate_run(self.checkpoint[0])
            fmt.validate_step(self.checkpoint[1])
        problems = []
        if self.stage not in STAGES:
            problems.append(f"stage {self.stage!r} is not one of {STAGES}")
        if self.mode not in ("min", "max"):
            problems.append(f"mode {self.mode!r} is not 'min' or 'max'")
        problems += option_problems(self.key, self.dtype)
        if problems:
            raise PromotionError("promotion refused before anything was written: " + "; ".join(problems))

    def export_options(self) -> ExportOptions:
        return ExportOptions(key=self.key, dtype=self.dtype, allow_fp16_overflow=self.allow_fp16_overflow)


PassedOver = tuple[str, int, str]  # (run, step, why): a Best restore's ``passed_over`` with the run


@dataclass(frozen=True)
class Promotion:
    """What ``promote`` did: the version it registered and, promoting by metric, each hot
    checkpoint it did not take as a candidate, and why (``choose_checkpoint``)."""

    registered: ModelVersion
    passed_over: list[PassedOver] = field(default_factory=list)


SHOWN = 50  # the passed-over checkpoints a refusal, a log line or metadata names; the others are counted


def passed_over_lines(passed_over: list[PassedOver]) -> list[str]:
    """One line per checkpoint passed over, as a restore's error and ``ls --select`` say it:
    the first ``SHOWN``, then how many more (a backlog not validated yet can be thousands)."""
    more = [f"… {len(passed_over) - SHOWN} more"] if len(passed_over) > SHOWN else []
    return [f"run {run!r} step {step}: {why}" for run, step, why in passed_over[:SHOWN]] + more


def choose_checkpoint(
    entries: list[inventory.Entry], metric: str, mode: str
) -> tuple[inventory.Entry, list[PassedOver]]:
    """The best checkpoint by ``metric`` (its score, as ``Best`` ranks: ``ckptflow.policy.scores``)
    among those that passed validation and are hot, and why each other hot one is not a
    candidate. Every run is ranked on one scale, chosen as ``Best`` chooses it: among the
    commits a tier may hold whose validation did not fail, each by its own records
    (``Entry.held_commits``: validated or not yet, in the archive only too where ``entries``
    hold the archive's), so a step an evaluator scored that is not validated yet, whose hot
    copy retention expired or rotted, or an earlier commit of a step that only the archive
    holds, makes its evaluator's the scale, as for ``Best``, rather than a promotion by
    training loss. A lossy copy (imported back to evaluate it) is no candidate: promotion
    refuses it, and it shares its source's metrics, so choosing it would refuse every
    promotion by metric."""
    hot = [e for e in entries if "hot" in e.tiers]
    figures = {e.ref: e.candidate().scales.get(metric) or {} for e in entries}
    scale = scale_of({(*e.ref, digest): by for e in entries for digest, by in e.held_commits(metric).items()})
    on_scale, off_scale = one_scale(figures, scale=scale)

    def why_not(e: inventory.Entry) -> str | None:
        if e.valid is False:
            return failed_why([{"problems": [e.manifest_error]}] if e.manifest_error else [e.records["validation"]])
        if e.manifest_error:  # its commit record could not be read just now: nothing is known of it
            return e.manifest_error
        if e.lossy:
            return "a lossy copy, not the model that was trained: never promoted"
        if e.ref not in on_scale:
            return off_scale.get(e.ref) or no_score(metric)
        return None if e.validation == "passed" else NOT_VALIDATED

    whys = {e.ref: why_not(e) for e in hot}
    passed_over = [(e.run, e.step, why) for e in hot if (why := whys[e.ref]) is not None]
    picks = [e for e in hot if whys[e.ref] is None]
    ranked = rank_by_metric([e.candidate() for e in picks], metric, mode, scale=scale)
    if not ranked:
        raise PromotionError(
            f"no validated hot checkpoint has a score of {metric!r} on {scale}, the scale the checkpoints are "
            f"ranked on (passed over: {'; '.join(passed_over_lines(passed_over)) or 'none'}); validate or "
            "evaluate some first, or promote one by name"
        )
    by_ref = {e.ref: e for e in picks}
    return by_ref[ranked[0][0].ref], passed_over


def promote(
    hot: Store,
    registry: Registry,
    request: PromotionRequest,
    *,
    archive: Store | None = None,
    mirror: MlflowMirror | None = None,
    wait: float = PROMOTION_WAIT,
    progress: Callable[[int], None] | None = None,
) -> Promotion:
    """Export the chosen checkpoint, register it as the next version of ``request.model``
    and move ``latest`` (and, for stage "stable", ``stable`` and ``fallback``).

    ``archive``: the archive tier, whose commits count in choosing the scale a promotion by
    metric ranks on, as they do for a ``Best`` restore reading it (``choose_checkpoint``);
    only a hot checkpoint is promoted.

    ``mirror``: then also bring MLflow up to date (``MlflowMirror.sync``). ckptflow's
    registry is written first and stays the source of truth: a ``MirrorError`` means the
    version is registered here and only the mirror is behind (``mirror.sync`` finishes it).

    From choosing the checkpoint until its version is registered (and so pins it), the
    promotion holds a lease in ``hot`` that retention waits for (``PROMOTIONS``): a
    retention that runs meanwhile cannot expire the checkpoint being published. One
    running already is waited for, up to ``wait`` seconds.

    ``progress`` is told the content size of each chunk the export reads (the export's
    ``progress``: no total, as only the chunks of ``request.key``'s tensors are read).

    Promoting by metric (no ``request.checkpoint``), the result's ``passed_over`` says which
    hot checkpoints were no candidate and why, as a ``Best`` restore's does: not validated
    yet, failed validation, or scored on another scale than the one the others rank on."""
    with shared_lease(hot, PROMOTIONS, wait) as lease:
        promotion = _export_and_register(hot, archive, registry, request, lease, progress)
    if mirror is not None:
        mirror.sync(registry, request.model)
    return promotion


def _export_and_register(
    hot: Store,
    archive: Store | None,
    registry: Registry,
    request: PromotionRequest,
    lease: Heartbeat,
    progress: Callable[[int], None] | None,
) -> Promotion:
    passed_over: list[PassedOver] = []
    if request.checkpoint is None:
        chosen, passed_over = choose_checkpoint(inventory.collect(hot, archive), request.metric, request.mode)
        run, step = chosen.ref
    else:
        run, step = request.checkpoint
    manifest = catalog.read_manifest(hot, run, step)
    if manifest.lossy is not None:
        source = manifest.lossy.get("source_digest") or "unknown"
        raise PromotionError(
            f"refusing to promote {run} step {step}: it is a lossy archive copy ({describe_lossy(manifest.lossy)}), "
            f"not the model that was trained; promote the exact commit (manifest {source}) instead. A lossy copy can "
            "still be exported (export --allow-lossy) or restored (allow_lossy=True) for evaluation"
        )
    validation = read_record(hot, Subject.of(manifest), "validation") or validate(hot, run, step)
    if validation.get("manifest_digest") not in ("", manifest.digest):  # validate() read a newer commit
        raise PromotionError(f"{run} step {step} was committed again while it was being validated; promote again")
    if not validation.get("ok") or validation.get("manifest_digest") != manifest.digest:
        raise PromotionError(
            f"refusing to promote {run} step {step}: it failed validation ({validation.get('problems')})"
        )
    options = request.export_options()
    lineage = lineage_of(hot, manifest)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "model")
        result = export_safetensors(hot, run, out, step=step, options=options, lineage=lineage, progress=progress)
        if result.digest != manifest.digest:
            raise PromotionError(f"{run} step {step} was committed again while it was being exported; promote again")
        files = registry.upload(request.model, out, list(result.files))
    if lease.lost:
        raise PromotionError(
            f"refusing to register {run} step {step}: this promotion's lease in {hot.url} could not be renewed, so "
            "retention may have expired the checkpoint meanwhile; nothing was registered, promote again"
        )
    version = registry.register(
        request.model,
        run=run,
        step=step,
        manifest_digest=manifest.digest,
        files=files,
        export=options.to_json(),
        lineage=lineage.to_json(),
        stage=request.stage,
    )
    return Promotion(version, passed_over)


def rollback(registry: Registry, model: str, *, mirror: MlflowMirror | None = None) -> ModelVersion:
    """``stable`` <- ``fallback``; returns the version the rollback made stable (what its
    own compare-and-swap set, not whatever a later move made stable). ``mirror``: then
    move MLflow's aliases too (as ``promote``)."""
    aliases = registry.rollback(model)
    if mirror is not None:
        mirror.sync(registry, model)
    return registry.get(model, aliases["stable"])


def rebuild(registry: Registry, model: str, version: int, tiers: Sequence[Store]) -> list[str]:
    """Re-export version ``version`` of ``model`` from its source checkpoint, found in the
    first of ``tiers`` (hot, then archive) holding the same commit (manifest digest),
    check that every file hashes to what the version recorded, then upload them all
    (a file that rotted in the registry is written again with the bytes it should hold).
    Returns the names of those that were missing. Nothing is uploaded unless every file
    matches."""
    mv = registry.get(model, version)
    source = _source_tier(mv, tiers)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "model")
        options = ExportOptions(**mv.export)
        export_safetensors(source, mv.run, out, step=mv.step, options=options, lineage=Lineage.from_json(mv.lineage))
        rebuilt = {name: sha256_file(os.path.join(out, name)) for name in os.listdir(out)}
        recorded = {name: f["sha256"] for name, f in mv.files.items()}
        if rebuilt != recorded:
            differ = sorted(n for n in rebuilt.keys() | recorded.keys() if rebuilt.get(n) != recorded.get(n))
            raise RegistryError(
                f"{model} v{version} rebuilt from {source.url} does not match its recorded files "
                f"({', '.join(differ)}); nothing was uploaded"
            )
        missing = registry.missing_files(mv)
        registry.upload(model, out, sorted(rebuilt))
    return missing


def _source_tier(mv: ModelVersion, tiers: Sequence[Store]) -> Store:
    """The first of ``tiers`` holding ``mv``'s commit. A tier that could not be read (an
    outage, a cold or denied object, a newer format) proves nothing about what it holds:
    when no tier that answered holds the commit and one did not answer, the rebuild is
    ``StoreUnavailableError`` (retry), never "no tier holds it"."""
    unread = []
    for store in tiers:
        try:
            if catalog.read_manifest(store, mv.run, mv.step).digest == mv.manifest_digest:
                return store
        except (CkptflowError, OSError) as e:
            if not is_damage(e):
                unread.append(f"{store.url} ({e})")
    if unread:
        raise StoreUnavailableError(
            f"{mv.model} v{mv.version} was not rebuilt: could not read {mv.partition_key} in {'; '.join(unread)}, "
            "and no tier that answered holds its commit; nothing was uploaded: rebuild again once it can be read"
        )
    raise RegistryError(
        f"{mv.model} v{mv.version} cannot be rebuilt: no tier ({', '.join(s.url for s in tiers)}) holds "
        f"{mv.partition_key} with manifest digest {mv.manifest_digest}"
    )
