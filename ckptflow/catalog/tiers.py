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

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import listing as catalog_listing
from ckptflow.chunks.io import ChunkStore
from ckptflow.errors import (
    CkptflowError,
    ColdObjectError,
    NoValidCheckpointError,
    StoreUnavailableError,
    SymlinkError,
)
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
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


def holds_commit(store: Store, run: str, step: int) -> bool:
    """Whether ``store`` holds the commit record of ``(run, step)`` (one existence check)."""
    return store.exists(fmt.manifest_key(run, step))


def source_tier(hot: Store, run: str, step: int, archive: Callable[[], Store]) -> Store:
    """The tier one checkpoint's data is read from, in the order restore tries tiers:
    the hot store while it holds the commit record, else the archive (``archive`` opens
    it, only then) once retention expired the hot copy; the hot store when neither
    holds it, so reading it there says why."""
    if holds_commit(hot, run, step):
        return hot
    cold = archive()
    return cold if holds_commit(cold, run, step) else hot


def candidates(tiers: Sequence[Tier], run: str, step: int | None = None) -> list[tuple[int, int]]:
    """``(step, tier index)`` pairs in the order restore tries them: steps newest first,
    and within a step the hot tier first, then the others in the order given.

    With ``step`` only that step is considered, in the tiers that hold its commit
    record; if none does, ``NoValidCheckpointError`` names the steps they hold (nothing
    to skip as damaged: there is no such step). A step directory in the hot tier without
    a commit record (a save that crashed) is a candidate too, so restore reports it as
    skipped.
    """
    held: dict[int, list[int]] = {}
    for index, tier in enumerate(tiers):
        try:
            steps = _held(tier.store, run, step, hot=index == 0)
        except (CkptflowError, OSError) as e:  # not knowing what exists is no answer
            raise StoreUnavailableError(f"could not list the checkpoints of run {run!r} in {tier.url}: {e}") from e
        for held_step in steps:
            held.setdefault(held_step, []).append(index)
    if step is not None and step not in held:
        steps = sorted({s for s, _ in candidates(tiers, run)})
        raise NoValidCheckpointError(
            f"{catalog_listing.no_such_step(run, step, steps)} in {' or '.join(t.url for t in tiers)}: restore one "
            "of those (step=N), or leave step out for the newest whole one"
        )
    if step is not None:
        return [(step, i) for i in held[step]]
    return [(s, i) for s in sorted(held, reverse=True) for i in held[s]]


def _held(store: Store, run: str, step: int | None, *, hot: bool) -> list[int]:
    """The steps of ``run`` a tier offers: in the hot tier every step directory (one
    listing of names, not of every file: a crashed save is reported as skipped), in the
    others the committed steps; with ``step``, one listing of that step alone."""
    if step is not None:
        try:
            files = [info.key for info in store.list(fmt.step_prefix(run, step))]
        except SymlinkError:  # the step is a link: nothing ckptflow wrote
            return []
        return [step] if fmt.manifest_key(run, step) in files or (hot and files) else []
    if hot:
        return catalog_listing.step_dirs(store, run)
    steps = []
    for entry in catalog_listing.listing(store, run, manifests_only=True):
        if isinstance(entry, catalog_listing.Problem) and entry.step is None:
            raise StoreUnavailableError(entry.message)
        if isinstance(entry, catalog_listing.StepListing) and entry.committed:
            steps.append(entry.step)
    return steps


@dataclass(frozen=True, kw_only=True)
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
    if not store.can_thaw:
        raise CkptflowError(f"{store.url} has no cold storage classes: thaw applies to s3:// stores")
    if days < 1:
        raise CkptflowError(f"a restore must last at least 1 day, got {days}")
    keys = [info.key for info in store.list(fmt.step_prefix(run, step))]
    try:
        manifest: Manifest | None = catalog.read_manifest(store, run, step)
    except ColdObjectError:
        manifest = None
    if manifest is not None:
        keys += [fmt.chunk_key(d) for d in sorted(manifest.chunks)]
    with ThreadPoolExecutor(threads, thread_name_prefix="ckptflow-thaw") as pool:
        requested = sum(pool.map(lambda key: store.request_thaw(key, days=days, tier=tier), keys))
    return ThawReport(requested=requested, objects=len(keys), manifest_cold=manifest is None)
