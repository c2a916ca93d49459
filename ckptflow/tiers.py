"""Storage tiers for restore: the hot store first, then read-only tiers (an archive).

A checkpoint is named by ``(run, step)`` wherever it lives; archival copies it with the
same layout and commit protocol, so each tier is just another store whose manifests
are complete on their own. Restore walks steps newest first and, for a step held by
several tiers, tries the hot copy first and the next tier's copy if that one fails to
verify. Saves only ever go to the hot tier.

GC is per tier by construction: ``gc(store)`` marks from the manifests *in that store*
and sweeps chunks *in that store*, so collecting the hot tier never touches an
archive's objects and an archive's chunks are protected by the archive's manifests.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptflow import catalog
from ckptflow import format as fmt
from ckptflow.chunks import ChunkStore
from ckptflow.errors import CkptflowError, ColdObjectError
from ckptflow.store import Store, open_store


@dataclass(frozen=True)
class Tier:
    store: Store
    chunks: ChunkStore

    @property
    def url(self) -> str:
        return self.store.url


def open_tiers(hot: Store, extra: Sequence[str | Store] = ()) -> list[Tier]:
    """The hot tier followed by each extra tier (URLs or stores), duplicates dropped."""
    stores = [hot]
    for item in extra:
        store = open_store(item)
        if all(store.url != s.url for s in stores):
            stores.append(store)
    return [Tier(s, ChunkStore(s)) for s in stores]


def candidates(tiers: Sequence[Tier], run: str, step: int | None = None) -> list[tuple[int, int]]:
    """``(step, tier index)`` pairs in the order restore tries them: steps newest first,
    and within a step the hot tier first, then the others in the order given.

    With ``step`` only that step is considered, in the tiers that hold its commit
    record; if none does, the hot tier is still named so the caller reports why.
    """
    if step is not None:
        holding = [i for i, t in enumerate(tiers) if len(tiers) == 1 or t.store.exists(fmt.manifest_key(run, step))]
        return [(step, i) for i in holding or [0]]
    held: dict[int, list[int]] = {}
    for index, tier in enumerate(tiers):
        for found in catalog.list_steps(tier.store, run):
            held.setdefault(found, []).append(index)
    return [(s, i) for s in sorted(held, reverse=True) for i in held[s]]


COLD_CLASSES = ("GLACIER", "DEEP_ARCHIVE")  # S3 classes whose objects need a restore before a read


def is_cold(store: Store) -> bool:
    """A store whose new objects land in a storage class that cannot be read until thawed."""
    return getattr(store, "storage_class", None) in COLD_CLASSES


def metadata_store(store: Store) -> Store:
    """Where archival writes manifests and rank records: the store itself, or for a cold
    S3 store a view of the same bucket and prefix in the default storage class (so they
    stay listable and readable; only chunks, the bulk of the bytes, go cold)."""
    if not is_cold(store):
        return store
    from ckptflow.store.s3 import S3Store  # only S3 stores have storage classes

    return S3Store(store.bucket, store.prefix, client=store.client)


@dataclass(frozen=True)
class ThawReport:
    requested: int  # restore requests issued (objects that were cold and not yet restoring)
    objects: int  # objects of the checkpoint looked at
    manifest_cold: bool  # chunks unknown until the manifest itself is restored


def thaw(store: Store, run: str, step: int, *, days: int = 1, tier: str = "Standard", threads: int = 16) -> ThawReport:
    """Request restores for a checkpoint in a cold storage class (Glacier, Deep Archive).

    The step's own objects (manifest, rank records) can be listed while cold; its chunks
    are known only from the manifest, so while the manifest is cold, thaw it first and
    run again once that restore has finished.
    """
    restore = getattr(store, "restore_request", None)
    if restore is None:
        raise CkptflowError(f"{store.url} has no cold storage classes: thaw applies to s3:// stores")
    if days < 1:
        raise CkptflowError(f"a restore must last at least 1 day, got {days}")
    keys = [info.key for info in store.list(fmt.step_prefix(run, step))]
    try:
        manifest, _ = catalog.read_manifest(store, run, step)
    except ColdObjectError:
        manifest = None
    if manifest is not None:
        keys += [fmt.chunk_key(d) for d in sorted(catalog.referenced_chunks(manifest))]
    with ThreadPoolExecutor(threads, thread_name_prefix="ckptflow-thaw") as pool:
        requested = sum(pool.map(lambda key: restore(key, days=days, tier=tier), keys))
    return ThawReport(requested, len(keys), manifest is None)
