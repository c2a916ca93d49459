"""Read-side view of a store: runs, steps, manifests, listings and verification.

Shared by the Checkpointer, the CLI, GC and the Dagster layer, so "what exists and is
it intact" has one answer everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptflow import format as fmt
from ckptflow.chunks import ChunkStore
from ckptflow.dcp_meta import dtype_from_name
from ckptflow.errors import CkptflowError, ManifestError, ObjectNotFoundError
from ckptflow.store.base import Store


@dataclass(frozen=True)
class CheckpointInfo:
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

    @classmethod
    def from_manifest(cls, manifest: dict, digest: str = "") -> "CheckpointInfo":
        stats = manifest["stats"]
        return cls(
            step=manifest["step"],
            kind=manifest["kind"],
            created_at=manifest["created_at"],
            logical_bytes=stats["logical_bytes"],
            stored_bytes=stats["stored_bytes"],
            metadata=manifest.get("metadata") or {},
            run=manifest["run"],
            world_size=manifest["world_size"],
            chunks=stats["chunks"],
            bytes_written=stats["bytes_written"],
            base_step=manifest.get("base_step"),
            digest=digest,
        )


@dataclass
class VerifyReport:
    step: int
    ok: bool
    problems: list[str] = field(default_factory=list)
    chunks_checked: int = 0
    bytes_checked: int = 0


def list_runs(store: Store) -> list[str]:
    return [info.key.rstrip("/").rsplit("/", 1)[-1] for info in store.list(fmt.runs_prefix(), recursive=False) if info.key.endswith("/")]


def list_steps(store: Store, run: str) -> list[int]:
    """Every step directory of ``run`` (committed or not), ascending."""
    steps = []
    for info in store.list(fmt.checkpoints_prefix(run), recursive=False):
        step = fmt.parse_step_dir(info.key) if info.key.endswith("/") else None
        if step is not None:
            steps.append(step)
    return sorted(steps)


def read_manifest(store: Store, run: str, step: int) -> tuple[dict, str]:
    """The verified manifest and its file digest; ``ManifestError`` says why not."""
    key = fmt.manifest_key(run, step)
    try:
        blob = store.get(key)
    except ObjectNotFoundError:
        raise ManifestError(f"no manifest at {store.url}/{key}: the checkpoint was never committed (or was deleted)") from None
    manifest = fmt.unseal(blob, f"manifest {store.url}/{key}")
    _check_shape(manifest, f"manifest {store.url}/{key}")
    if manifest["run"] != run or manifest["step"] != step:
        raise ManifestError(
            f"manifest {store.url}/{key} describes run {manifest['run']!r} step {manifest['step']}, "
            f"not run {run!r} step {step}: it was copied to the wrong place"
        )
    return manifest, fmt.digest_of(blob)


_FIELDS: dict[str, Any] = {
    "run": str, "step": int, "kind": str, "stats": dict, "dcp": dict, "chunks": dict,
    "world_size": int, "created_at": (int, float),
}
_STATS = ("logical_bytes", "stored_bytes", "chunks", "bytes_written")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_shape(manifest: dict, where: str) -> None:
    """A sealed manifest can still be malformed (a buggy or foreign writer): check the
    structure everything downstream indexes into, so readers get a ``ManifestError``
    (skip / report) instead of a KeyError or TypeError deep inside restore, verify or list."""

    def bad(what: str) -> ManifestError:
        return ManifestError(f"{where} {what}; it is malformed")

    def check_dtype(name: str) -> None:
        try:
            dtype_from_name(name)
        except ManifestError as e:
            raise ManifestError(f"{where}: {e}") from None

    for name, types in _FIELDS.items():
        if name not in manifest:
            raise bad(f"lacks field {name!r}")
        value = manifest[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise bad(f"has field {name!r} of type {type(value).__name__}")
    if manifest["world_size"] < 1:
        raise bad(f"has world_size {manifest['world_size']}")
    if not all(_is_int(manifest["stats"].get(k)) for k in _STATS):
        raise bad(f"has stats without all of {list(_STATS)}")
    chunks = manifest["chunks"]
    if not all(_is_int(size) and size >= 0 for size in chunks.values()):
        raise bad("has a chunk size that is not a non-negative integer")
    dcp = manifest["dcp"]
    if not isinstance(dcp.get("tensors"), dict) or not isinstance(dcp.get("items"), list):
        raise bad("has a DCP index without 'tensors' and 'items'")
    for fqn, tensor in dcp["tensors"].items():
        if not isinstance(tensor, dict) or not isinstance(tensor.get("dtype"), str) or not isinstance(tensor.get("chunks"), list):
            raise bad(f"has a DCP index entry {fqn!r} without dtype and chunks")
        check_dtype(tensor["dtype"])
    for item in dcp["items"]:
        if not isinstance(item, dict) or not isinstance(item.get("chunks"), list) or not isinstance(item.get("dtype"), str):
            raise bad("has a DCP storage item without chunks or dtype")
        check_dtype(item["dtype"])
        for ref in item["chunks"]:
            if not (isinstance(ref, list) and len(ref) == 2 and isinstance(ref[0], str) and ref[0] in chunks and chunks[ref[0]] == ref[1]):
                raise bad(f"has item {item.get('fqn')!r} referencing a chunk missing from its chunk list")


def read_rank_record(store: Store, manifest: dict, rank: int) -> dict:
    """The rank record ``manifest`` committed for ``rank``, verified to belong to it."""
    key = fmt.rank_key(manifest["run"], manifest["step"], rank)
    try:
        blob = store.get(key)
    except ObjectNotFoundError:
        raise ManifestError(f"rank record {store.url}/{key} is missing") from None
    record = fmt.unseal(blob, f"rank record {store.url}/{key}")
    if record.get("save_id") != manifest.get("save_id") or record.get("rank") != rank:
        raise ManifestError(
            f"rank record {store.url}/{key} belongs to another save attempt of this step "
            f"(save {record.get('save_id')!r}, manifest names {manifest.get('save_id')!r}): "
            "two writers saved the same step at once, so this checkpoint cannot be trusted"
        )
    return record


def rank_record_keys(manifest: dict) -> list[str]:
    return [fmt.rank_key(manifest["run"], manifest["step"], r) for r in range(manifest["world_size"])]


def list_checkpoints(store: Store, run: str) -> list[CheckpointInfo]:
    """Committed checkpoints whose manifest is intact, ascending by step."""
    infos = []
    for step in list_steps(store, run):
        try:
            manifest, digest = read_manifest(store, run, step)
        except ManifestError:
            continue
        infos.append(CheckpointInfo.from_manifest(manifest, digest))
    return infos


def verify_checkpoint(
    store: Store,
    run: str,
    step: int,
    pool: ThreadPoolExecutor | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Re-read everything a checkpoint needs: manifest, rank records, every chunk."""
    report = VerifyReport(step=step, ok=True)
    try:
        manifest, _ = read_manifest(store, run, step)
    except ManifestError as e:
        return VerifyReport(step=step, ok=False, problems=[str(e)])
    for rank in range(manifest["world_size"]):
        try:
            read_rank_record(store, manifest, rank)
        except ManifestError as e:
            report.problems.append(str(e))
    chunks = ChunkStore(store)

    def check(item: tuple[str, int]) -> str | None:
        digest, size = item
        try:
            chunks.get(digest, expected_size=size)
        except CkptflowError as e:
            return str(e)
        finally:
            if progress:
                progress(size)
        return None

    items = list(manifest["chunks"].items())
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


def referenced_chunks(manifest: dict[str, Any]) -> set[str]:
    return set(manifest["chunks"])
