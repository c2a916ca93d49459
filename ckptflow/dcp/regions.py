"""Chunk regions: what an incremental save compares against to skip hashing unchanged bytes.

A region is one chunk-sized slice of a saved tensor, named by (fqn, item offset, chunk
index, dtype, length). For each region a save records what it found there (the chunk's
address, fast checksum and stored checksum: a ``ChunkWrite``), and the next save of the
same run compares the region's bytes with that fast checksum's xxh3-128: where they are
equal it reuses the address instead of computing BLAKE3 again, and an incremental save
reuses the chunk itself (``CheckpointWriter``). A restore records the same for every
region it loaded (``loaded_regions``), so the first save after a resume in a new process
costs what any later one does, and keeps the stored checksums of the chunks it reuses
(without them, a restore of that checkpoint decodes those chunks twice).
"""

from __future__ import annotations

from collections.abc import Iterable

from ckptflow.chunks.io import UNKNOWN_SIZE, ChunkWrite
from ckptflow.format.checksum import ADDRESS
from ckptflow.format.dcp_index import StorageItem
from ckptflow.format.manifest import Manifest

Region = tuple  # (fqn, item offset, chunk index, dtype, length): one chunk-sized slice of a saved tensor
Seen = dict  # Region -> the ChunkWrite (fast checksum, address, stored size) of the bytes a save found there
Tracked = tuple  # (snapshot epoch, address, edge checksum): a region read after a ``written_pages`` snapshot


def region(fqn: str, offset: tuple[int, ...] | None, index: int, dtype: str, length: int) -> Region:
    return (fqn, offset, index, dtype, length)


def loaded_regions(manifest: Manifest, items: Iterable[StorageItem]) -> Seen:
    """The regions of ``items`` (what one rank loaded from ``manifest``), each with what
    the manifest records of its chunk; a chunk without a fast checksum (a manifest older
    than them) is left out, so its region is hashed in full by the next save. None of a
    manifest whose chunks are not addressed as new saves address theirs (format 1:
    sha256): reusing those names would put them in manifests that say BLAKE3, and new
    saves of the same bytes would never dedup against them."""
    seen: Seen = {}
    if manifest.address != ADDRESS:
        return seen
    for item in items:
        if item.packed_at is not None:  # a pack's region names all its members: hashed by the next save
            continue
        for index, (digest, length) in enumerate(item.chunks):
            checksum = manifest.fast_checksums.get(digest)
            if checksum is None:
                continue
            seen[region(item.fqn, item.offset, index, item.dtype, length)] = ChunkWrite(
                digest=digest,
                raw_bytes=length,
                stored_bytes=UNKNOWN_SIZE,
                written=False,
                checksum=checksum,
                stored_checksum=manifest.stored_checksums.get(digest, ""),
            )
    return seen
