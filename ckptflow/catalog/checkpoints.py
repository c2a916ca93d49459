"""What a store holds, read: the commit records a listing found, and verification.

Every module that asks "which checkpoints exist" (the Checkpointer, the CLI, GC,
stats, the inventory, export, the landing sensor) asks it here, or of
``catalog_listing`` for names alone, so an unreadable, cold, denied or malformed
checkpoint is treated the same way everywhere: as a ``Problem`` on its own line,
never an exception that ends a whole listing.

``catalog_listing.listing`` walks names only (one listing per run, no reads);
``committed`` reads and parses the commit records the listing found, a bounded number
at a time in parallel (a store with thousands of checkpoints on S3 is thousands of GETs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptflow.catalog.listing import Problem, StepListing, listing, problem_from
from ckptflow.catalog.object_index import ObjectIndex
from ckptflow.chunks.io import ChunkStore
from ckptflow.errors import (
    CHECK_ERRORS,
    CkptflowError,
    ManifestError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    RecordTooLargeError,
    is_damage,
)
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest, RankRecord
from ckptflow.format.sealed import MAX_RECORD_BYTES
from ckptflow.store.base import ObjectInfo, Store


@dataclass(frozen=True)
class CheckpointInfo:
    """A summary of one committed checkpoint (what ``ls`` and ``Checkpointer.list`` show)."""

    step: int
    kind: str
    created_at: float
    logical_bytes: int
    stored_bytes: int
    metadata: dict = field(default_factory=dict)
    run: str = ""
    world_size: int = 1
    chunks: int = 0
    bytes_written: int = 0  # raw bytes of the chunks the save wrote
    added_bytes: int = 0  # the same chunks as stored (encoded): what the save added to the store
    bytes_unread: int = 0  # of the state, not even read by the save (``ckptflow.dcp.written_pages``)
    base_step: int | None = None
    digest: str = ""  # sha256 of the manifest file: names this exact checkpoint
    lossy: dict | None = None  # a lossy archive copy: what it lost and the exact commit it came from

    @classmethod
    def from_manifest(cls, m: Manifest) -> CheckpointInfo:
        return cls(
            step=m.step,
            kind=m.kind,
            created_at=m.created_at,
            logical_bytes=m.stats.logical_bytes,
            stored_bytes=m.stats.stored_bytes,
            metadata=dict(m.metadata),
            run=m.run,
            world_size=m.world_size,
            chunks=m.stats.chunks,
            bytes_written=m.stats.bytes_written,
            added_bytes=m.stats.added_bytes,
            bytes_unread=m.stats.bytes_unread,
            base_step=m.base_step,
            digest=m.digest,
            lossy=dict(m.lossy) if m.lossy is not None else None,
        )


def _read_record(store: Store, key: str, what: str) -> bytes:
    """A sealed record's bytes, refused unread when larger than any ckptflow writes."""
    try:
        return store.get_bounded(key, MAX_RECORD_BYTES)
    except ObjectTooLargeError as e:
        raise RecordTooLargeError(f"{what} {e}; no ckptflow record is that large: it is corrupt or hostile") from None


def read_manifest(store: Store, run: str, step: int) -> Manifest:
    """The verified, parsed manifest; ``ManifestError`` (or a store error) says why not."""
    key = fmt.manifest_key(run, step)
    try:
        blob = _read_record(store, key, "manifest")
    except ObjectNotFoundError:
        raise ManifestError(
            f"no manifest at {store.url}/{key}: the checkpoint was never committed (or was deleted)"
        ) from None
    return Manifest.parse(blob, f"manifest {store.url}/{key}", run=run, step=step)


def read_admitted(store: Store, run: str, step: int, commit: str | None, work: str) -> Manifest:
    """``read_manifest``, for ``work`` on the commit ``commit`` a caller admitted (its
    validation not failed; None: any): another commit there now (the step committed again
    since) raises before the work reads or records anything about it."""
    manifest = read_manifest(store, run, step)
    if commit is not None and manifest.digest != commit:
        raise CkptflowError(
            f"run {run!r} step {step} in {store.url} was committed again since it was admitted for {work} (manifest "
            f"{commit[:12]}… is now {manifest.digest[:12]}…); nothing was recorded: the new commit gets its {work} "
            "once its validation passes"
        )
    return manifest


def manifest_or_damage(store: Store, run: str, step: int) -> Manifest | CkptflowError:
    """The manifest at ``(run, step)``, or the error proving it damaged or absent. An
    error that proves nothing (an outage, a denied or cold object, a newer format) is
    raised: whoever deletes on what this says decides nothing on a read that failed."""
    try:
        return read_manifest(store, run, step)
    except CkptflowError as e:
        if not is_damage(e):
            raise
        return e


