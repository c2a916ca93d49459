"""``codec="auto"``: each chunk stored as the smallest of raw, zstd and an XOR delta.

Full checkpoints are the delta bases (``SavePolicy.full_every`` places them): a chunk
of an incremental save may be stored as ``chunk XOR base``, where the base is the
chunk of the same tensor slice in the run's newest full checkpoint. A full save never
writes a delta, so a base is never itself a delta and a chain is one link long. The
address stays the hash of the raw bytes; the manifest lists each delta's base among
its chunks, so restore, verify, GC and archival see bases like any other reference.

Measuring the delta costs a read of the base (decoded and verified). A cheap sample
decides when that is worth it: while saving a full checkpoint the encoder keeps a
32 KiB sample of every chunk (0.4 % of the bytes), and for each changed chunk of a
later incremental it compresses the sample of the new chunk both plainly and XORed
with the base's sample; the base is read only if the delta promises to be smaller.
Without a sample (a process that did not write the full itself) the base is read
and both encodings are computed, which also leaves a sample for the next save.
Weights, which move little per step, mostly end up as deltas; Adam's first moment,
which moves a lot, mostly stays plain zstd.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Set
from dataclasses import dataclass

import numpy as np

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import listing as catalog_listing
from ckptflow.chunks import codecs, planes
from ckptflow.chunks.io import ChunkStore, Encoded, Encoder
from ckptflow.dcp.collectives import Group
from ckptflow.errors import CkptflowError
from ckptflow.format.layout import chunk_key
from ckptflow.format.manifest import Manifest
from ckptflow.store.base import Store

log = logging.getLogger("ckptflow")

SAMPLE_RUNS, SAMPLE_RUN = 4, 8 << 10
DELTA_MARGIN = 0.95  # try the delta when its sample is at least 5 % smaller than plain


def sample(raw: memoryview | np.ndarray) -> np.ndarray:
    """The bytes a chunk's sample holds: four evenly spaced 8 KiB runs (the whole chunk if small)."""
    data = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
    if len(data) <= SAMPLE_RUNS * SAMPLE_RUN:
        return data.copy()
    step = (len(data) - SAMPLE_RUN) // (SAMPLE_RUNS - 1) // 8 * 8  # runs start on element boundaries
    return np.concatenate([data[i * step : i * step + SAMPLE_RUN] for i in range(SAMPLE_RUNS)])


@dataclass(frozen=True)
class BaseIndex:
    """The chunks of the run's newest full checkpoint by tensor slice: what deltas point to."""

    step: int
    digest: str
    slices: Mapping[tuple[str, tuple[int, ...] | None], tuple[str, tuple[tuple[str, int], ...]]]

    @classmethod
    def of(cls, manifest: Manifest) -> BaseIndex:
        return cls(
            manifest.step,
            manifest.digest,
            {(item.fqn, item.offset): (item.dtype, item.chunks) for item in manifest.items() if item.packed_at is None},
        )

    def chunk(self, fqn: str, offset: tuple[int, ...] | None, dtype: str, index: int, size: int) -> str | None:
        """The base of the ``index``-th chunk of a slice, if the full holds that slice
        laid out the same way (same dtype, a chunk of the same length at that place)."""
        found = self.slices.get((fqn, offset))
        if found is None or found[0] != dtype or index >= len(found[1]) or found[1][index][1] != size:
            return None
        return found[1][index][0]


class AutoCodec:
    """The encoder state a ``Checkpointer`` keeps across saves: samples of the chunks
    of the newest full checkpoint it wrote or read."""

    def __init__(self, level: int = 1):
        self.level = level
        self._samples: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def for_save(self, chunks: ChunkStore, kind: str, base: BaseIndex | None) -> SaveEncoder:
        if kind == "full":
            with self._lock:
                self._samples = {}  # this save is the new base: older samples are no use
        return SaveEncoder(self, chunks, base if kind == "incremental" else None, full=kind == "full")

    def remember(self, digest: str, raw: memoryview | np.ndarray) -> None:
        self._samples[digest] = sample(raw)

    def sample_of(self, digest: str) -> np.ndarray | None:
        return self._samples.get(digest)


