"""Storage accounting: how much each run costs and how much dedup and compression save.

Pure functions over a ``Store`` (they only list and read), so the CLI's ``stats``
command and a Dagster storage-metrics asset report the same numbers.

Three byte measures, because each answers a different question:

* logical: the tensor bytes a checkpoint holds, counted for every checkpoint (what a
  naive "one file per checkpoint" layout would store);
* unique: the raw bytes of the distinct chunks referenced (what dedup leaves);
* stored: the on-disk sizes of those chunk files (what compression leaves, headers
  included).

The stored bytes are further split by how the chunks are encoded, as far as manifests
tell without reading a chunk: ``delta`` (a manifest lists a base for it), ``base``
(kept only because a delta needs it), ``lossy`` (referenced only by lossy archive
copies) and ``plain`` (raw or zstd). ``costs`` prices all of it.
"""

from __future__ import annotations

from collections.abc import KeysView
from dataclasses import dataclass, field

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.gc import chunks_kept_for
from ckptflow.chunks import damaged
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.store.base import Store


class _Ratios:
    """Dedup = logical / unique bytes; compression = unique / stored bytes."""

    logical_bytes: int
    unique_bytes: int
    stored_bytes: int

    @property
    def dedup_ratio(self) -> float | None:
        return _ratio(self.logical_bytes, self.unique_bytes)

    @property
    def compression_ratio(self) -> float | None:
        return _ratio(self.unique_bytes, self.stored_bytes)


@dataclass(frozen=True)
class RunStats(_Ratios):
    run: str
    checkpoints: int
    logical_bytes: int  # summed over checkpoints
    unique_bytes: int  # raw bytes of the distinct chunks the run's checkpoints reference
    stored_bytes: int  # on-disk size of those chunk files
    missing_chunks: int = 0  # referenced but absent from the store (verify will fail)

    def as_dict(self) -> dict:
        return {
            "run": self.run,
            "checkpoints": self.checkpoints,
            "logical_bytes": self.logical_bytes,
            "unique_bytes": self.unique_bytes,
            "stored_bytes": self.stored_bytes,
            "missing_chunks": self.missing_chunks,
            "dedup_ratio": self.dedup_ratio,
            "compression_ratio": self.compression_ratio,
        }


@dataclass(frozen=True)
class EncodingBytes:
    """Raw and stored bytes of the present, referenced chunks of one kind of encoding."""

    chunks: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0

    def as_dict(self) -> dict:
        return {"chunks": self.chunks, "raw_bytes": self.raw_bytes, "stored_bytes": self.stored_bytes}


@dataclass(frozen=True, kw_only=True)
class Held:
    """One checkpoint a store holds: its logical bytes as stored, and those of the
    exact checkpoint (larger for a lossy copy that dropped the optimizer)."""

    logical_bytes: int
    exact_logical_bytes: int
    lossy: bool


@dataclass(frozen=True)
class StoreStats(_Ratios):
    """Per-run numbers plus the whole store, where dedup across runs shows up."""

    runs: list[RunStats]
    checkpoints: int
    logical_bytes: int
    unique_bytes: int  # over all runs: a chunk shared by two runs counts once
    stored_bytes: int  # on-disk size of all referenced chunk files
    chunk_files: int  # every chunk file in the store, referenced or not
    chunk_file_bytes: int
    unreferenced_chunks: int  # named by no commit record GC keeps chunks for (its candidates once old)
    unreferenced_bytes: int
    garbage_untold: bool = False  # a commit record's chunks cannot be told: GC sweeps nothing until it is resolved
    unreadable_record_bytes: int = 0  # chunk files only unreadable commit records name (GC keeps them): not garbage
    unreadable_manifests: list[str] = field(default_factory=list)
    encodings: dict[str, EncodingBytes] = field(default_factory=dict)  # "plain", "delta", "lossy", "base"
    data_bytes: int = 0  # raw bytes of the distinct chunks tensors are made of (bases only deltas need excluded)
    missing_raw_bytes: int = 0  # data chunks absent from the store
    held: dict[tuple[str, int, str], Held] = field(default_factory=dict)  # by commit: run, step, digest
    damaged_chunks: int | None = None  # stored objects a reader refused (``damaged``); None: not counted

    def as_dict(self) -> dict:
        return {
            "runs": [r.as_dict() for r in self.runs],
            "store": {
                "checkpoints": self.checkpoints,
                "logical_bytes": self.logical_bytes,
                "unique_bytes": self.unique_bytes,
                "stored_bytes": self.stored_bytes,
                "dedup_ratio": self.dedup_ratio,
                "compression_ratio": self.compression_ratio,
                "chunk_files": self.chunk_files,
                "chunk_file_bytes": self.chunk_file_bytes,
                "unreferenced_chunks": self.unreferenced_chunks,
                "unreferenced_bytes": self.unreferenced_bytes,
                "garbage_untold": self.garbage_untold,
                "unreadable_record_bytes": self.unreadable_record_bytes,
                "unreadable_manifests": list(self.unreadable_manifests),
                "encodings": {k: v.as_dict() for k, v in sorted(self.encodings.items())},
                "data_bytes": self.data_bytes,
                "missing_raw_bytes": self.missing_raw_bytes,
                "damaged_chunks": self.damaged_chunks,
            },
        }


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def chunk_file_sizes(store: Store) -> dict[str, int]:
    """On-disk size of every chunk file, by digest (one listing, no reads)."""
    sizes = {}
    for info in store.list("chunks/"):
        digest = info.key.rsplit("/", 1)[-1]
        if fmt.is_digest(digest):  # skip claim files and other debris
            sizes[digest] = info.size
    return sizes


