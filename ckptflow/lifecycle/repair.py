"""Repair a tier's damaged chunk objects from another tier's sound copies.

A reader that refuses a chunk object records it in that object's store
(``ckptflow.chunks.damaged``), and the next save that holds the content writes it anew.
Nothing else repairs it. A job that has finished saves nothing. An archive tier is never
saved into, so damage found there (by a restore that fell back to it, an export, a scrub,
``verify``) stayed until the archived checkpoint expired, as the only copy left once the hot
one was retired.

Yet the same content often sits sound in another tier, under the same address: the hot copy
of an archived checkpoint, or the archive copy of a hot one. ``repair`` looks up each chunk
object ``store`` records as damaged in ``sources``, in order. It reads a copy the way a
restore does (bounded by the raw size a checkpoint of ``store`` lists, then verified against
its address), and puts it in place of the damaged object with ``ChunkStore.replace_verified``:
- it is checked again before the atomic swap;
- it is stored plainly if the source holds it as a delta, since ``store`` may lack the base;
- the damage record goes.
Every checkpoint sharing the chunk is whole again.

What ``repair`` does not do:
- It never writes to ``sources``. A source object found damaged on the way is recorded in
  that source, as any read records it.
- It leaves alone records of chunks no checkpoint of ``store`` lists. GC deletes them.
  While a checkpoint of ``store`` could not be read for a reason that passes (an outage,
  a newer ckptflow wrote it; not one proved damaged, nor a symlink ckptflow never writes),
  a record no readable one lists is ``unresolved`` instead: that checkpoint may list it,
  and its raw size (what bounds the read of a copy) is not known here.
- A tier it could not read proves nothing: the chunk is reported ``unavailable``, for a
  retry. A copy that is missing or damaged everywhere is ``unrepaired``, with each tier's
  reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import codecs, damaged
from ckptflow.chunks.io import ChunkStore, plain_encoding
from ckptflow.errors import StoreUnavailableError, is_damage
from ckptflow.format.manifest import Manifest
from ckptflow.store.base import Store


@dataclass
class RepairReport:
    repaired: list[tuple[str, str]] = field(default_factory=list)  # (digest, the tier's URL it came from)
    bytes_repaired: int = 0  # the content of the chunks repaired: what ``progress`` counts
    unrepaired: list[tuple[str, str]] = field(default_factory=list)  # (digest, why: no tier holds a sound copy)
    unavailable: list[tuple[str, str]] = field(default_factory=list)  # (digest, why): a tier could not be read
    unreferenced: int = 0  # records of chunks no checkpoint of the store lists (GC's to delete)
    unlisted: list[str] = field(default_factory=list)  # checkpoints of the store that could not be read
    # records no checkpoint read lists, while one that might be fine was not read (it may list them)
    unresolved: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing is left damaged that a tier could not supply, and nothing was left unknown."""
        return not self.unrepaired and not self.unavailable and not self.unresolved


def repair(store: Store, sources: Sequence[Store], *, progress: Callable[[int], None] | None = None) -> RepairReport:
    """Replace each chunk object ``store`` records as damaged with a sound copy from the
    first of ``sources`` holding one (see the module docstring). ``progress`` is called
    with the content size of each chunk once it is repaired (``bytes_repaired`` in all)."""
    report = RepairReport()
    records = damaged.records(store)
    if not records:
        return report
    damaged.remember(store, records)  # records other processes wrote: each chunk repaired deletes its own
    sizes: dict[str, int] = {}  # raw size per chunk, as the store's own checkpoints list it
    unread = False  # a checkpoint that might be fine could not be read: what it lists is unknown
    for item in catalog.committed(store.metadata_store()):
        if isinstance(item, Manifest):
            sizes.update((d, n) for d, n in item.chunks.items() if d in records)
        else:
            report.unlisted.append(str(item))
            unread = unread or item.may_read_later
    target = ChunkStore(store)
    readers = [ChunkStore(source) for source in sources]
    for digest in sorted(records):
        size = sizes.get(digest)
        if size is None and unread:
            report.unresolved.append(digest)
        elif size is None:
            report.unreferenced += 1
        else:
            _repair_one(target, readers, digest, size, report, progress)
    return report


def _repair_one(
    target: ChunkStore,
    readers: list[ChunkStore],
    digest: str,
    size: int,
    report: RepairReport,
    progress: Callable[[int], None] | None,
) -> None:
    reasons: list[str] = []
    unreadable = False
    for reader in readers:
        try:
            blob, raw = reader.read_stored(digest, size)
        except Exception as e:  # damage (recorded in that tier by the read) or a failure to read
            unreadable = unreadable or not is_damage(e)
            reasons.append(f"{reader.store.url}: {e}")
            continue
        head = memoryview(blob)[: codecs.HEAD_BYTES]
        parts = [blob] if codecs.delta_base(head) is None else plain_encoding(raw)
        try:
            target.replace_verified(digest, size, parts)
        except (StoreUnavailableError, OSError) as e:
            report.unavailable.append((digest, f"{target.store.url} could not take the copy: {e}"))
            return
        report.repaired.append((digest, reader.store.url))
        report.bytes_repaired += size
        if progress:
            progress(size)
        return
    why = "; ".join(reasons) or "no other tier was given"
    (report.unavailable if unreadable else report.unrepaired).append((digest, why))
