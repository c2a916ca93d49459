"""torch.distributed.checkpoint ``StorageWriter`` over a ckptflow store (the reader: ``dcp_reader``).

DCP does the planning (replicated-tensor dedup, resharding on load, async staging);
this class only moves bytes: each rank splits its write items into content-addressed
chunks, hashes and writes them from a thread pool, writes its rank record, and the
coordinator commits the manifest last.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import torch
import torch.futures
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from ckptflow.catalog.commit import commit_manifest
from ckptflow.chunks import damaged
from ckptflow.chunks.io import ChunkStore, ChunkWrite, Encoder
from ckptflow.chunks.private_copies import PrivateCopies, private_copies
from ckptflow.dcp import put_batches, regions
from ckptflow.dcp.commit_lease import CommitLease
from ckptflow.dcp.host_copies import HostCopies, copied_in_chunks
from ckptflow.dcp.memory import bytes_view, completed_future, is_own_memory
from ckptflow.dcp.metadata import byte_io_refusal, dtype_name, json_value, plan_bytes
from ckptflow.dcp.packs import Pack, Packer
from ckptflow.dcp.put_batches import PutBatches, Slot
from ckptflow.dcp.regions import Region, Seen, Tracked
from ckptflow.dcp.save_manifest import manifest_record, write_result
from ckptflow.dcp.save_spec import SaveSpec
from ckptflow.dcp.written_pages import Snapshot, WriteTracker, edge_checksum, tracked_span
from ckptflow.errors import CkptflowError, StoreFullError, StoreUnavailableError, UnsupportedStateError
from ckptflow.format import layout as fmt
from ckptflow.format.checksum import same_content
from ckptflow.format.manifest import Manifest, RankRecord
from ckptflow.format.sealed import seal

log = logging.getLogger(__name__)

Progress = Callable[[int], None]

# Single-process use (no process group) is a supported mode here, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _packed(packer: Packer | None, tensor: torch.Tensor) -> bool:
    return packer is not None and packer.fits(tensor.numel() * tensor.dtype.itemsize)


class CheckpointWriter(StorageWriter):
    """Writes one rank's chunks. A save given ``previous`` (what this process's previous save
    found in each region of each tensor, ``seen``, or what its restore loaded there:
    ``ckptflow.dcp.regions``) hashes each chunk with xxh3-128 first, and
    where it equals the region's previous one takes that save's fast checksum and address for
    it instead of computing BLAKE3 again (the cryptographic hash runs over changed bytes
    only); an incremental save also reuses that save's chunk without asking the store whether
    it exists (``ChunkStore.put``'s ``known``), while a full one writes it anew; a chunk some
    reader proved damaged is written anew by either (``ckptflow.chunks.damaged``, whose
    records each save lists first). What is trusted is xxh3-128 telling one's own two
    versions of a region apart, not a defence against forgery (cross-run dedup and
    ``verify --deep`` keep the address).

    Given a ``tracker``, an incremental save does not even read a region the kernel saw no
    write to since the previous save read it (``written_pages``: any write, in place,
    through ``.data``, a view or another tensor sharing the storage, is seen); ``tracked``
    says which regions of ``previous`` were read under its protection. A full save reads
    every region, and checks what the tracker said of each."""

    def __init__(
        self,
        chunks: ChunkStore,
        spec: SaveSpec,
        pool: ThreadPoolExecutor,
        progress: Progress | None = None,
        *,
        previous: Mapping[Region, ChunkWrite] | None = None,
        tracker: WriteTracker | None = None,
        tracked: Mapping[Region, Tracked] | None = None,
        json_values: bool = False,
        live: bool = True,
    ):
        super().__init__()
        self.chunks, self.spec, self.pool, self.progress = chunks, spec, pool, progress
        self.previous = previous or {}
        self.tracker, self.previous_tracked = tracker, tracked or {}
        self.json_values = json_values
        # DCP hands over the caller's own tensors (a blocking save): written from private copies. False only
        # where they are a staged copy nothing else writes (the Checkpointer's async save)
        self.live = live
        self.copies: PrivateCopies | None = None  # where chunks of live memory are copied before they are stored
        self.seen: Seen = {}  # for the next save, once this one has committed
        self.tracked: dict[Region, Tracked] = {}  # the regions of ``seen`` this save's snapshot protected
        self.snapshot: Snapshot | None = None
        self.rank = 0
        self.is_coordinator = True
        self.manifest: Manifest | None = None
        self.abandoned = False  # Ctrl-C at exit (``save_handle``): the process ends with nothing committed
        self.lease = CommitLease(  # the coordinator's, planning to commit; a failure elsewhere: the caller releases
            chunks.store, f"run {spec.run!r} step {spec.step}"
        )

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return self.lease.hold(plans)  # on the coordinator, before any rank writes: kept until the commit

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"{self.spec.run}/{self.spec.step}")

    def _put(
        self,
        piece: memoryview,
        tensor: torch.Tensor,
        encoder: Encoder | None,
        region: Region,
        address: int | None,
        vouched: str | None = None,
    ) -> tuple[ChunkWrite, bool]:
        """The chunk of ``piece``, and whether it was left unread (the kernel ``vouched`` for
        it: ``_vouched``, asked here unless the caller found it vouched for)."""
        digest = checksum = known = None
        earlier = self.previous.get(region)
        if vouched is None:
            vouched = self._vouched(region, piece, address)
        edges = vouched
        if edges is None and address is not None and self.snapshot is not None:
            # before the piece is read: a write to an edge page in between makes them differ,
            # and the next save, seeing that page written, reads the region again
            edges = edge_checksum(piece, address)
        unread = False
        copies = self.copies if is_own_memory(tensor) else None
        compared = copies is not None and self.spec.kind == "full"  # against the earlier checksum, in put
        if earlier is not None and vouched is not None and self.spec.kind == "incremental":
            checksum, digest, known, unread = earlier.checksum, earlier.digest, earlier, True  # no write reached it
        elif earlier is not None and compared:
            # written from a private copy whose checksum ``put`` compares with the earlier one: one pass, not two
            checksum, digest = earlier.checksum, earlier.digest
        elif earlier is not None and same_content(piece, earlier.checksum):
            checksum, digest = earlier.checksum, earlier.digest  # the same bytes as last time
            if self.spec.kind == "incremental":
                known = earlier  # and the chunk holding them: a full save rewrites it anyway
        elif vouched is not None and self.tracker is not None:  # a full save checks what incremental ones trust
            self.tracker.distrust(self._unseen_change(region))
        write = self.chunks.put(
            piece,
            digest=digest,
            checksum=checksum,
            codec="raw" if encoder else self.spec.codec,
            itemsize=tensor.element_size(),
            floating=tensor.is_floating_point(),
            rewrite=self.spec.kind == "full",
            encoder=encoder,
            known=known,
            copies=copies,
        )
        if compared and write.checksum != checksum and vouched is not None and self.tracker is not None:
            self.tracker.distrust(self._unseen_change(region))
        if self.progress:
            self.progress(len(piece))
        self.seen[region] = write
        if edges is not None and address is not None and self.snapshot and self.snapshot.covers(address, len(piece)):
            self.tracked[region] = (self.snapshot.epoch, address, edges)
        return write, unread

    def _vouched(self, region: Region, piece: memoryview, address: int | None) -> str | None:
        """The edge checksum of ``region`` if the kernel vouches that it (at ``address``)
        holds the bytes the previous save stored from there: that save read them after the
        snapshot before this one protected their pages, and none was written since
        (``written_pages``); else None."""
        snapshot = self.snapshot
        tracked = self.previous_tracked.get(region) if region in self.previous else None
        if snapshot is None or address is None or tracked is None or tracked[:2] != (snapshot.since, address):
            return None
        return tracked[2] if snapshot.unwritten(piece, address, tracked[2]) else None

    def _chunk_encoder(self, item: Any, tensor: torch.Tensor, index: int) -> Encoder | None:
        if self.spec.encoder is None:
            return None
        offset = None if item.index.offset is None else tuple(item.index.offset)
        return self.spec.encoder.for_chunk(
            item.index.fqn,
            offset,
            dtype_name(tensor.dtype),
            index,
            tensor.element_size(),
            floating=tensor.is_floating_point(),
        )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        try:
            with self.lease.chunk_phase(plan) as lease:
                damaged.load(self.chunks.store)  # chunks another process proved damaged: written anew
                with self.chunks.store.batch():  # durable when it ends: before the rank record and the commit
                    results = self._write_chunks(plan, planner)
                if lease is not None and lease.lost:  # GC may have swept meanwhile (else: the commit checks)
                    raise StoreUnavailableError(
                        f"the save lease of run {self.spec.run!r} step {self.spec.step} in {self.chunks.store.url} "
                        "could not be renewed while chunks were written, so GC may have swept some; save again"
                    )
            self._write_rank_record(results)
        except BaseException as e:
            self.lease.release()  # this rank's failure: DCP calls no ``finish``
            if not isinstance(e, StoreFullError):
                raise
            needed = plan_bytes(plan)
            raise StoreFullError(
                f"saving run {self.spec.run!r} step {self.spec.step} (rank {self.rank}) needs up to {needed} bytes "
                f"for its tensors in {self.chunks.store.url} (less where chunks are already stored): {e}",
                needed=needed,
            ) from e
        return completed_future(results)

    def _write_chunks(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        pending: list[tuple[Any, torch.Tensor | None, Any, list[Slot], int | None]] = []
        jobs = 8 if self.chunks.store.cheap_reread else 1  # a local disk's fsyncs; S3 requests run side by side
        batches = PutBatches(self.pool, self._put, self.spec.chunk_bytes, jobs=jobs)
        host_copies = HostCopies(batches)  # a GPU tensor's chunks: copied to host memory as they are queued
        pack_bytes = min(self.spec.pack_bytes, self.spec.chunk_bytes)
        packer = Packer(pack_bytes) if pack_bytes > 0 else None
        self.copies = private_copies(self.spec.chunk_bytes, writers=self.pool._max_workers) if self.live else None
        resolved = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO and not self.json_values:
                raise UnsupportedStateError(byte_io_refusal(item.index.fqn, self.spec.run, self.spec.step))
            resolved.append((item, None if item.type == WriteItemType.BYTE_IO else planner.resolve_data(item)))
        # a packed tensor is always read (``packs``): its pages are not watched, so writing them costs no fault
        spans = [
            tracked_span(t) if isinstance(t, torch.Tensor) and not _packed(packer, t) else None for _item, t in resolved
        ]
        if self.tracker is not None:  # before any byte is read: a write from now on is seen by the next save
            self.snapshot = self.tracker.snapshot(span for span in spans if span is not None)
        try:
            for (item, tensor), span in zip(resolved, spans):
                if tensor is None:
                    pending.append((item, None, json_value(planner, item.index.fqn, item.index), [], None))
                    continue
                assert isinstance(tensor, torch.Tensor)  # BYTE_IO items are resolved above
                nbytes = tensor.numel() * tensor.element_size()
                base = None if span is None else tensor.data_ptr()
                step = self.spec.chunk_bytes
                offset = None if item.index.offset is None else tuple(item.index.offset)
                copied = copied_in_chunks(tensor)
                if packer is not None and packer.fits(nbytes):
                    raw = host_copies.whole(tensor) if copied else bytes_view(tensor)
                    key = (item.index.fqn, offset, dtype_name(tensor.dtype), len(raw))
                    closed, pack, at = packer.add(
                        key, raw, tensor.dtype.itemsize, floating=tensor.dtype.is_floating_point
                    )
                    if closed is not None:
                        self._submit_pack(closed, batches)
                        host_copies.sent(closed)
                    if copied:
                        host_copies.packed(pack, nbytes)
                    pending.append((item, tensor, nbytes, [(pack.holder, 0)], at))
                    continue
                futures = []
                if copied:
                    pieces: Iterable[memoryview] = host_copies.pieces(tensor, step)
                else:
                    raw = bytes_view(tensor)
                    pieces = (raw[off : off + step] for off in range(0, len(raw), step))
                for off, piece in zip(range(0, nbytes, step), pieces):
                    region = regions.region(item.index.fqn, offset, off // step, dtype_name(tensor.dtype), len(piece))
                    encoder = self._chunk_encoder(item, tensor, off // step)
                    address = None if base is None else base + off
                    vouched = self._vouched(region, piece, address) if self.spec.kind == "incremental" else None
                    if vouched is not None:
                        # nothing to read or write, as a rule only the chunk to touch: done here,
                        # which spares the pool's threads (and their GIL) a task per untouched region
                        futures.append(put_batches.ready(self._put(piece, tensor, encoder, region, address, vouched)))
                    else:
                        futures.append(batches.add(piece, tensor, encoder, region, address))
                    if copied:
                        host_copies.queued(len(piece), futures[-1])
                pending.append((item, tensor, nbytes, futures, None))
            last = packer.close() if packer is not None else None
            if last is not None:
                self._submit_pack(last, batches)
            batches.flush()
            return [write_result(*entry) for entry in pending]
        finally:  # on failure: no chunk write may outlive the lease
            for f in batches.submitted:
                f.cancel()
            wait(batches.submitted)
            self.copies = None  # their memory goes back when the save's writes are done

    def _submit_pack(self, pack: Pack, batches: PutBatches) -> None:
        future = self.pool.submit(self._put_pack, pack)
        pack.holder.append(future)
        batches.submitted.append(future)

    def _put_pack(self, pack: Pack) -> list[tuple[ChunkWrite, bool]]:
        """Store ``pack`` (``ckptflow.dcp.packs``) from a copy of its members; reused where
        the copy equals what the previous save stored for the same members."""
        copy = memoryview(bytearray(pack.size))
        pack.fill(copy)
        digest = checksum = known = None
        earlier = self.previous.get(pack.region)
        if earlier is not None and same_content(copy, earlier.checksum):
            checksum, digest = earlier.checksum, earlier.digest
            if self.spec.kind == "incremental":
                known = earlier
        itemsize, floating = pack.itemsize, pack.floating
        encoder = pack.plain_encoder() if self.spec.codec == "auto" else None  # never a delta
        write = self.chunks.put(
            copy,
            digest=digest,
            checksum=checksum,
            codec="raw" if encoder else self.spec.codec,
            itemsize=itemsize,
            floating=floating,
            rewrite=self.spec.kind == "full",
            encoder=encoder,
            known=known,
        )
        if self.progress:
            self.progress(pack.size)
        self.seen[pack.region] = write
        return [(write, False)]

    def _unseen_change(self, region: Region) -> str:
        return (
            f"{region[0]!r} chunk {region[2]} changed without a write to its pages; incremental checkpoints of "
            f"run {self.spec.run!r} before step {self.spec.step} that reused it may hold its older bytes "
            "(this full save holds the new ones)"
        )

    def _write_rank_record(self, results: list[WriteResult]) -> None:
        spec = self.spec
        record = RankRecord(
            run=spec.run,
            step=spec.step,
            rank=self.rank,
            world_size=spec.world_size,
            save_id=spec.save_id,
            state=spec.skeleton,
            rng=spec.rng,
            items=len(results),
        )
        self.chunks.store.put_if_absent(fmt.rank_key(spec.run, spec.step, self.rank, spec.save_id), record.seal())

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        spec = self.spec
        try:  # the lease goes back however ``finish`` ends: under a plain ``dcp.save`` nothing else releases it
            key = fmt.manifest_key(spec.run, spec.step)
            blob = seal(manifest_record(spec, metadata, results))
            parsed = Manifest.parse(
                blob, f"manifest {self.chunks.store.url}/{key} (before commit)"
            )  # never commit what a reader refuses
            if self.abandoned:  # right before the commit, yet before the lease's check: why it ends, lease lost or not
                raise CkptflowError(
                    f"the save of run {spec.run!r} step {spec.step} was abandoned at exit: not committed"
                )
            self.lease.check_held()  # refused if GC may have swept meanwhile
            commit_manifest(self.chunks.store, spec.run, spec.step, blob, self.pool, replaces=spec.replaces)
            self.lease.confirm_commit(parsed, blob, self.pool)  # lost during the commit: GC may have swept
        finally:
            self.lease.release()
        self.manifest = parsed
