"""Compaction: re-encode a checkpoint's chunks with a compressing codec, in place.

Addresses hash the raw bytes, so re-encoding changes no reference: other checkpoints
sharing a chunk are unaffected, and a chunk that would grow is left as it is (a delta
chunk, already compressed against its base, nearly always is). Compaction writes plain
codecs only, so it never turns a base into a delta.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.verdicts import Subject, write_record
from ckptflow.chunks.io import ChunkStore
from ckptflow.format.layout import DTYPE_SIZES
from ckptflow.format.layout import FLOATING_DTYPES as FLOATING
from ckptflow.format.manifest import Manifest
from ckptflow.store.base import Store


@dataclass
class CompressionReport:
    chunks: int = 0
    reencoded: int = 0  # chunks this call rewrote (others were already compressed)
    bytes_before: int = 0
    bytes_after: int = 0
    bytes_raw: int = 0  # the chunks' content, what each decodes to: what ``progress`` counts

    @property
    def ratio(self) -> float | None:
        return self.bytes_before / self.bytes_after if self.bytes_after else None


def itemsizes(manifest: Manifest) -> dict[str, tuple[int, bool]]:
    """Element size of the tensor each chunk belongs to, and whether it is floating
    point (for the byte planes of zstd)."""
    sizes: dict[str, tuple[int, bool]] = {}
    for item in manifest.items():
        for digest, _ in item.chunks:
            sizes.setdefault(digest, (DTYPE_SIZES[item.dtype], item.dtype in FLOATING))
    return sizes


def compress(
    store: Store,
    run: str,
    step: int,
    *,
    codec: str = "zstd",
    level: int = 3,
    progress: Callable[[int], None] | None = None,
    commit: str | None = None,
) -> CompressionReport:
    """Re-encode every chunk of a checkpoint with ``codec`` (every chunk is verified
    first) and record the result for the checkpoint's digest. ``progress`` is called
    with each chunk's content size once it is done: decoding and encoding the content is
    the work, and the calls add up to ``bytes_raw``, the manifest's chunk sizes, a total
    known before the first chunk is read. ``commit``: the one admitted (``read_admitted``)."""
    manifest = catalog.read_admitted(store, run, step, commit, "compression")
    chunks = ChunkStore(store)
    report = CompressionReport()
    sizes = itemsizes(manifest)
    for digest, size in sorted(manifest.chunks.items()):
        itemsize, floating = sizes.get(digest, (1, False))
        before, after = chunks.reencode(
            digest, size, codec, itemsize=itemsize, level=level, only_if_smaller=True, floating=floating
        )
        report.chunks += 1
        report.bytes_before += before
        report.bytes_after += after
        report.reencoded += after < before
        report.bytes_raw += size
        if progress:
            progress(size)
    write_record(
        store,
        Subject.of(manifest),
        "compression",
        {
            "chunks": report.chunks,
            "reencoded": report.reencoded,
            "bytes_before": report.bytes_before,
            "bytes_after": report.bytes_after,
            "ratio": report.ratio,
            "codec": codec,
        },
    )
    return report
