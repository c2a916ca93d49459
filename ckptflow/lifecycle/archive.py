"""Archival: copy a checkpoint to another tier, verify it there, and only then commit it there."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.commit import confirm_commit
from ckptflow.catalog.listing import Problem, problem_from
from ckptflow.catalog.verdicts import Subject, read_record, write_record
from ckptflow.chunks import planes
from ckptflow.chunks.io import ChunkStore, plain_encoding
from ckptflow.chunks.leases import Heartbeat, save_lease
from ckptflow.chunks.lossy import ArchiveCodec
from ckptflow.errors import CkptflowError, ObjectNotFoundError, ObjectTooLargeError, StoreUnavailableError
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.format.sealed import MAX_RECORD_BYTES
from ckptflow.lifecycle.archive_lossy import write_lossy_copy
from ckptflow.lifecycle.compress import itemsizes
from ckptflow.lifecycle.evaluate import Evaluator, score
from ckptflow.store.base import Store

Progress = Callable[[int], None]
# A phase that begins later: called as it begins with the bytes it will go over, it returns
# the ``Progress`` for them (so a meter times the phase, not what came before it)
Phase = Callable[[int], Progress | None]


@dataclass
class ArchiveReport:
    url: str = ""
    digest: str = ""
    chunks_copied: int = 0
    chunks_present: int = 0
    chunks_reencoded: int = 0  # chunks the tier held in an encoding this copy cannot use, stored anew plainly
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
    progress: Progress | None = None,
    *,
    verifying: Phase | None = None,
    codec: ArchiveCodec | None = None,
    evaluator: Evaluator | None = None,
    evaluator_name: str = "",
    key: str = "model",
    commit: str | None = None,
) -> ArchiveReport:
    """Copy ``(run, step)`` from ``src`` (the hot store) to ``dst`` with the same commit
    protocol (chunks, then rank records, then the manifest last), and record the outcome
    in ``src`` for the manifest's digest.

    The copy must verify on its own manifest, so the manifest is committed only once
    every chunk has been checked in ``dst``: re-read as a restore of this manifest reads
    it (``verified_by="re-read"``). ``dst`` may already hold a chunk in an encoding this
    manifest cannot use (a delta an archived incremental left, on a base a later full
    does not list); it is stored anew plainly from the verified source, which changes
    no reference (the address is the hash of the raw bytes). A ``dst`` that writes cold
    objects (S3 GLACIER / DEEP_ARCHIVE) cannot be read back until thawed: chunks are
    verified in the source before upload (the upload carries their SHA-256, which S3
    checks), one it holds at another size than the source's copy is stored anew
    plainly, and all are checked by size (``verified_by="size"``); the small records go
    in a readable class (``Store.metadata_store``), so listing, inventory and restore
    planning need no thaw. An archival that fails commits nothing, and a retry repairs
    what an earlier one left.

    A ``codec`` that is not exact writes a lossy copy instead (``archive_lossy``),
    unless the archive already holds the exact one, or the checkpoint is a lossy copy
    already (an import of its export): rounded again, its record would name only the
    second loss, so it is copied as it is, with the record of what it lost; with an
    ``evaluator`` a lossy copy is then re-evaluated and the metric change recorded next
    to the exact metrics.

    From before it looks at ``dst``'s chunks until its commit, the copy holds a save's
    lease there (``ckptflow.chunks.leases``): it reuses chunks ``dst`` already holds (an
    earlier attempt's, which no manifest names yet), so a GC of that tier waits for it, and
    it waits for a GC running there.

    A tier that could not be read (an outage, a cold or denied object) proves nothing:
    ``StoreUnavailableError`` is raised and no record is written, so archival can retry
    (``commit``: the one a caller admitted, ``catalog.read_admitted``).

    ``progress`` is told the stored size of each chunk copied (no total: only what ``dst``
    lacks is copied). The re-read of the copy is a phase of its own: ``verifying`` is
    called as it begins with the content bytes of every chunk of the copy, and the callback
    it returns is told the content size of each chunk as it verifies (a chunk stored anew
    after failing counts once, when it verifies); a cold tier, checked by size, re-reads
    nothing and begins no such phase.
    """
    manifest = catalog.read_admitted(src, run, step, commit, "archival")
    lost = None if manifest.lossy is None else dict(manifest.lossy)
    report = ArchiveReport(url=dst.url, digest=manifest.digest, archive_digest=manifest.digest, lossy=lost)
    with save_lease(dst.metadata_store(), work=f"archival of run {run!r} step {step} into {dst.url}") as lease:
        exact = codec is None or codec.exact or manifest.lossy is not None or _holds_exact(dst, manifest)
        if exact or codec is None:
            _exact(src, dst, manifest, report, progress, verifying, lease)
        else:
            _lossy(src, dst, manifest, codec, report, progress, verifying, lease)
    if not exact and report.ok and evaluator is not None:
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
            "chunks_reencoded": report.chunks_reencoded,
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


def _exact(
    src: Store,
    dst: Store,
    manifest: Manifest,
    report: ArchiveReport,
    progress: Progress | None,
    verifying: Phase | None,
    lease: Heartbeat,
) -> None:
    source = ChunkStore(src).scoped(manifest.chunks, checksums=manifest.fast_checksums, address=manifest.address)
    target = ChunkStore(dst).scoped(manifest.chunks, checksums=manifest.fast_checksums, address=manifest.address)
    kinds = itemsizes(manifest)

    def reencode(digest: str, held: int | None = None) -> int:
        """Store a chunk anew plainly in ``dst`` from its verified bytes in ``src``, unless
        ``dst`` holds it at the ``held`` size of that very encoding; the stored size."""
        itemsize, floating = kinds.get(digest, (1, False))
        raw = source.read_stored(digest, manifest.chunks[digest])[1]
        parts = plain_encoding(raw, itemsize=itemsize, floating=floating)
        if held is not None and planes.size(parts) == held:
            return held  # stored plainly by an earlier archival
        stored = target.replace_verified(digest, len(raw), parts)
        report.chunks_reencoded += 1
        return stored

    sizes = _place(source, target, manifest, report, progress, reencode)
    if report.ok:
        _check_chunks(target, manifest, report, sizes, reencode, verifying)
    if not report.ok:
        return
    try:
        records = [(key, src.get_bounded(key, MAX_RECORD_BYTES)) for key in manifest.rank_keys()]
        blob = src.get_bounded(fmt.manifest_key(manifest.run, manifest.step), MAX_RECORD_BYTES)
    except CkptflowError as e:
        _problem(report, e)
        return
    if fmt.digest_of(blob) != manifest.digest:
        report.problems.append(f"{src.url}/{fmt.manifest_key(manifest.run, manifest.step)} changed while it was copied")
        return
    _commit(dst, manifest, blob, records, report, lease)


def _place(
    source: ChunkStore,
    target: ChunkStore,
    manifest: Manifest,
    report: ArchiveReport,
    progress: Progress | None,
    reencode: Callable[[str, int | None], int],
) -> dict[str, int]:
    """Upload each chunk ``dst`` lacks, verified in the source first; in a cold tier,
    store anew plainly one it holds at a size neither of the source's copy nor of that
    plain encoding (another encoding, which it cannot read back to check). The stored
    size of each chunk in a cold ``dst`` by key."""
    src, dst = source.store, target.store
    sizes: dict[str, int] = {}
    for digest, size in sorted(manifest.chunks.items()):
        key = fmt.chunk_key(digest)
        try:
            if not dst.exists(key):
                blob, _ = source.read_stored(digest, size)
                if dst.put_if_absent(key, blob):
                    report.chunks_copied += 1
                    report.bytes_copied += len(blob)
                    sizes[key] = len(blob)
                    if progress:
                        progress(len(blob))
                    continue
            report.chunks_present += 1
            if dst.writes_cold:
                held = dst.stat(key).size
                sizes[key] = held if held == src.stat(key).size else reencode(digest, held)
        except CkptflowError as e:
            _problem(report, e)
    return sizes


def _lossy(
    src: Store,
    dst: Store,
    manifest: Manifest,
    codec: ArchiveCodec,
    report: ArchiveReport,
    progress: Progress | None,
    verifying: Phase | None,
    lease: Heartbeat,
) -> None:
    try:
        copy = write_lossy_copy(src, dst, manifest, codec, progress)
    except CkptflowError as e:
        _problem(report, e)
        return
    report.archive_digest, report.lossy = copy.manifest.digest, dict(copy.manifest.lossy or {})
    report.chunks_copied, report.bytes_copied = copy.manifest.stats.chunks, copy.manifest.stats.stored_bytes
    report.chunks_reencoded = copy.reencoded
    target = ChunkStore(dst).scoped(
        copy.manifest.chunks, checksums=copy.manifest.fast_checksums, address=copy.manifest.address
    )
    _check_chunks(target, copy.manifest, report, copy.sizes, None, verifying)
    if report.ok:
        _commit(dst, copy.manifest, copy.blob, copy.records, report, lease)


def _reevaluate(src: Store, dst: Store, manifest: Manifest, evaluator: Evaluator, name: str, key: str) -> dict:
    """Metrics of the exact checkpoint (its evaluation record, when this evaluator made
    it: another one's figures are on another scale, so the change would measure the
    evaluators, not the codec) and of the lossy copy, and the change: what the archive
    codec cost."""
    if dst.writes_cold:
        return {"skipped": "the copy is in a cold storage class: thaw it, then evaluate it"}
    name = name or "evaluator"
    record = read_record(src, Subject.of(manifest), "evaluation") or {}
    ours = record.get("source") == "evaluator" and record.get("evaluator") == name
    exact = record.get("metrics") if ours else None
    exact = exact or score(src, manifest, evaluator, key)
    lossy = score(dst, catalog.read_manifest(dst, manifest.run, manifest.step), evaluator, key)
    change = {k: lossy[k] - exact[k] for k in lossy if isinstance(exact.get(k), (int, float))}
    return {"evaluator": name, "metrics_exact": exact, "metrics_lossy": lossy, "metric_change": change}


def _check_chunks(
    target: ChunkStore,
    manifest: Manifest,
    report: ArchiveReport,
    sizes: dict[str, int],
    reencode: Callable[[str, int | None], int] | None,
    verifying: Phase | None,
) -> None:
    """Check every chunk in the tier before the manifest commits. In a readable tier each
    is read back as a restore of this manifest reads it (the ``verifying`` phase); one that
    fails for a cause other than an outage (a delta on a base the manifest does not list or
    that is a delta itself, damaged bytes) is stored anew plainly with ``reencode`` (when
    the source can supply it) and read back again. A cold tier is checked by size."""
    if target.store.writes_cold:
        report.verified_by = "size"
        for key, size in sizes.items():
            try:
                got = target.store.stat(key).size
            except CkptflowError as e:
                _problem(report, e)
                continue
            if got != size:
                report.problems.append(f"{target.store.url}/{key} holds {got} bytes, {size} were stored")
            else:
                report.chunks_verified += 1
        return
    progress = verifying(sum(manifest.chunks.values())) if verifying else None
    failed = _unverified(target, manifest, manifest.chunks, progress)
    if failed and reencode is not None:
        for digest in sorted(failed):
            try:
                reencode(digest, None)
            except CkptflowError as e:
                _problem(report, e)
        failed = _unverified(target, manifest, {d: manifest.chunks[d] for d in failed}, progress)
    report.problems.extend(failed.values())
    report.chunks_verified = len(manifest.chunks) - len(failed)


def _unverified(
    target: ChunkStore, manifest: Manifest, chunks: Mapping[str, int], progress: Progress | None
) -> dict[str, str]:
    """The chunks that fail verification in the tier, with why; ``StoreUnavailableError``
    if one could not be read (that proves nothing). ``progress``: each one that verifies."""

    def check(item: tuple[str, int]) -> Problem | None:
        try:
            target.get(*item)
        except (CkptflowError, OSError) as e:
            return problem_from(manifest.run, manifest.step, e)
        if progress:
            progress(item[1])
        return None

    with ThreadPoolExecutor(8, thread_name_prefix="ckptflow-archive") as pool:
        found = dict(zip(sorted(chunks), pool.map(check, sorted(chunks.items()))))
    for problem in found.values():
        if problem is not None and problem.could_not_read:
            raise StoreUnavailableError(
                f"could not verify the archive copy of run {manifest.run} step {manifest.step} in "
                f"{target.store.url}: {problem.message}; nothing proved it damaged: retry when the store answers"
            )
    return {d: p.message for d, p in found.items() if p is not None}


def _commit(
    dst: Store,
    manifest: Manifest,
    blob: bytes,
    records: list[tuple[str, bytes]],
    report: ArchiveReport,
    lease: Heartbeat,
) -> None:
    """Rank records, checked as read back, then the manifest, create-only, then the
    manifest and the records read back. Another commit of this step already in ``dst`` is
    left as it is. Rank records are replaced only while no manifest names them: what is
    there then was left by an attempt that failed or was killed before its commit (a lossy
    copy's records, say, before an exact archival of the same step), which no restore
    reads; a concurrent archival of the same step that replaced them after this one
    checked them is caught by the read-back after the commit."""
    meta, key = dst.metadata_store(), fmt.manifest_key(manifest.run, manifest.step)
    if lease.lost:  # GC of the tier may have judged it dead and swept chunks this copy checked
        raise StoreUnavailableError(
            f"the lease of the archival of run {manifest.run!r} step {manifest.step} in {dst.url} could not be "
            "renewed, so GC of that tier may have swept chunks of the copy; nothing was committed: archive again"
        )
    try:
        try:
            held: bytes | None = meta.get_bounded(key, MAX_RECORD_BYTES)
        except ObjectNotFoundError:
            held = None
        except ObjectTooLargeError:
            held = b""
        if held is not None and held != blob:
            report.problems.append(f"{dst.url}/{key} already holds another commit of this step; not overwritten")
            return
        for record_key, record in records:
            if held is None:
                meta.replace(record_key, record)
            elif not meta.put_if_absent(record_key, record) and meta.get(record_key) != record:
                report.problems.append(f"{dst.url}/{record_key} already holds a different record; not overwritten")
        if report.problems:
            return
        for rank in range(manifest.world_size):
            catalog.read_rank_record(meta, manifest, rank)
        if not meta.put_if_absent(key, blob) and meta.get(key) != blob:
            report.problems.append(f"{dst.url}/{key} was committed by another writer meanwhile; not overwritten")
            return
        if lease.lost:  # stalled since the check above: the tier's GC may have swept the copy meanwhile
            what = f"the lease of the archival of run {manifest.run!r} step {manifest.step}"
            confirm_commit(meta, manifest, blob, lease=what, again="archive", chunks=dst)
        if catalog.read_manifest(meta, manifest.run, manifest.step).digest != manifest.digest:
            report.problems.append(f"{dst.url}/{key} does not read back as the manifest committed")
            return
        for record_key, record in records if held is None else ():  # only then could another archival replace them
            if meta.get(record_key) != record:
                report.problems.append(f"{dst.url}/{record_key} changed while this copy was committed")
    except CkptflowError as e:
        _problem(report, e)


def _problem(report: ArchiveReport, error: CkptflowError) -> None:
    """A failed copy or check: a problem of the copy, unless the store could not be read."""
    if isinstance(error, StoreUnavailableError):
        raise error
    report.problems.append(str(error))