def read_rank_record(store: Store, manifest: Manifest, rank: int) -> RankRecord:
    """The rank record ``manifest`` committed for ``rank``, verified to belong to it."""
    key = manifest.rank_key(rank)
    try:
        blob = _read_record(store, key, "rank record")
    except ObjectNotFoundError:
        raise ManifestError(f"rank record {store.url}/{key} is missing") from None
    return RankRecord.parse(blob, f"rank record {store.url}/{key}", manifest, rank)


def _ordered(items: Iterable[Any], fn: Callable[[Any], Any], threads: int) -> Iterator[tuple[Any, Any]]:
    """``(item, fn(item) or the exception)`` in input order, at most ``2 * threads`` in flight."""
    with ThreadPoolExecutor(threads, thread_name_prefix="ckptflow-catalog") as pool:
        window: deque[tuple[Any, Future]] = deque()
        for item in items:
            window.append((item, pool.submit(fn, item)))
            if len(window) >= 2 * threads:
                yield _take(window)
        while window:
            yield _take(window)


def _take(window: deque) -> tuple[Any, Any]:
    item, future = window.popleft()
    try:
        return item, future.result()
    except BaseException as e:  # reported per item by the caller
        return item, e


def committed(
    store: Store,
    run: str | None = None,
    *,
    listed: Iterable[StepListing | Problem] | None = None,
    threads: int | None = None,
) -> Iterator[Manifest | Problem]:
    """Each committed checkpoint of ``run`` (or every run) as a parsed ``Manifest``, or a
    ``Problem`` for one that cannot be read; ascending by run, then step. ``listed``
    reads the commit records of a ``listing`` the caller already holds."""

    def read(entry: StepListing | Problem) -> Manifest | Problem:
        return entry if isinstance(entry, Problem) else read_manifest(store, entry.run, entry.step)

    source = listing(store, run) if listed is None else listed
    wanted = (e for e in source if isinstance(e, Problem) or e.committed)
    # reads of a page cache gain little from threads (JSON parsing holds the GIL); a
    # remote store's latency hides behind them
    for entry, result in _ordered(wanted, read, threads or (2 if store.cheap_reread else 16)):
        if isinstance(result, (Manifest, Problem)):
            yield result
        elif isinstance(result, ObjectNotFoundError):
            continue  # deleted between the listing and the read: it no longer exists
        elif isinstance(result, CHECK_ERRORS):
            yield problem_from(entry.run, entry.step, result)
        else:
            raise result


def summaries(store: Store, run: str | None = None) -> Iterator[CheckpointInfo | Problem]:
    """What ``committed`` tells of each checkpoint but its chunk lists (what ``ls``, the
    inventory and retention need), read through each run's listing-validated index: one
    read per run once the store is known, plus the manifests that are new."""
    listed = list(listing(store, run, manifests_only=True))
    for name in dict.fromkeys(e.run for e in listed if isinstance(e, StepListing)):
        steps = [e for e in listed if isinstance(e, StepListing) and e.run == name and e.manifest is not None]
        values = summary_index(store, name).values(e.manifest for e in steps)  # type: ignore[misc]
        for entry in steps:
            key = fmt.manifest_key(name, entry.step)
            value = values[key]
            if isinstance(value, ObjectNotFoundError):
                continue  # deleted since the listing
            if isinstance(value, Exception):
                yield problem_from(name, entry.step, value)
            elif (value["run"], value["step"]) != (name, entry.step):
                claims = f"run {value['run']!r} step {value['step']}"
                message = f"manifest {store.url}/{key} describes {claims}: it was copied to the wrong place"
                yield Problem(name, entry.step, "corrupt", message)
            else:
                yield CheckpointInfo(**value)
    yield from (e for e in listed if isinstance(e, Problem))


def list_checkpoints(store: Store, run: str) -> list[CheckpointInfo]:
    """Committed checkpoints of ``run``, ascending by step, less those whose manifest did not
    parse when last read. A manifest is read again only when the listing shows it written
    since (``ckptflow.catalog.object_index``), so this lists commits: damage that no write records (bit rot
    on the device) is not seen here, but by verify, restore and scrub, which read it."""
    return [i for i in summaries(store, run) if isinstance(i, CheckpointInfo)]


# ---- verification ------------------------------------------------------------------------
@dataclass
class VerifyReport:
    """What verifying one checkpoint found. Each finding is classified once
    (``catalog_listing.problem_from``): proof of damage, or something that could not be
    read (an outage, a cold or denied object, a link), which proves nothing."""

    step: int
    findings: list[Problem] = field(default_factory=list)
    chunks_checked: int = 0
    bytes_checked: int = 0
    digest: str = ""  # sha256 of the manifest file that was verified ("" if there was none)
    metadata: Mapping[str, Any] = field(default_factory=dict)  # the verified manifest's

    @property
    def ok(self) -> bool:
        """Everything was read and verified."""
        return not self.findings

    @property
    def problems(self) -> list[str]:
        return [p.message for p in self.findings]

    @property
    def damaged(self) -> bool:
        """Proof the checkpoint is bad: a verdict (whatever else could not be read)."""
        return any(not p.could_not_read for p in self.findings)

    @property
    def newer(self) -> Problem | None:
        """A record a newer ckptflow wrote, when nothing proved damage: no verdict, upgrade."""
        return None if self.damaged else next((p for p in self.findings if p.kind == "newer"), None)

    @property
    def unavailable(self) -> bool:
        """Something could not be read and nothing proved damage: no verdict either way."""
        return bool(self.findings) and not self.damaged

    @property
    def cold(self) -> bool:
        """Unavailable, and some of it is in a cold storage class: no retry reads it before a thaw."""
        return self.unavailable and any(p.kind == "cold" for p in self.findings)


