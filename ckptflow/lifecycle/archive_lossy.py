"""A lossy archive copy: the checkpoint rewritten with an ``ArchiveCodec`` into another tier.

The copy is a checkpoint of its own (same run and step, chunks addressed by the
rounded values, committed with the same protocol: chunks, rank records, manifest
last), whose manifest's ``lossy`` record names what was lost and the digest of the
exact checkpoint it came from. Tensors the codec keeps exact are decoded (so a delta
in the source becomes a plain chunk: a copy never needs a base it does not hold).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from ckptflow import catalog
from ckptflow import format as fmt
from ckptflow.checksum import ADDRESS
from ckptflow.chunks import ChunkStore, Encoded, Encoder
from ckptflow.codecs import decode
from ckptflow.dcp_index import DcpIndex, StorageItem
from ckptflow.errors import CheckpointExistsError, CorruptChunkError
from ckptflow.lossy import Q8_BLOCK, ArchiveCodec, LossStats, encode_lossy, optimizer_entries, tensor_class
from ckptflow.manifest import Manifest, ManifestStats
from ckptflow.planes import view
from ckptflow.store.base import Store


def write_lossy_copy(
    src: Store, dst: Store, manifest: Manifest, codec: ArchiveCodec, progress: Callable[[int], None] | None = None
) -> tuple[Manifest, dict[str, int]]:
    """Write ``manifest``'s checkpoint into ``dst`` with ``codec`` and commit it there:
    (the copy's manifest, the stored size of each of its chunks by key).

    Raises ``CheckpointExistsError`` if ``dst`` already holds a different commit of
    that step (nothing of it is touched), and any read error of the source (every
    source chunk is verified).
    """
    records = [catalog.read_rank_record(src, manifest, r) for r in range(manifest.world_size)]
    optimizers = optimizer_entries(records[0].state)
    dropped = sorted(optimizers) if codec.optimizer == "drop" else []
    source, target = ChunkStore(src).scoped(manifest.chunks, address=manifest.address), ChunkStore(dst)
    stats, counts = LossStats(), {"exact": 0, "bf16": 0, "int8": 0}
    items: list[StorageItem] = []
    sizes: dict[str, int] = {}
    stored: dict[str, int] = {}
    checksums: dict[str, str] = {}
    for item in manifest.items():
        if item.fqn.split(".", 1)[0] in dropped:
            continue
        what = tensor_class(item.fqn, item.dtype, math.prod(item.shape), optimizers)
        how = {"weights": codec.weights, "optimizer": codec.optimizer}.get(what, "exact")
        counts[how] += 1
        chunks = []
        for digest, size in item.chunks:
            raw = source.get(digest, size)
            if how == "exact":
                itemsize = fmt.DTYPE_SIZES[item.dtype]
                write = target.put(
                    raw, digest=digest, codec="zstd", itemsize=itemsize, floating=item.dtype in fmt.FLOATING_DTYPES
                )
            else:
                values, parts = encode_lossy(raw, how, stats, what)
                encoded = b"".join(map(bytes, parts)) if dst.writes_cold else None  # checked before it goes cold
                if encoded is not None and bytes(decode(encoded, expected=values.nbytes)) != values.tobytes():
                    raise CorruptChunkError(f"the {how} encoding of a chunk of {item.fqn!r} does not round-trip")
                write = target.put(view(values), encoder=_fixed(parts))
            chunks.append((write.digest, size))
            sizes[write.digest], stored[write.digest] = size, write.stored_bytes
            checksums[write.digest] = write.checksum
            if progress:
                progress(size)
        items.append(dataclasses.replace(item, chunks=tuple(chunks)))
    lossy = {
        "codec": codec.name,
        "weights": codec.weights,
        "optimizer": codec.optimizer,
        "block": Q8_BLOCK,
        "dropped": dropped,
        "tensors": counts,
        "error": stats.as_dict(),
        "source_digest": manifest.digest,
        "source_logical_bytes": manifest.stats.logical_bytes,
    }
    copy = dataclasses.replace(_copy_manifest(manifest, items, dropped, sizes, stored, lossy), fast_checksums=checksums)
    blob = copy.seal()
    key = fmt.manifest_key(manifest.run, manifest.step)
    parsed = Manifest.parse(blob, f"manifest {dst.url}/{key} (before commit)")
    meta = dst.metadata_store()
    held = {fmt.chunk_key(d): n for d, n in stored.items()}
    if meta.exists(key):
        if meta.get(key) == blob:
            return parsed, held  # this very copy was committed before
        raise CheckpointExistsError(f"{dst.url}/{key} already holds another commit of this step; not overwritten")
    for record in records:
        state = {k: v for k, v in record.state.items() if k not in dropped} if dropped else record.state
        meta.replace(parsed.rank_key(record.rank), dataclasses.replace(record, state=state).seal())
    if not meta.put_if_absent(key, blob) and meta.get(key) != blob:
        raise CheckpointExistsError(f"{dst.url}/{key} was committed by another writer meanwhile; not overwritten")
    return parsed, held


def _fixed(parts: list) -> Encoder:
    """An encoder that stores ``parts``: the chunk was encoded while it was rounded."""
    return lambda _raw, _digest: Encoded(parts)


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
        dcp=DcpIndex(manifest.dcp.version, tensors, tuple(items), planner),
        chunks=dict(sorted(sizes.items())),
        bases={},
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
