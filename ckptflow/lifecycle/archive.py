"""Archival: copy a checkpoint to another tier with the commit protocol, then verify it there."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ckptflow import catalog
from ckptflow import format as fmt
from ckptflow.chunks import ChunkStore
from ckptflow.errors import CkptflowError, StoreUnavailableError
from ckptflow.lifecycle.archive_lossy import write_lossy_copy
from ckptflow.lifecycle.evaluate import Evaluator, score
from ckptflow.lifecycle.records import Subject, read_record, write_record
from ckptflow.lossy import ArchiveCodec
from ckptflow.manifest import Manifest
from ckptflow.store.base import Store


@dataclass
class ArchiveReport:
    url: str = ""
    digest: str = ""
    chunks_copied: int = 0
    chunks_present: int = 0
    bytes_copied: int = 0
    problems: list[str] = field(default_factory=list)
    chunks_verified: int = 0
    verified_by: str = "re-read"  # or "size" for a cold storage class (objects unreadable until thawed)
    archive_digest: str = ""  # the archive's manifest: ``digest`` for an exact copy, its own for a lossy one
    lossy: dict | None = None  # what a lossy copy lost (its manifest's ``lossy`` record)
    evaluation: dict | None = None  # a lossy copy re-evaluated: metrics of both copies and the change

    @property
    def ok(self) -> bool:
        return not self.problems


def archive(
    src: Store,
    dst: Store,
    run: str,
    step: int,
    progress: Callable[[int], None] | None = None,
    *,
    codec: ArchiveCodec | None = None,
    evaluator: Evaluator | None = None,
    evaluator_name: str = "",
    key: str = "model",
) -> ArchiveReport:
    """Copy ``(run, step)`` from ``src`` (the hot store) to ``dst`` with the same commit
    protocol (chunks, then rank records, then the manifest last, all create-only), verify
    it there, and record the outcome in ``src`` for the manifest's digest.

    Verification re-reads every chunk from ``dst`` and checks it against its address,
    and the manifest and rank records against their checksums. A ``dst`` that writes
    cold objects (S3 GLACIER / DEEP_ARCHIVE) cannot be read back until thawed: its
    chunks are verified here before upload (the upload carries their SHA-256, which S3
    checks) and by size afterwards, and the small records go in a readable class
    (``Store.metadata_store``), so listing, inventory and restore planning need no thaw.

    A ``codec`` that is not exact writes a lossy copy instead (``archive_lossy``),
    unless the archive already holds the exact one; with an ``evaluator`` the copy is
    then re-evaluated and the metric change recorded next to the exact metrics.

    A tier that could not be read (an outage, a cold or denied object) proves nothing:
    ``StoreUnavailableError`` is raised and no record is written, so archival can retry.
    """
    manifest = catalog.read_manifest(src, run, step)
    report = ArchiveReport(url=dst.url, digest=manifest.digest, archive_digest=manifest.digest)
    if codec is None or codec.exact or _holds_exact(dst, manifest):
        sizes = _copy(src, dst, manifest, report, progress)
        if not report.problems:
            _verify(dst, manifest, report, sizes)
    else:
        _lossy(src, dst, manifest, codec, report, progress)
        if report.ok and evaluator is not None:
            report.evaluation = _reevaluate(src, dst, manifest, evaluator, evaluator_name, key)
    write_record(
        src,
        Subject.of(manifest),
        "archive",
        {
            "url": dst.url,
            "ok": report.ok,
            "chunks_copied": report.chunks_copied,
            "chunks_present": report.chunks_present,
            "bytes_copied": report.bytes_copied,
            "problems": report.problems[:20],
            "chunks_verified": report.chunks_verified,
            "verified_by": report.verified_by,
            "archive_digest": report.archive_digest,
            "lossy": report.lossy,
            "evaluation": report.evaluation,
        },
    )
    return report


def _holds_exact(dst: Store, manifest: Manifest) -> bool:
    try:
        return catalog.read_manifest(dst.metadata_store(), manifest.run, manifest.step).digest == manifest.digest
    except CkptflowError:
        return False


def _lossy(
    src: Store,
    dst: Store,
    manifest: Manifest,
    codec: ArchiveCodec,
    report: ArchiveReport,
    progress: Callable[[int], None] | None,
) -> None:
    try:
        copy, sizes = write_lossy_copy(src, dst, manifest, codec, progress)
    except CkptflowError as e:
        _problem(report, e)
        return
    report.archive_digest, report.lossy = copy.digest, dict(copy.lossy or {})
    report.chunks_copied, report.bytes_copied = copy.stats.chunks, copy.stats.stored_bytes
    _verify(dst, copy, report, sizes)


def _reevaluate(src: Store, dst: Store, manifest: Manifest, evaluator: Evaluator, name: str, key: str) -> dict:
    """Metrics of the exact checkpoint (its evaluation record, when an evaluator made
    it) and of the lossy copy, and the change: what the archive codec cost."""
    if dst.writes_cold:
        return {"skipped": "the copy is in a cold storage class: thaw it, then evaluate it"}
    record = read_record(src, Subject.of(manifest), "evaluation") or {}
    exact = record.get("metrics") if record.get("source") == "evaluator" else None
    exact = exact or score(src, manifest, evaluator, key)
    lossy = score(dst, catalog.read_manifest(dst, manifest.run, manifest.step), evaluator, key)
    change = {k: lossy[k] - exact[k] for k in lossy if isinstance(exact.get(k), (int, float))}
    return {"evaluator": name or "evaluator", "metrics_exact": exact, "metrics_lossy": lossy, "metric_change": change}


def _copy(
    src: Store, dst: Store, manifest: Manifest, report: ArchiveReport, progress: Callable[[int], None] | None
) -> dict[str, int]:
    """Chunks, then records; the hot copy's size of each chunk (what a cold copy must match)."""
    source = ChunkStore(src)
    sizes: dict[str, int] = {}
    for digest in sorted(manifest.chunks):
        key = fmt.chunk_key(digest)
        if dst.exists(key):
            report.chunks_present += 1
            if dst.writes_cold:
                sizes[key] = src.stat(key).size
            continue
        blob = src.get(key)
        if dst.writes_cold:
            try:
                source.get(digest, manifest.chunks[digest])  # cannot re-read after upload: verify first
            except CkptflowError as e:
                _problem(report, e)
                continue
            sizes[key] = len(blob)
        dst.put_if_absent(key, blob)
        report.chunks_copied += 1
        report.bytes_copied += len(blob)
        if progress:
            progress(len(blob))
    if report.problems:
        return sizes
    meta = dst.metadata_store()
    for key in manifest.rank_keys() + [fmt.manifest_key(manifest.run, manifest.step)]:
        blob = src.get(key)
        if not meta.put_if_absent(key, blob) and meta.get(key) != blob:
            report.problems.append(f"{dst.url}/{key} already holds a different record; not overwritten")
    return sizes


