"""A lossy archive copy: the checkpoint rewritten with an ``ArchiveCodec`` into another tier.

The copy is a checkpoint of its own (same run and step, chunks addressed by the
rounded values, committed by ``archive`` with the same protocol: chunks, rank records,
manifest last), whose manifest's ``lossy`` record names what was lost and the digest
of the exact checkpoint it came from. Tensors the codec keeps exact are decoded (so a
delta in the source becomes a plain chunk), and a chunk the tier already holds as a
delta is stored anew plainly: the copy lists no bases, so it never needs one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import codecs, planes
from ckptflow.chunks.codecs import decode
from ckptflow.chunks.io import ChunkStore
from ckptflow.chunks.lossy import Q8_BLOCK, ArchiveCodec, LossStats, encode_lossy, optimizer_entries, tensor_class
from ckptflow.chunks.planes import view
from ckptflow.errors import CorruptChunkError, ObjectNotFoundError
from ckptflow.format import layout as fmt
from ckptflow.format.checksum import ADDRESS, address_and_checksum, fast_checksum
from ckptflow.format.dcp_index import DcpIndex, StorageItem
from ckptflow.format.manifest import Manifest, ManifestStats
from ckptflow.store.base import Store


@dataclass(frozen=True, kw_only=True)
class LossyCopy:
    """A lossy copy whose chunks are in the tier, ready to commit."""

    manifest: Manifest  # parsed from ``blob``
    blob: bytes  # the sealed manifest, committed last
    records: list[tuple[str, bytes]]  # (key, sealed rank record)
    sizes: dict[str, int]  # the stored size of each chunk by key (what a cold copy is checked against)
    reencoded: int  # chunks the tier held as deltas, stored anew plainly


def in_pack_order(listed: Iterable[StorageItem]) -> list[tuple[int, StorageItem]]:
    """``items`` with their places, each pack's members together (at its first member's
    place): a manifest lists items by name, a save packs them in plan order, and each
    pack is read and verified once for all its members."""
    items = list(listed)
    first: dict[str, int] = {}
    for place, item in enumerate(items):
        if item.packed_at is not None:
            first.setdefault(item.chunks[0][0], place)
    group = [first[i.chunks[0][0]] if i.packed_at is not None else place for place, i in enumerate(items)]
    return sorted(enumerate(items), key=lambda placed: group[placed[0]])


def write_lossy_copy(
    src: Store, dst: Store, manifest: Manifest, codec: ArchiveCodec, progress: Callable[[int], None] | None = None
) -> LossyCopy:
    """Write the chunks of ``manifest``'s checkpoint into ``dst`` with ``codec`` and make
    (not commit) the copy's manifest and rank records. Raises any read error of the
    source (every source chunk is verified)."""
    records = [catalog.read_rank_record(src, manifest, r) for r in range(manifest.world_size)]
    optimizers = optimizer_entries(records[0].state)
    dropped = sorted(optimizers) if codec.optimizer == "drop" else []
    source, target = ChunkStore(src).scoped(manifest.chunks, address=manifest.address), ChunkStore(dst)
    stats, counts = LossStats(), {"exact": 0, "bf16": 0, "int8": 0}
    copied: dict[int, StorageItem] = {}  # by the item's place in the manifest, where the copy keeps it
    sizes: dict[str, int] = {}
    stored: dict[str, int] = {}
    checksums: dict[str, str] = {}
    reencoded = 0
    pack: tuple[str, memoryview] = ("", memoryview(b""))  # the pack last decoded: its members come one after another
    for place, item in in_pack_order(manifest.items()):
        if item.fqn.split(".", 1)[0] in dropped:
            continue
        what = tensor_class(item.fqn, item.dtype, math.prod(item.shape), optimizers)
        how = {"weights": codec.weights, "optimizer": codec.optimizer}.get(what, "exact")
        counts[how] += 1
        chunks = []
        for digest, size in item.chunks:
            if item.packed_at is None:
                raw = source.get(digest, size)
            else:  # the copy stores each member of a pack as a chunk of its own
                if pack[0] != digest:
                    pack = (digest, source.get(digest, manifest.chunks[digest]))
                raw = pack[1][item.packed_at : item.packed_at + size]
                digest = address_and_checksum(raw)[0] if how == "exact" else digest
            if how == "exact":
                checksum = fast_checksum(raw)
                itemsize, floating = fmt.DTYPE_SIZES[item.dtype], item.dtype in fmt.FLOATING_DTYPES
                parts: Callable[[], list] = partial(codecs.encode, raw, "zstd", itemsize, floating=floating)
                written, again = _store(target, digest, raw, parts)
            else:
                values, encoded = encode_lossy(raw, how, stats, what, name=item.fqn)
                if (
                    dst.writes_cold
                    and bytes(decode(b"".join(bytes(p) for p in encoded), expected=values.nbytes)) != values.tobytes()
                ):
                    raise CorruptChunkError(f"the {how} encoding of a chunk of {item.fqn!r} does not round-trip")
                digest, checksum = address_and_checksum(view(values))
                written, again = _store(target, digest, view(values), partial(list, encoded))
            reencoded += again
            chunks.append((digest, size))
            sizes[digest], stored[digest], checksums[digest] = size, written, checksum
            if progress:
                progress(size)
        copied[place] = dataclasses.replace(item, chunks=tuple(chunks), packed_at=None)
    items = [copied[place] for place in sorted(copied)]
    lossy = {
        "codec": codec.name,
        "weights": codec.weights,
        "optimizer": codec.optimizer,
        "block": Q8_BLOCK,
        "dropped": dropped,
        "tensors": counts,
        "error": stats.as_dict(),
        **({"kept_exact": stats.kept_exact} if stats.kept_exact else {}),
        "source_digest": manifest.digest,
        "source_logical_bytes": manifest.stats.logical_bytes,
    }
    copy = dataclasses.replace(_copy_manifest(manifest, items, dropped, sizes, stored, lossy), fast_checksums=checksums)
    blob = copy.seal()
    parsed = Manifest.parse(blob, f"manifest {dst.url}/{fmt.manifest_key(manifest.run, manifest.step)} (before commit)")
    kept = [
        (parsed.rank_key(r.rank), dataclasses.replace(r, state={k: v for k, v in r.state.items() if k not in dropped}))
        for r in records
    ]
    held = {fmt.chunk_key(d): n for d, n in stored.items()}
    return LossyCopy(
        manifest=parsed,
        blob=blob,
        records=[(key, record.seal()) for key, record in kept],
        sizes=held,
        reencoded=reencoded,
    )


def _store(target: ChunkStore, digest: str, raw: memoryview, encode: Callable[[], list]) -> tuple[int, bool]:
    """Put a chunk of the copy in the tier: (its stored size, whether a copy the tier held
    was stored anew). One already there is kept if the copy can use it as it is: not a
    delta (the copy lists no bases), or, in a cold tier that cannot be read back, as
    large as this encoding; otherwise it is replaced, verified first
    (``ChunkStore.replace_verified``)."""
    store, key = target.store, fmt.chunk_key(digest)
    try:
        held = store.stat(key).size
    except ObjectNotFoundError:
        parts = encode()
        if store.put_if_absent(key, parts):
            return planes.size(parts), False
        held = store.stat(key).size
    if store.writes_cold:
        parts = encode()
        if planes.size(parts) == held:
            return held, False
    elif codecs.delta_base(store.read_head(key, codecs.HEAD_BYTES)) is None:
        store.touch(key)  # restart GC's grace period: this copy now uses it
        return held, False
    else:
        parts = encode()
    return target.replace_verified(digest, len(raw), parts), True


def _copy_manifest(
    manifest: Manifest,
    items: list[StorageItem],
    dropped: list[str],
    sizes: dict[str, int],
    stored: dict[str, int],
    lossy: dict,
) -> Manifest:
    def kept(fqn: str) -> bool:
        return fqn.split(".", 1)[0] not in dropped

    planner = manifest.dcp.planner_data
    if isinstance(planner, dict):
        planner = {k: v for k, v in planner.items() if kept(k)}
    tensors = {fqn: t for fqn, t in manifest.dcp.tensors.items() if kept(fqn)}
    logical = sum(i.nbytes for i in items)
    return dataclasses.replace(
        manifest,
        dcp=DcpIndex(version=manifest.dcp.version, tensors=tensors, items=tuple(items), planner_data=planner),
        chunks=dict(sorted(sizes.items())),
        bases={},
        stored_checksums={},  # its chunks are other objects than the source's: restore verifies them by decoding
        lossy=lossy,
        address=ADDRESS,  # its chunks are new, written with the current address
        kind="full",
        base_step=None,
        codec=f"lossy:{lossy['codec']}",
        stats=ManifestStats(
            logical_bytes=logical,
            unique_bytes=sum(sizes.values()),
            stored_bytes=sum(stored.values()),
            chunks=len(sizes),
            chunks_written=len(sizes),
            bytes_written=sum(sizes.values()),
            stored_written=sum(stored.values()),
        ),
        digest="",
    )