def _run_stats(run: str, manifests: list[Manifest], sizes: dict[str, int]) -> tuple[RunStats, dict[str, int]]:
    referenced: dict[str, int] = {}
    for manifest in manifests:
        referenced.update(manifest.chunks)
    present = [d for d in referenced if d in sizes]
    stats = RunStats(
        run=run,
        checkpoints=len(manifests),
        logical_bytes=sum(m.stats.logical_bytes for m in manifests),
        unique_bytes=sum(referenced.values()),
        stored_bytes=sum(sizes[d] for d in present),
        missing_chunks=len(referenced) - len(present),
    )
    return stats, referenced


def encodings(manifests: list[Manifest], sizes: dict[str, int]) -> tuple[dict[str, EncodingBytes], int, int]:
    """Present referenced chunks split into plain / delta / lossy / base (needed only as
    a delta's base); the raw bytes of the distinct data chunks (what the tensors need
    after dedup), and of those that are missing."""
    raw: dict[str, int] = {}
    data: set[str] = set()
    deltas: set[str] = set()
    exact_refs: set[str] = set()
    for m in manifests:
        raw.update(m.chunks)
        deltas.update(m.bases)
        own = {d for item in m.items() for d, _ in item.chunks}
        data |= own
        if m.lossy is None:
            exact_refs |= own
    totals: dict[str, list[int]] = {k: [0, 0, 0] for k in ("plain", "delta", "lossy", "base")}
    missing = 0
    for digest, n in raw.items():
        if digest not in sizes:
            missing += n if digest in data else 0
            continue
        kind = (
            "base"
            if digest not in data
            else "delta"
            if digest in deltas
            else "plain"
            if digest in exact_refs
            else "lossy"
        )
        t = totals[kind]
        t[0], t[1], t[2] = t[0] + 1, t[1] + n, t[2] + sizes[digest]
    return {k: EncodingBytes(*v) for k, v in totals.items()}, sum(raw[d] for d in data), missing


def commit_of(m: Manifest) -> tuple[str, int, str]:
    """The commit ``m`` holds a copy of: a lossy archive copy has a manifest of its own, and
    names the commit it was made from. A step committed twice is two checkpoints, so the
    cost model counts commits, not (run, step) names."""
    return (m.run, m.step, str((m.lossy or {}).get("source_digest") or m.digest))


def _held(m: Manifest) -> Held:
    exact = (m.lossy or {}).get("source_logical_bytes", m.stats.logical_bytes)
    return Held(logical_bytes=m.stats.logical_bytes, exact_logical_bytes=int(exact), lossy=m.lossy is not None)


def store_stats(store: Store, *, count_damaged: bool = False) -> StoreStats:
    """Every run plus store-wide totals; reads each manifest once. ``count_damaged`` also
    lists the damage records (``ckptflow.chunks.damaged``): what ``ckptflow stats`` shows."""
    sizes = chunk_file_sizes(store)
    unreadable: list[str] = []
    by_run: dict[str, list[Manifest]] = {}
    kept: set[str] | None = set()  # what GC keeps for the commit records it cannot read; None: untold
    for item in catalog.committed(store):
        if isinstance(item, Manifest):
            by_run.setdefault(item.run, []).append(item)
            continue
        unreadable.append(str(item))
        named = chunks_kept_for(store, item) if kept is not None else None
        kept = None if kept is None or named is None else kept | named
    runs: list[RunStats] = []
    referenced: dict[str, int] = {}
    for run in sorted(by_run):
        stats, chunks = _run_stats(run, by_run[run], sizes)
        runs.append(stats)
        referenced.update(chunks)
    unreferenced = [d for d in sizes if d not in referenced and (kept is None or d not in kept)]
    kept_only = [d for d in sizes if d not in referenced and kept is not None and d in kept]
    every = [m for ms in by_run.values() for m in ms]
    kinds, data, missing = encodings(every, sizes)
    return StoreStats(
        runs=runs,
        checkpoints=sum(r.checkpoints for r in runs),
        logical_bytes=sum(r.logical_bytes for r in runs),
        unique_bytes=sum(referenced.values()),
        stored_bytes=sum(sizes[d] for d in referenced if d in sizes),
        chunk_files=len(sizes),
        chunk_file_bytes=sum(sizes.values()),
        unreferenced_chunks=len(unreferenced),
        unreferenced_bytes=sum(sizes[d] for d in unreferenced),
        garbage_untold=kept is None,
        unreadable_record_bytes=sum(sizes[d] for d in kept_only),
        unreadable_manifests=unreadable,
        encodings=kinds,
        data_bytes=data,
        missing_raw_bytes=missing,
        held={commit_of(m): _held(m) for m in every},
        damaged_chunks=_damaged_chunks(store, sizes.keys()) if count_damaged else None,
    )


def _damaged_chunks(store: Store, stored: KeysView[str]) -> int | None:
    records, _why = damaged.listed(store)  # the figures above stand without the count
    return None if records is None else len(records.keys() & stored)