def _rank_problems(store: Store, manifest: Manifest) -> list[Problem]:
    """Rank records: one listing finds the missing ones (reported as one line however many,
    without a list the size of ``world_size``), then each present one is read and checked."""
    run, step = manifest.run, manifest.step
    prefix = fmt.step_prefix(run, step) + "ranks/"
    present = sorted({rank for rank in (manifest.rank_of(i.key) for i in store.list(prefix)) if rank is not None})
    problems = []
    missing_count = manifest.world_size - len(present)
    if missing_count:
        shown: list[int] = []
        have = set(present)
        for rank in range(manifest.world_size):
            if rank not in have:
                shown.append(rank)
                if len(shown) == 8:
                    break
        if missing_count == 1:
            message = f"rank record {store.url}/{manifest.rank_key(shown[0])} is missing"
        else:
            listed = ", ".join(map(str, shown)) + (
                f", … ({missing_count} in all)" if missing_count > len(shown) else ""
            )
            message = (
                f"rank records of {missing_count} of {manifest.world_size} ranks are missing from "
                f"{store.url}/{prefix} (ranks {listed})"
            )
        problems.append(Problem(run, step, "corrupt", message))
    for rank in present:
        try:
            read_rank_record(store, manifest, rank)
        except CHECK_ERRORS as e:
            problems.append(problem_from(run, step, e))
    return problems


def verify_checkpoint(
    store: Store,
    run: str,
    step: int,
    pool: ThreadPoolExecutor | None = None,
    progress: Callable[[int], None] | None = None,
    *,
    deep: bool = True,
) -> VerifyReport:
    """Re-read everything a checkpoint needs: manifest, rank records, every chunk. Whatever
    is wrong is a finding in the report: damage, or what could not be read (denied, a
    link, an outage), which the report keeps apart (``VerifyReport.unavailable``).
    ``deep`` re-hashes every chunk's address (``ckptflow.format.checksum``); otherwise chunks are checked as
    restore checks them (the manifest's fast checksums, ``ckptflow.format.checksum``)."""
    key = fmt.manifest_key(run, step)
    try:
        blob = _read_record(store, key, "manifest")
    except ObjectNotFoundError:
        message = f"no manifest at {store.url}/{key}: the checkpoint was never committed"
        return VerifyReport(step, [Problem(run, step, "corrupt", message)])
    except (CkptflowError, OSError) as e:  # a read alone: nothing was decoded yet
        return VerifyReport(step, [problem_from(run, step, e)])
    try:
        manifest = Manifest.parse(blob, f"manifest {store.url}/{key}", run=run, step=step)
        problems = _rank_problems(store, manifest)
    except CHECK_ERRORS as e:
        return VerifyReport(step, [problem_from(run, step, e)], digest=fmt.digest_of(blob))
    report = VerifyReport(step=step, findings=problems, digest=manifest.digest, metadata=manifest.metadata)
    # a delta's base must be one of the manifest's own chunks
    chunks = ChunkStore(
        store,
        scope=manifest.chunks,
        checksums=None if deep else manifest.fast_checksums,
        address=manifest.address,
    )

    def check(item: tuple[str, int]) -> Problem | None:
        digest, size = item
        try:
            chunks.get(digest, size)
        except CHECK_ERRORS as e:
            return problem_from(run, step, e)
        finally:
            if progress:
                progress(size)
        return None

    items = list(manifest.chunks.items())
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(8)
    try:
        report.findings.extend(p for p in pool.map(check, items) if p)
    finally:
        if own_pool:
            pool.shutdown()
    report.chunks_checked = len(items)
    report.bytes_checked = sum(size for _, size in items)
    return report


SUMMARY_SCHEMA = 2  # 2: ``CheckpointInfo.added_bytes``


def summary_index(store: Store, run: str) -> ObjectIndex:
    """The index of ``run``'s manifest summaries (``manifest_summary``)."""
    return ObjectIndex(store, f"runs/{run}", manifest_summary, limit=MAX_RECORD_BYTES, schema=SUMMARY_SCHEMA)


def manifest_summary(info: ObjectInfo, blob: bytes) -> dict[str, Any]:
    """What ``ls`` and the inventory need of a manifest (``CheckpointInfo``: not its chunk list)."""
    return asdict(CheckpointInfo.from_manifest(Manifest.parse(blob, f"manifest {info.key}")))