class SaveEncoder:
    """One save's encoder: ``for_chunk`` gives ``ChunkStore.put`` the encoder of one chunk."""

    def __init__(self, state: AutoCodec, chunks: ChunkStore, base: BaseIndex | None, *, full: bool):
        self.state, self.chunks, self.full, self.base = state, chunks, full, base
        self._touched: set[str] = set()
        self._lock = threading.Lock()
        self._warned = False

    def for_chunk(
        self, fqn: str, offset: tuple[int, ...] | None, dtype: str, index: int, itemsize: int, *, floating: bool
    ) -> Encoder:
        def encode(raw: memoryview, digest: str) -> Encoded:
            base = self.base.chunk(fqn, offset, dtype, index, len(raw)) if self.base else None
            if base is None or base == digest:
                return Encoded(self._plain(raw, digest, itemsize, floating=floating, remember=self.full))
            return self._with_base(raw, digest, base, itemsize, floating=floating)

        return encode

    def _plain(self, raw: memoryview, digest: str, itemsize: int, *, floating: bool, remember: bool) -> list:
        if remember:  # a full save: its chunks are the next incremental saves' bases
            self.state.remember(digest, raw)
        parts = codecs.encode(raw, "zstd", itemsize, level=self.state.level, floating=floating)
        return parts if planes.size(parts) < len(raw) + codecs.HEADER.size else codecs.encode(raw, "raw")

    def _with_base(self, raw: memoryview, digest: str, base: str, itemsize: int, *, floating: bool) -> Encoded:
        known = self.state.sample_of(base)
        if known is not None:
            mine = sample(raw)
            scale = len(raw) / max(1, len(mine))
            plain_bytes = planes.size(planes.encode(mine, itemsize, floating=floating, level=self.state.level))
            plain = min(plain_bytes, len(mine)) * scale
            delta = planes.size(
                planes.encode(np.bitwise_xor(mine, known), itemsize, floating=floating, level=self.state.level)
            )
            if delta * scale + codecs.DIGEST_BYTES >= DELTA_MARGIN * plain:
                return Encoded(self._plain(raw, digest, itemsize, floating=floating, remember=False))
        try:
            self._protect(base)
            base_raw, base_bytes = self.chunks.base_raw(base, len(raw))
        except CkptflowError as e:  # a bad base only costs the saving; restore would refuse it anyway
            if not self._warned:
                self._warned = True
                log.warning("chunks stored without delta (base of %s… unusable): %s", digest[:16], e)
            return Encoded(self._plain(raw, digest, itemsize, floating=floating, remember=False))
        if known is None:
            self.state.remember(base, base_raw)
        delta_parts = codecs.encode_delta(raw, base_raw, base, itemsize, level=self.state.level, floating=floating)
        if known is None or planes.size(delta_parts) >= len(raw):  # no sample said which wins: measure both
            plain_parts = self._plain(raw, digest, itemsize, floating=floating, remember=False)
            if planes.size(plain_parts) <= planes.size(delta_parts):
                return Encoded(plain_parts)
        return Encoded(delta_parts, base, base_bytes)

    def _protect(self, base: str) -> None:
        """Restart GC's grace period for a base this save may depend on (once per save);
        ``ObjectNotFoundError`` if it is gone. The save's lease keeps GC away meanwhile."""
        with self._lock:
            if base in self._touched:
                return
        self.chunks.store.touch(chunk_key(base))
        with self._lock:
            self._touched.add(base)


def newest_full(
    store: Store, run: str, before: int, *, known: Manifest | None = None, skip: Set[int] = frozenset()
) -> Manifest | None:
    """The newest full checkpoint of ``run`` older than ``before``: the delta base.

    ``known`` (the newest full this process committed) answers without reading the
    store when nothing newer than it can exist; steps in ``skip`` (rejected by restore)
    and manifests that do not parse are passed over.
    """
    for step in reversed(catalog_listing.committed_steps(store, run)):
        if step >= before or step in skip:
            continue
        if known is not None and known.step == step:
            return known
        try:
            manifest = catalog.read_manifest(store, run, step)
        except CkptflowError:
            continue
        if manifest.kind == "full":
            return manifest
    return None


def delta_base(
    store: Store,
    run: str,
    step: int,
    group: Group,
    known: Manifest | None,
    last_commit: int | None,
    superseded: Set[int] = frozenset(),
) -> Manifest | None:
    """The full checkpoint an incremental save at ``step`` deltas against, the same on
    every rank of ``group`` (rank 0 names it, each rank reads it, checked by digest).

    ``known`` is the newest full this process committed: while ``last_commit`` shows
    the process committed everything since, it answers without listing the store. A
    listing that fails on rank 0 costs this save its deltas on every rank, as a manifest
    a rank cannot read costs that rank its own: deltas only save space.
    """

    def name_base() -> tuple[int, str] | None:
        found = known
        if known is None or last_commit is None or not known.step <= last_commit < step:
            try:
                found = newest_full(store, run, step, known=known, skip=superseded)
            except (CkptflowError, OSError) as e:
                log.warning("incremental save of step %d stores no deltas on any rank: %s", step, e)
                found = None
        return None if found is None else (found.step, found.digest)

    named = group.decided_on_rank_0(
        name_base, f"find the full checkpoint an incremental save of step {step} deltas against"
    )
    if named is None:
        return None
    if known is not None and known.digest == named[1]:
        return known
    try:
        full = catalog.read_manifest(store, run, named[0])
    except (CkptflowError, OSError) as e:
        log.warning("incremental save of step %d stores no deltas: %s", step, e)
        return None
    return full if full.digest == named[1] else None
