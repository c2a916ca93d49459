"""A checkpoint's model tensors, consolidated and made ready to write: full tensors from
the verified chunks, shared tensors once, dtype conversion that refuses to lose values.

Full-size tensors are allocated from the manifest's global tensor index and filled by
``dcp.load`` through our verified reader, so DCP's planner gathers every shard (several
ranks, DTensor shards) into place: no model code and no process group are needed, and
nothing is ever unpickled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import listing as catalog_listing
from ckptflow.catalog.listing import Problem
from ckptflow.catalog.verdicts import check_not_failed
from ckptflow.chunks import lossy
from ckptflow.chunks.io import ChunkStore
from ckptflow.dcp.allocation import empty_tensor
from ckptflow.dcp.failures import failure_of, own_errors
from ckptflow.dcp.reader import CheckpointReader
from ckptflow.errors import (
    CkptflowError,
    ColdObjectError,
    CorruptChunkError,
    NewerFormatError,
    NoValidCheckpointError,
    StoreUnavailableError,
)
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.store import Store, open_store

Progress = Callable[[int], None]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Admitted:
    """A commit export may read, and what its files must say about it."""

    manifest: Manifest
    lossy: dict[str, Any] | None  # a lossy copy (exported with allow_lossy): its ``lossy`` record
    failed_validation: dict[str, Any] | None  # its failed verdict (allow_failed): recorded_at, problems, tier

    def check_same(self, manifest: Manifest) -> None:
        """``manifest`` (what was read) is the commit that was admitted, not a new one."""
        if manifest.digest != self.manifest.digest:
            raise CkptflowError(
                f"run {manifest.run!r} step {manifest.step} was committed again while it was being exported "
                "(another manifest digest); export again"
            )


def admit(store: Store, run: str, step: int, *, allow_lossy: bool, allow_failed: bool) -> Admitted:
    """The commit of ``(run, step)`` if export may use it: a lossy archive copy only with
    ``allow_lossy`` (restore's rule, ``lossy.check_allowed``), a commit whose validation
    failed only with ``allow_failed`` (``lifecycle.records.check_not_failed``; verdicts
    are read from ``store``). Read before any tensor, so a refusal costs one manifest."""
    manifest = catalog.read_manifest(store, run, step)
    source = (manifest.lossy or {}).get("source_digest") or "unknown"
    lossy.check_allowed(
        manifest,
        allow_lossy=allow_lossy,
        where=f"run {run!r} step {step} in {store.url}",
        how_to_allow=f"it is not the model that was trained (exact commit {source}). Export that one, or pass "
        "--allow-lossy (allow_lossy=True) to export this copy, marked lossy in every file written",
    )
    verdict = check_not_failed(
        store, manifest, allow_failed=allow_failed, how_to_allow="pass --allow-failed (allow_failed=True) to export it"
    )
    failed = {k: verdict[k] for k in ("recorded_at", "problems", "tier") if k in verdict} if verdict else None
    return Admitted(manifest, dict(manifest.lossy) if manifest.lossy is not None else None, failed)


def load_tensors(
    store: Store | str,
    run: str,
    step: int,
    *,
    prefix: str = "model.",
    progress: Progress | None = None,
    threads: int = 8,
) -> tuple[dict[str, torch.Tensor], Manifest]:
    """Full tensors named ``prefix…`` (prefix stripped) and the manifest they came from.

    Every chunk read is verified against its address, so a returned tensor is exactly
    what was saved.
    """
    store = open_store(store)
    manifest = catalog.read_manifest(store, fmt.validate_run(run), fmt.validate_step(step))
    index = manifest.dcp.tensors
    if prefix in index:  # a tensor named "" under the entry: a file of named tensors cannot hold it
        raise CkptflowError(
            f"run {run!r} step {step} holds a tensor with an empty name under {prefix[:-1]!r}, which an export cannot "
            "name in its files (it was dropped before); restore the state, give the tensor a name, and save it again"
        )
    names = sorted(n for n in index if n.startswith(prefix) and len(n) > len(prefix))
    if not names:
        tops = sorted({n.split(".", 1)[0] for n in index})
        raise CkptflowError(
            f"run {run!r} step {step} has no tensors under {prefix!r}; its tensors are under {tops}: "
            "pass one of those as --key"
        )
    full = {name: empty_tensor(store, manifest, name, f"run {run!r} step {step}") for name in names}
    with ThreadPoolExecutor(threads, thread_name_prefix="ckptflow-export") as pool:
        reader = CheckpointReader(ChunkStore(store), manifest, pool, progress)
        try:
            with own_errors():
                dcp.load(full, storage_reader=reader, no_dist=True)
        except CkptflowError as e:  # keeps "could not be read" apart from damage, as restore does
            failure = failure_of(e)
            unread = not (failure.damage or failure.partial)
            error = (
                (ColdObjectError if failure.cold else StoreUnavailableError)
                if unread
                else CorruptChunkError
                if failure.damage
                else CkptflowError
            )
            raise error(f"run {run!r} step {step} cannot be exported: {e}") from None
    return {n[len(prefix) :]: t for n, t in full.items()}, manifest


def newest_verified_step(store: Store, run: str, progress: Progress | None = None) -> tuple[int, list[tuple[int, str]]]:
    """The newest committed step that fully verifies, and why each newer one was skipped.

    As in restore, only proof of damage moves to an older step: a newer one that could
    not be read (an outage, a cold or denied object, a link) raises
    ``StoreUnavailableError`` (``ColdObjectError`` for a cold one; ``NewerFormatError`` for
    one a newer ckptflow wrote) naming what could not be read, rather than silently
    exporting an older model."""
    skipped: list[tuple[int, str]] = []
    entries = [e for e in catalog_listing.listing(store, run) if isinstance(e, Problem) or e.committed]
    with ThreadPoolExecutor(8, thread_name_prefix="ckptflow-verify") as pool:
        for entry in sorted(entries, key=lambda e: -1 if e.step is None else e.step, reverse=True):
            if isinstance(entry, Problem):  # could not even be listed or read
                findings = [entry]
            else:
                report = catalog.verify_checkpoint(store, run, entry.step, pool, progress)
                if report.ok:
                    return entry.step, skipped
                findings = report.findings
            if all(p.could_not_read for p in findings):
                raise _unreadable(store, run, entry.step, findings)
            skipped.append((-1 if entry.step is None else entry.step, "; ".join(p.message for p in findings)))
    detail = "; ".join(f"step {s}: {why}" for s, why in skipped) or "it has no committed checkpoints"
    raise NoValidCheckpointError(f"no checkpoint of run {run!r} in {store.url} verifies ({detail})", skipped)


def _unreadable(store: Store, run: str, step: int | None, findings: list[Problem]) -> CkptflowError:
    """What stops an export that could not read a step (nothing proved it damaged)."""
    where = f"run {run!r}" + ("" if step is None else f" step {step}") + f" in {store.url}"
    more = f" (and {len(findings) - 1} more)" if len(findings) > 1 else ""
    newer = next((p for p in findings if p.kind == "newer"), None)
    if newer is not None:
        return NewerFormatError(
            f"export of {where} stopped rather than fall back to an older checkpoint (nothing shows that this one "
            f"is damaged): {newer.message}; to export an older step instead, name it"
        )
    cold = any(p.kind == "cold" for p in findings)
    then = (
        f"Thaw it (`ckptflow thaw {store.url} --run {run} --step {step}`) and export again"
        if cold
        else "Fix access to the store and export again, or name an older step to export that one"
    )
    return (ColdObjectError if cold else StoreUnavailableError)(
        f"could not read {where}, so export stopped rather than fall back to an older checkpoint (nothing "
        f"shows that this one is damaged): {findings[0].message}{more}. {then}"
    )


def write_once(
    tensors: Mapping[str, torch.Tensor], shared: Iterable[Iterable[str]], source: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep the first name of each shared group, drop the others: (tensors, {dropped: kept}).

    The names of one tensor must hold the same values in the checkpoint; if they do not,
    ``source`` (where the grouping came from) disagrees with what was saved, and writing
    one of them would silently change the model.
    """
    out, tied = dict(tensors), {}
    for group in shared:
        present = [n for n in group if n in out]
        for other in present[1:]:
            kept = present[0]
            if out[kept].shape != out[other].shape or not torch.equal(out[kept], out[other]):
                raise CkptflowError(
                    f"{kept!r} and {other!r} are one tensor according to {source}, but the checkpoint "
                    "holds different values for them; export refused (check that the recorded model "
                    "structure is the one that was trained)"
                )
            tied[other] = kept
            del out[other]
    return out, tied


def convert_dtype(
    tensors: Mapping[str, torch.Tensor], dtype: str, *, allow_fp16_overflow: bool, where: str
) -> dict[str, torch.Tensor]:
    """Floating-point tensors in ``dtype`` (integer buffers keep theirs).

    A finite value beyond the target's largest would become ``inf``: fp16's is 65504 (a
    weight of 1e5, a BatchNorm running_var of 7e4); bf16's, 3.39e38, is just under fp32's,
    and fp32's far under fp64's. That is refused, naming each such tensor and its largest
    magnitude; for fp16 alone ``allow_fp16_overflow`` writes the inf instead.
    """
    target = DTYPES[dtype]
    out, overflow = {}, []
    for name, t in tensors.items():
        if not t.is_floating_point():
            out[name] = t
            continue
        out[name] = t.to(target)
        narrower = torch.finfo(target).max < torch.finfo(t.dtype).max
        if narrower and bool((out[name].isinf() & ~t.isinf()).any()):
            overflow.append((name, t[torch.isfinite(t)].abs().max().item()))
    if overflow and not (allow_fp16_overflow and target == torch.float16):
        listed = ", ".join(f"{n!r} (max |x| {m:.4g})" for n, m in sorted(overflow))
        wider = (
            "Export as bf16 (about the range of fp32), or pass --allow-fp16-overflow (allow_fp16_overflow=True) "
            "to write inf"
            if target == torch.float16
            else "Export in a wider dtype (fp32, or the checkpoint's own with no --dtype)"
        )
        raise CkptflowError(
            f"{dtype} cannot hold {len(overflow)} tensor(s) of {where}: {listed}; {dtype}'s largest finite "
            f"value is {torch.finfo(target).max:.4g}, so they would become inf. {wider}"
        )
    return out
