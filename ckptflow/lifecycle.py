"""Lifecycle records and operations on checkpoints after they are committed.

Verdicts about a checkpoint (validation, evaluation, compression, archival, failures)
live in the store next to the data, under ``lifecycle/<run>/<step:012d>/<what>.json``,
not only in an orchestrator's database: the inventory, retention, the CLI and a fresh
Dagster instance all read the same answers, and deleting the Dagster home loses
nothing. Manifests stay immutable; these small records are replaced atomically.

GC never sweeps ``lifecycle/`` (it only marks and sweeps chunks and step files), and
expiring a checkpoint deletes its records.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptflow import catalog, tiers
from ckptflow import format as fmt
from ckptflow.chunks import ChunkStore
from ckptflow.dcp_meta import dtype_from_name
from ckptflow.errors import CkptflowError, ManifestError, ObjectNotFoundError
from ckptflow.store.base import Store

PREFIX = "lifecycle/"
KINDS = ("validation", "evaluation", "compression", "archive", "failure")


def record_key(run: str, step: int, what: str) -> str:
    if what not in KINDS:
        raise ValueError(f"lifecycle record {what!r} is not one of {KINDS}")
    return f"{PREFIX}{fmt.validate_run(run)}/{fmt.validate_step(step):0{fmt.STEP_DIGITS}d}/{what}.json"


def write_record(store: Store, run: str, step: int, what: str, data: dict) -> dict:
    """Replace the ``what`` record of a checkpoint (stamped with ``recorded_at``)."""
    body = {**data, "recorded_at": data.get("recorded_at", time.time())}
    store.replace(record_key(run, step, what), json.dumps(body, sort_keys=True, allow_nan=True).encode())
    return body


def read_record(store: Store, run: str, step: int, what: str) -> dict | None:
    try:
        return json.loads(store.get(record_key(run, step, what)))
    except (ObjectNotFoundError, ValueError):
        return None


def all_records(store: Store) -> dict[tuple[str, int], dict[str, dict]]:
    """Every record in the store by ``(run, step)`` then kind: one listing plus small reads."""
    out: dict[tuple[str, int], dict[str, dict]] = defaultdict(dict)
    for info in store.list(PREFIX):
        parts = info.key[len(PREFIX):].split("/")
        if len(parts) != 3 or not parts[2].endswith(".json"):
            continue
        step = fmt.parse_step_dir(parts[1])
        if step is None:
            continue
        try:
            out[(parts[0], step)][parts[2][:-5]] = json.loads(store.get(info.key))
        except (ObjectNotFoundError, ValueError):
            continue
    return dict(out)


def validate(store: Store, run: str, step: int, *, records: Store | None = None) -> dict:
    """Verify a checkpoint completely and record the verdict (in ``records``, the hot
    store, when ``store`` is the archive tier holding the checkpoint)."""
    report = catalog.verify_checkpoint(store, run, step)
    return write_record(records or store, run, step, "validation", {
        "ok": report.ok, "problems": report.problems[:20], "chunks_checked": report.chunks_checked,
        "bytes_checked": report.bytes_checked, "tier": store.url,
    })


def _itemsizes(manifest: dict) -> dict[str, int]:
    """Element size of the tensor each chunk belongs to (for byte-grouped zstd)."""
    sizes: dict[str, int] = {}
    for item in manifest["dcp"]["items"]:
        try:
            itemsize = dtype_from_name(item["dtype"]).itemsize
        except (ManifestError, AttributeError):
            itemsize = 1
        for digest, _ in item["chunks"]:
            sizes.setdefault(digest, itemsize)
    return sizes


@dataclass
class CompressionReport:
    chunks: int = 0
    reencoded: int = 0  # chunks this call rewrote (others were already compressed)
    bytes_before: int = 0
    bytes_after: int = 0

    @property
    def ratio(self) -> float | None:
        return self.bytes_before / self.bytes_after if self.bytes_after else None


def compress(store: Store, run: str, step: int, codec: str = "zstd", level: int = 3) -> CompressionReport:
    """Re-encode every chunk of a checkpoint with ``codec``. Addresses do not change
    (they hash the raw bytes), so other checkpoints sharing a chunk are unaffected; a
    chunk that grows under the codec is left raw."""
    manifest, _ = catalog.read_manifest(store, run, step)
    chunks = ChunkStore(store)
    report = CompressionReport()
    itemsizes = _itemsizes(manifest)
    for digest in sorted(manifest["chunks"]):
        before, after = chunks.reencode(digest, codec, itemsizes.get(digest, 1), level, only_if_smaller=True)
        report.chunks += 1
        report.bytes_before += before
        report.bytes_after += after
        report.reencoded += after < before
    return report


@dataclass
class ArchiveReport:
    chunks_copied: int = 0
    chunks_present: int = 0
    bytes_copied: int = 0
    problems: list[str] = field(default_factory=list)
    chunks_verified: int = 0
    verified_by: str = "re-read"  # or "size" for a cold storage class (objects unreadable until thawed)

    @property
    def ok(self) -> bool:
        return not self.problems


def archive(src: Store, dst: Store, run: str, step: int, progress: Callable[[int], None] | None = None) -> ArchiveReport:
    """Copy a checkpoint to another store with the same commit protocol (chunks, then
    rank records, then the manifest last, all create-only), then verify it there: every
    chunk re-read from ``dst`` and checked against its address, manifest and rank
    records against their checksums.

    A ``dst`` in a cold storage class (S3 GLACIER / DEEP_ARCHIVE) cannot be read back
    until thawed: its chunks are verified here before upload (the upload carries their
    SHA-256, which S3 checks) and by size afterwards, and the small records and the
    manifest go in the default class, so listing, inventory and restore planning work
    without a thaw (``tiers.metadata_store``)."""
    manifest, _ = catalog.read_manifest(src, run, step)
    report = ArchiveReport()
    cold = tiers.is_cold(dst)
    meta = tiers.metadata_store(dst)
    source = ChunkStore(src)
    sizes: dict[str, int] = {}
    for digest in sorted(manifest["chunks"]):
        key = fmt.chunk_key(digest)
        if dst.exists(key):
            report.chunks_present += 1
            if cold:
                sizes[key] = src.stat(key).size
            continue
        blob = src.get(key)
        if cold:
            try:
                source.get(digest)  # cannot re-read after upload: never archive a corrupt chunk
            except CkptflowError as e:
                report.problems.append(str(e))
                continue
            sizes[key] = len(blob)
        dst.put_if_absent(key, blob)
        report.chunks_copied += 1
        report.bytes_copied += len(blob)
        if progress:
            progress(len(blob))
    if report.problems:
        return report
    for key in catalog.rank_record_keys(manifest) + [fmt.manifest_key(run, step)]:
        blob = src.get(key)
        if not meta.put_if_absent(key, blob) and meta.get(key) != blob:
            report.problems.append(f"{dst.url}/{key} already holds a different record; not overwritten")
    if report.problems:
        return report
    if not cold:
        check = catalog.verify_checkpoint(dst, run, step)
        report.problems.extend(check.problems)
        report.chunks_verified = check.chunks_checked
        return report
    report.verified_by = "size"
    try:
        stored, _ = catalog.read_manifest(meta, run, step)
        for rank in range(stored["world_size"]):
            catalog.read_rank_record(meta, stored, rank)
    except CkptflowError as e:
        report.problems.append(str(e))
    for key, size in sizes.items():
        try:
            got = dst.stat(key).size
        except CkptflowError as e:
            report.problems.append(str(e))
            continue
        if got != size:
            report.problems.append(f"{dst.url}/{key} holds {got} bytes, the hot copy {size}")
        else:
            report.chunks_verified += 1
    return report


def expire(store: Store, run: str, step: int, *, keep_records: bool = False) -> list[str]:
    """Delete a checkpoint's commit record (it stops existing at once), then its rank
    records and lifecycle records. Chunks are left to GC, which knows what else uses them.

    ``keep_records`` keeps the lifecycle records: for a hot copy expired while the
    archive tier keeps the checkpoint, its verdicts and metrics still describe it."""
    manifest_key = fmt.manifest_key(run, step)
    try:
        manifest, _ = catalog.read_manifest(store, run, step)
        keys = [manifest_key] + catalog.rank_record_keys(manifest)
    except ManifestError:
        keys = [manifest_key] + [i.key for i in store.list(fmt.step_prefix(run, step)) if i.key != manifest_key]
    if not keep_records:
        keys += [i.key for i in store.list(f"{PREFIX}{run}/{step:0{fmt.STEP_DIGITS}d}/")]
    for key in keys:
        try:
            store.delete(key)
        except CkptflowError:
            continue
    return keys