def _verify(dst: Store, manifest: Manifest, report: ArchiveReport, sizes: dict[str, int]) -> None:
    if not dst.writes_cold:
        check = catalog.verify_checkpoint(dst, manifest.run, manifest.step)
        if check.unavailable:
            raise StoreUnavailableError(
                f"could not verify the archive copy of run {manifest.run} step {manifest.step} in {dst.url}: "
                f"{check.problems[0]}; nothing proved it damaged: retry when the store answers"
            )
        report.problems.extend(check.problems)
        report.chunks_verified = check.chunks_checked
        return
    report.verified_by = "size"
    meta = dst.metadata_store()
    try:
        stored = catalog.read_manifest(meta, manifest.run, manifest.step)
        for rank in range(stored.world_size):
            catalog.read_rank_record(meta, stored, rank)
    except CkptflowError as e:
        _problem(report, e)
    for key, size in sizes.items():
        try:
            got = dst.stat(key).size
        except CkptflowError as e:
            _problem(report, e)
            continue
        if got != size:
            report.problems.append(f"{dst.url}/{key} holds {got} bytes, the hot copy {size}")
        else:
            report.chunks_verified += 1


def _problem(report: ArchiveReport, error: CkptflowError) -> None:
    """A failed copy or check: a problem of the copy, unless the store could not be read."""
    if isinstance(error, StoreUnavailableError):
        raise error
    report.problems.append(str(error))


def copy_matches(hot: Store, archive: Store, run: str, step: int) -> str | None:
    """None if ``archive`` holds this exact checkpoint (the same manifest digest as the
    hot copy) and archival verified it there; else why not. Checked right before a
    hot copy is expired."""
    try:
        hot_manifest = catalog.read_manifest(hot, run, step)
    except CkptflowError as e:
        return str(e)
    record = read_record(hot, Subject.of(hot_manifest), "archive") or {}
    if not record.get("ok"):
        return "archival has not verified a copy in the archive tier"
    if record.get("url") not in (None, archive.url):
        return f"it was archived to {record['url']}, not {archive.url}"
    try:
        arc_manifest = catalog.read_manifest(archive.metadata_store(), run, step)
    except CkptflowError as e:
        return str(e)
    expected = record.get("archive_digest") or hot_manifest.digest  # a lossy copy has its own digest
    if arc_manifest.digest != expected:
        return f"the archive's manifest differs ({arc_manifest.digest[:12]}… vs {expected[:12]}…)"
    if arc_manifest.lossy is not None and arc_manifest.lossy.get("source_digest") != hot_manifest.digest:
        return "the archive holds a lossy copy of another commit of this step"
    return None
