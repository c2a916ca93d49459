"""What a store holds: the one walk over runs and checkpoints, and verification.

Every module that asks "which checkpoints exist" (the Checkpointer, the CLI, GC,
stats, the inventory, export, the landing sensor) asks it here, so an unreadable,
cold, denied or malformed checkpoint is treated the same way everywhere: as a
``Problem`` on its own line, never an exception that ends a whole listing.

``listing`` walks names only (one listing per run, no reads); ``committed`` reads and
parses the commit records the listing found, a bounded number at a time in parallel
(a store with thousands of checkpoints on S3 is thousands of GETs).
"""

from __future__ import annotations

import errno
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptflow import format as fmt
from ckptflow.chunks import ChunkStore
from ckptflow.errors import (
    CkptflowError,
    ColdObjectError,
    InvalidNameError,
    ManifestError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    RecordTooLargeError,
    StoreError,
    SymlinkError,
)
from ckptflow.index import ObjectIndex, manifest_summary
from ckptflow.manifest import Manifest, RankRecord
from ckptflow.sealed import MAX_RECORD_BYTES
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
    bytes_written: int = 0
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
            base_step=m.base_step,
            digest=m.digest,
            lossy=dict(m.lossy) if m.lossy is not None else None,
        )


@dataclass(frozen=True)
class Problem:
    """A run or checkpoint that cannot be read, and why. ``kind`` is one of ``KINDS``."""

    run: str
    step: int | None
    kind: str
    message: str

    KINDS = (
        "corrupt", "too_big", "cold", "denied", "symlink", "loop", "unavailable", "bad_name", "not_a_directory",
        "unreadable",
    )  # fmt: skip

    def __str__(self) -> str:
        where = f"run {self.run}" + ("" if self.step is None else f" step {self.step}")
        return f"{where}: {self.message}"


RANKS_ROLLED = "/ranks/"  # what ``listing(manifests_only=True)`` rolls a step's rank records up at


@dataclass(frozen=True)
class StepListing:
    """A step directory as listed (nothing read): its commit record, if any, and files."""

    run: str
    step: int
    manifest: ObjectInfo | None  # None: uncommitted (a save in flight, or one that died)
    files: tuple[ObjectInfo, ...]

    @property
    def committed(self) -> bool:
        return self.manifest is not None


def problem_from(run: str, step: int | None, error: BaseException) -> Problem:
    """Classify a read failure. Only ``corrupt`` is proof of damage; the others say the
    checkpoint could not be looked at (and might be fine)."""
    if isinstance(error, RecordTooLargeError):
        kind = "too_big"
    elif isinstance(error, ManifestError):
        kind = "corrupt"
    elif isinstance(error, ColdObjectError):
        kind = "cold"
    elif isinstance(error, InvalidNameError):
        kind = "bad_name"
    elif isinstance(error, SymlinkError):
        kind = "symlink"
    elif isinstance(error, StoreError):
        kind = "unavailable"
    elif isinstance(error, PermissionError):
        kind = "denied"
    elif isinstance(error, OSError) and error.errno == errno.ELOOP:
        kind = "loop"
    else:
        kind = "unreadable"
    message = str(error) if isinstance(error, CkptflowError) else f"{type(error).__name__}: {error}"
    return Problem(run, step, kind, message)


def run_names(store: Store) -> list[str]:
    """Every directory under ``runs/``, valid run name or not (``listing`` reports the others)."""
    return [
        i.key.rstrip("/").rsplit("/", 1)[-1]
        for i in store.list(fmt.runs_prefix(), recursive=False)
        if i.key.endswith("/")
    ]


def list_runs(store: Store) -> list[str]:
    """The valid run names in the store."""
    out = []
    for name in run_names(store):
        try:
            out.append(fmt.validate_run(name))
        except InvalidNameError:
            continue
    return out


def _run_listing(
    store: Store, run: str, from_step: int | None = None, manifests_only: bool = False
) -> Iterator[StepListing | Problem]:
    prefix = fmt.checkpoints_prefix(run)
    # every key of ``from_step`` sorts after its bare directory name
    start = "" if from_step is None else f"{prefix}{fmt.validate_step(from_step):0{fmt.STEP_DIGITS}d}"
    try:
        if from_step is None and not manifests_only:
            listed = list(store.list(prefix))
        else:
            listed = list(store.list_after(prefix, start, roll_up=RANKS_ROLLED if manifests_only else ""))
    except SymlinkError:  # somewhere below: find which step, so only that step is a problem
        yield from _steps_one_by_one(store, run)
        return
    yield from _grouped(store, run, listed)


def _steps_one_by_one(store: Store, run: str) -> Iterator[StepListing | Problem]:
    for entry in store.list(fmt.checkpoints_prefix(run), recursive=False):
        step = fmt.parse_step_dir(entry.key)
        if step is None:
            continue
        try:
            yield from _grouped(store, run, list(store.list(entry.key)) if entry.key.endswith("/") else [entry])
        except SymlinkError as e:
            yield problem_from(run, step, e)


def _grouped(store: Store, run: str, listed: list[ObjectInfo]) -> Iterator[StepListing | Problem]:
    """Step listings (ascending) from the objects under a run's checkpoints."""
    prefix = fmt.checkpoints_prefix(run)
    by_step: dict[int, list[ObjectInfo]] = {}
    for info in listed:
        name, _, rest = info.key[len(prefix) :].partition("/")
        step = fmt.parse_step_dir(name)
        if step is None:
            continue
        if not rest:
            yield Problem(
                run,
                step,
                "not_a_directory",
                f"{store.url}/{info.key} is a file where a step directory belongs; move it away",
            )
            continue
        by_step.setdefault(step, []).append(info)
    for step in sorted(by_step):
        files = by_step[step]
        key = fmt.manifest_key(run, step)
        manifest = next((f for f in files if f.key == key), None)
        yield StepListing(run, step, manifest, tuple(files))


def listing(
    store: Store, run: str | None = None, *, from_steps: dict[str, int] | None = None, manifests_only: bool = False
) -> Iterator[StepListing | Problem]:
    """Every step directory of ``run`` (or of every run), ascending, without reading a
    record; a run directory that cannot be listed or is badly named is a ``Problem``.
    A run named in ``from_steps`` is listed from that step on (one listing of what
    follows it, where the store can start a listing there). ``manifests_only`` is for
    readers of the commit records alone: each step's rank records are one entry of its
    ``files`` (``<step>/ranks/``), so the listing does not grow with the ranks."""
    for name in [run] if run is not None else run_names(store):
        try:
            fmt.validate_run(name)
        except InvalidNameError as e:
            yield Problem(
                name,
                None,
                "bad_name",
                f"{store.url}/runs/{name}: {e}; ckptflow never writes such a directory: move it out of the store",
            )
            continue
        try:
            yield from _run_listing(store, name, (from_steps or {}).get(name), manifests_only)
        except (CkptflowError, OSError) as e:
            yield problem_from(name, None, e)


def committed_steps(store: Store, run: str) -> list[int]:
    """Steps of ``run`` that have a commit record (valid or not), ascending; no reads."""
    return [s.step for s in listing(store, run) if isinstance(s, StepListing) and s.committed]


def step_dirs(store: Store, run: str) -> list[int]:
    """Steps of ``run`` that have a directory (committed or not), ascending: one listing
    of directory names, so its cost does not grow with the files (ranks) of each step."""
    prefix = fmt.checkpoints_prefix(run)
    steps = [
        fmt.parse_step_dir(i.key[len(prefix) : -1]) for i in store.list(prefix, recursive=False) if i.key.endswith("/")
    ]
    return sorted(s for s in steps if s is not None)


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
        elif isinstance(result, (CkptflowError, OSError)):
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
        index = ObjectIndex(store, f"runs/{name}", manifest_summary)
        values = index.values(e.manifest for e in steps)  # type: ignore[misc]
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
    """Committed checkpoints of ``run`` whose manifest is intact, ascending by step."""
    return [i for i in summaries(store, run) if isinstance(i, CheckpointInfo)]


# ---- verification ------------------------------------------------------------------------
@dataclass
class VerifyReport:
    step: int
    ok: bool
    problems: list[str] = field(default_factory=list)
    chunks_checked: int = 0
    bytes_checked: int = 0
    digest: str = ""  # sha256 of the manifest file that was verified ("" if there was none)


def _rank_problems(store: Store, manifest: Manifest) -> list[str]:
    """Rank records: one listing finds the missing ones (reported as one line however many,
    without a list the size of ``world_size``), then each present one is read and checked."""
    prefix = fmt.step_prefix(manifest.run, manifest.step) + "ranks/"
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
            problems.append(f"rank record {store.url}/{manifest.rank_key(shown[0])} is missing")
        else:
            listed = ", ".join(map(str, shown)) + (
                f", … ({missing_count} in all)" if missing_count > len(shown) else ""
            )
            problems.append(
                f"rank records of {missing_count} of {manifest.world_size} ranks are missing from "
                f"{store.url}/{prefix} (ranks {listed})"
            )
    for rank in present:
        try:
            read_rank_record(store, manifest, rank)
        except (CkptflowError, OSError) as e:
            problems.append(problem_from(manifest.run, manifest.step, e).message)
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
    cannot be read (damaged, denied, a link, an outage) is a problem in the report.
    ``deep`` re-hashes every chunk's sha256 address; otherwise chunks are checked as
    restore checks them (the manifest's fast checksums, ``ckptflow.checksum``)."""
    key = fmt.manifest_key(run, step)
    try:
        blob = _read_record(store, key, "manifest")
    except ObjectNotFoundError:
        return VerifyReport(step, False, [f"no manifest at {store.url}/{key}: the checkpoint was never committed"])
    except (CkptflowError, OSError) as e:
        return VerifyReport(step, False, [problem_from(run, step, e).message])
    try:
        manifest = Manifest.parse(blob, f"manifest {store.url}/{key}", run=run, step=step)
        problems = _rank_problems(store, manifest)
    except ManifestError as e:
        return VerifyReport(step, False, [str(e)], digest=fmt.digest_of(blob))
    except (CkptflowError, OSError) as e:
        return VerifyReport(step, False, [problem_from(run, step, e).message], digest=fmt.digest_of(blob))
    report = VerifyReport(step=step, ok=True, problems=problems, digest=manifest.digest)
    # a delta's base must be one of the manifest's own chunks
    chunks = ChunkStore(store, manifest.chunks, None if deep else manifest.fast_checksums, manifest.address)

    def check(item: tuple[str, int]) -> str | None:
        digest, size = item
        try:
            chunks.get(digest, size)
        except (CkptflowError, OSError) as e:
            return problem_from(run, step, e).message
        finally:
            if progress:
                progress(size)
        return None

    items = list(manifest.chunks.items())
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(8)
    try:
        report.problems.extend(p for p in pool.map(check, items) if p)
    finally:
        if own_pool:
            pool.shutdown()
    report.chunks_checked = len(items)
    report.bytes_checked = sum(size for _, size in items)
    report.ok = not report.problems
    return report
