"""torch.distributed.checkpoint ``StorageReader`` over a ckptflow store (the writer: ``dcp_io``).

DCP plans the load (resharding included); this class only moves bytes, and verifies
every chunk before any of them is written into the caller's tensors.
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
import torch.futures
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from ckptflow.chunks import reads
from ckptflow.chunks.budget import MemoryBudget
from ckptflow.chunks.io import ChunkStore
from ckptflow.chunks.streaming import CheckedChunk
from ckptflow.dcp import regions
from ckptflow.dcp.device_landing import DeviceLanding, lands_on_device
from ckptflow.dcp.failures import Failure, IntoPlaceFailed, ReadAborted, describe, failure_of
from ckptflow.dcp.memory import completed_future, tensor_memory
from ckptflow.dcp.metadata import dtype_from_name, metadata_from_index
from ckptflow.dcp.regions import Seen
from ckptflow.dcp.writer import Progress
from ckptflow.errors import is_damage
from ckptflow.format.dcp_index import StorageItem
from ckptflow.format.layout import chunk_key
from ckptflow.format.manifest import Manifest
from ckptflow.format.state_tree import unflatten

# A chunk the page cache holds and smaller than this is read on the restoring thread itself
# (``CheckpointReader._here``): its fixed cost (an open, a stat, the Python around them)
# outweighs its bytes, and two threads doing such work each wait on the GIL the other holds
# between its system calls. 2,400 cached chunks of 64 KiB: checked in 0.17 s on one thread,
# 0.30-0.34 s on a pool of one (the hand-offs), 0.35-0.53 s on a pool of two.
SMALL_CHUNK = 256 << 10


class CheckpointReader(StorageReader):
    """Reads one committed checkpoint in two passes, so a bad checkpoint touches nothing.

    Pass one verifies every chunk this rank needs, against the fast checksum its manifest
    records (``ckptflow.format.checksum``; the address for manifests without one); ``agree`` then
    combines every rank's verdict (a collective: all ranks call ``read_data``). Only if all
    ranks verified cleanly does pass two read local raw chunks straight into the
    destination tensors, checking each piece as it lands, while it is in the CPU cache
    (a mismatch, or an I/O error, is read once more and verified through ``ChunkStore.get``).
    So restore needs no second copy of the model in host memory, and a rejected checkpoint
    leaves the caller's tensors as they were. Chunks that must be decoded to be verified (encoded, or on S3) are kept
    from pass one to pass two only while they fit ``budget``; the rest are decoded again
    (``ckptflow.chunks.budget``), and staging tensors (resharding, GPU targets) are filled
    and released in groups that fit it too, so host memory beyond the state stays bounded.
    A failure in pass two raises ``IntoPlaceFailed``: those tensors are partly
    written, which restore reports as ``PartialRestoreError``. A chunk the page cache holds
    is read on one thread per core, a small one on the restoring thread itself (``_here``),
    any other on the restore's wider pool (``_pool_for``).

    ``single_pass`` (opt-in) skips pass one: every chunk is read or decoded straight into
    place and verified there (``ChunkStore.read_verified``), one read and one decode per
    chunk. What it gives up: damage is found only after some tensors were written, so a
    damaged checkpoint raises ``IntoPlaceFailed`` (no clean fallback to an older one),
    and the ranks agree on nothing before they write.
    """

    def __init__(
        self,
        chunks: ChunkStore,
        manifest: Manifest,
        pool: ThreadPoolExecutor,
        progress: Progress | None = None,
        *,
        agree: Callable[[Failure | None], Failure | None] | None = None,
        budget: MemoryBudget | None = None,
        single_pass: bool = False,
    ):
        super().__init__()
        self.single_pass = single_pass
        self.budget = budget or MemoryBudget()
        self.landing = DeviceLanding(self.budget.in_flight_cap)  # chunks copied onto GPU targets
        self.chunks = chunks.scoped(
            manifest.chunks,
            checksums=manifest.fast_checksums,
            stored_checksums=manifest.stored_checksums,
            address=manifest.address,
            budget=self.budget,
        )  # reads checked fast
        self.manifest, self.pool, self.progress = manifest, pool, progress
        self.agree = agree or (lambda failure: failure)
        self.metadata, self.storage = metadata_from_index(manifest.dcp)
        self.loaded: Seen = {}  # once read_data succeeds: the regions it loaded (``ckptflow.dcp.regions``)

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _check(self, digest: str, size: int) -> CheckedChunk:
        checked = self.chunks.check(digest, size)
        if self.progress:
            self.progress(size)
        return checked

    def _in_memory(self, digests: list[str], per_core: ThreadPoolExecutor | None) -> set[str]:
        """The chunks of ``digests`` whose files the page cache holds now (none without a
        per-core pool), asked on the wide pool: each answer is an open and a system call,
        a round trip where the store is a network filesystem."""
        if per_core is None:
            return set()
        store = self.chunks.store

        def ask(batch: list[str]) -> list[str]:
            return [digest for digest in batch if store.in_memory(chunk_key(digest))]

        # a task per batch, not per chunk: asking a local disk (~10 us) costs less than a task's hand-off
        width = self.pool._max_workers
        batches = [digests[i::width] for i in range(min(width, len(digests)))]
        return {digest for cached in self.pool.map(ask, batches) for digest in cached}

    def _pool_for(self, per_core: ThreadPoolExecutor | None, *, cpu_only: bool) -> ThreadPoolExecutor:
        """Where the work on one chunk runs: ``per_core`` (one thread per core) if it needs no
        I/O (``cpu_only``: its bytes in hand, or in the page cache), since it is then CPU work
        (the kernel's copy, checksums, decoding) and more threads only evict each other's
        pieces from the CPU cache and queue on the GIL; else the restore's pool, whose many
        threads keep a disk or a network busy."""
        return per_core if per_core is not None and cpu_only else self.pool

    @staticmethod
    def _here(per_core: ThreadPoolExecutor | None, size: int, *, cpu_only: bool) -> bool:
        """Whether the restoring thread does the work on a chunk itself (``SMALL_CHUNK``)
        while the pools work on the larger ones; never for a store without a page cache."""
        return per_core is not None and cpu_only and size < SMALL_CHUNK

    def _verify_all(
        self, indexes: list[MetadataIndex], per_core: ThreadPoolExecutor | None
    ) -> tuple[dict[str, CheckedChunk], Failure | None]:
        """Every chunk checked; a read that failed (an outage, a cold object, a newer format)
        outweighs a damaged chunk elsewhere, as it does across ranks (``failures.agree``): the
        restore stops rather than decide on what it could not read, whichever rank read what."""
        sizes = self.manifest.chunks  # a pack's, not its member's slice (``packs``)
        needed = {digest: sizes[digest] for index in indexes for digest, _ in self.storage[index].chunks}
        cached = self._in_memory(list(needed), per_core)
        futures = {
            digest: self._pool_for(per_core, cpu_only=digest in cached).submit(self._check, digest, size)
            for digest, size in needed.items()
            if not self._here(per_core, size, cpu_only=digest in cached)
        }
        checked: dict[str, CheckedChunk] = {}
        errors: list[BaseException] = []
        for digest, size in needed.items():
            if digest not in futures:
                try:
                    checked[digest] = self._check(digest, size)
                except Exception as e:
                    errors.append(e)
        for digest, future in futures.items():
            try:
                checked[digest] = future.result()
            except Exception as e:
                errors.append(e)
        if not errors:
            return checked, None
        checked.clear()  # chunks kept decoded: the errors' tracebacks hold this frame until collected
        unread = [e for e in errors if not is_damage(e)]
        return {}, failure_of(unread[0] if unread else errors[0])

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        # a store with a page cache: chunks it holds in memory are read one per core (``_pool_for``),
        # never on more threads than the restore's own pool has
        cores = min(reads.CORES, self.pool._max_workers)
        per_core = ThreadPoolExecutor(cores, "ckptflow-cpu") if self.chunks.store.cheap_reread else None
        try:
            self._read_data(plan, planner, per_core)
        finally:
            if per_core is not None:
                per_core.shutdown()
        return completed_future(None)

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner, per_core: ThreadPoolExecutor | None) -> None:
        by_storage: dict[MetadataIndex, list] = defaultdict(list)
        values = [req for req in plan.items if req.type == LoadItemType.BYTE_IO]
        for req in plan.items:
            if req.type != LoadItemType.BYTE_IO:
                by_storage[req.storage_index].append(req)
        checked: dict[str, CheckedChunk] = {}
        failure: Failure | None = None
        if not self.single_pass:
            try:
                checked, failure = self._verify_all(list(by_storage), per_core)
            except Exception as e:  # never skip ``agree``: the other ranks wait in it
                checked, failure = {}, failure_of(e)
        failure = self.agree(failure)
        if failure:
            raise ReadAborted(failure)
        loading: list = []
        here: list[tuple[str, memoryview]] = []  # small chunks this thread reads, before the next ``_finish``
        packed: dict[str, list[tuple[int, memoryview]]] = {}  # per pack, its members' slices and where they go
        last_pack: dict[str, memoryview] = {}  # the pack read last: its other members may come after a flush
        staged = 0  # bytes of staging tensors allocated and not yet copied out
        try:
            digests = {digest: None for index in by_storage for digest, _ in self.storage[index].chunks}
            cached = self._in_memory(list(digests), per_core)
            for index, reqs in by_storage.items():
                item = self.storage[index]
                targets = [planner.resolve_tensor(req).detach() for req in reqs]
                pinned = False  # whether ``buffer`` is pinned staging memory, copied to a GPU without blocking
                futures: list[Future] = []
                whole = len(reqs) == 1 and _laid_out_like(item, reqs[0], targets[0])
                if whole and lands_on_device(targets[0]) and item.packed_at is None:
                    loading.append((reqs, targets, targets[0], False, futures))  # before any submit: ``finally`` waits
                    for digest, offset, size in _chunk_offsets(item.chunks):
                        futures.append(self.pool.submit(self._onto_device, checked, digest, targets[0], offset, size))
                    continue
                if whole and targets[0].device.type == "cpu":
                    buffer = targets[0]  # chunks land in place: no staging tensor, no copy
                else:  # resharding, another device or dtype: read the item, then copy slices
                    if staged and staged + item.nbytes > self.budget.in_flight_cap:
                        self._read_here(checked, here, packed, last_pack)
                        _finish(loading, planner)  # staging stays within the budget: use what is staged
                        staged = 0
                    pinned = any(t.device.type == "cuda" for t in targets)
                    buffer = torch.empty(item.shape, dtype=dtype_from_name(item.dtype), pin_memory=pinned)
                    staged += item.nbytes
                raw, offset = _writable_bytes(buffer), 0
                loading.append((reqs, targets, buffer, pinned, futures))  # before any submit: ``finally`` waits
                if item.packed_at is not None:
                    packed.setdefault(item.chunks[0][0], []).append((item.packed_at, raw))
                    continue
                for digest, size in item.chunks:
                    kept = digest in checked and checked[digest].data is not None  # pass one kept it decoded
                    cpu_only, out = kept or digest in cached, raw[offset : offset + size]
                    if self._here(per_core, size, cpu_only=cpu_only):
                        here.append((digest, out))
                    else:
                        pool = self._pool_for(per_core, cpu_only=cpu_only)
                        futures.append(pool.submit(self._into_place, checked, digest, out))
                    offset += size
            self._read_here(checked, here, packed, last_pack)
            _finish(loading, planner)
            self.loaded = regions.loaded_regions(self.manifest, (self.storage[index] for index in by_storage))
            for req in values:
                planner.load_bytes(req, _as_torch_save(self.manifest.dcp.values[req.storage_index.fqn]))
        except Exception as e:  # verified, yet not read into place: the caller's tensors are partly written
            raise IntoPlaceFailed(describe(e)) from e
        finally:  # on failure: no read may write into the caller's tensors after this returns
            pending = [f for *_, futures in loading for f in futures]
            for f in pending:
                f.cancel()
            wait(pending)

    def _read_here(
        self,
        checked: dict[str, CheckedChunk],
        here: list[tuple[str, memoryview]],
        packed: dict[str, list[tuple[int, memoryview]]],
        last_pack: dict[str, memoryview],
    ) -> None:
        """Read the small chunks of ``here`` into place on this thread, and each pack of
        ``packed`` into a buffer of its own, copying its members' slices out (both emptied
        as it goes: one pack's buffer at a time). The last pack read is kept in
        ``last_pack``: members come in save order, so a pack whose members a staging flush
        split in two is read once, not once per flush."""
        while here:
            self._into_place(checked, *here.pop())
        for digest, members in packed.items():
            if digest not in last_pack:
                last_pack.clear()
                # at most MAX_PACK_BYTES and no larger than the slices it names: Manifest.parse
                last_pack[digest] = memoryview(bytearray(self.manifest.chunks[digest]))
                self._into_place(checked, digest, last_pack[digest])
            pack = last_pack[digest]
            for at, out in members:
                out[:] = pack[at : at + len(out)]
        packed.clear()

    def _onto_device(
        self, checked: dict[str, CheckedChunk], digest: str, target: torch.Tensor, offset: int, size: int
    ) -> None:
        self.landing.land(lambda out: self._into_place(checked, digest, out), target, offset, size)

    def _into_place(self, checked: dict[str, CheckedChunk], digest: str, out: memoryview) -> None:
        """One chunk read into ``out``: as pass one verified it, or verified now (single pass)."""
        if self.single_pass:
            self.chunks.read_verified(digest, len(out), out)
            if self.progress:
                self.progress(len(out))
        else:
            self.chunks.read_checked(checked[digest], out)


def _as_torch_save(skeleton: Any) -> io.BytesIO:
    """A value stored as JSON (``CheckpointWriter(json_values=True)``) in the form DCP's
    ``load_bytes`` takes. DCP's planner ``torch.load``s it; the bytes are made here, by
    ``torch.save`` of what the JSON decodes to (numbers, strings, lists, tuples, dicts,
    bytes), never read from storage, so what it unpickles is only ever such plain values."""
    buffer = io.BytesIO()
    torch.save(unflatten(skeleton, {}), buffer)
    buffer.seek(0)
    return buffer


def _finish(loading: list, planner: LoadPlanner) -> None:
    """Wait for the reads of ``loading`` (emptied as it goes), copy staged items into their
    targets and commit them; a staging tensor is released once its copies are done."""
    while loading:
        reqs, targets, buffer, pinned, futures = loading[0]
        for f in futures:
            f.result()
        for req, target in zip(reqs, targets):
            if target is not buffer:
                src = buffer
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    src = src.narrow(dim, start, length)
                target.copy_(src, non_blocking=pinned)
        if pinned:
            torch.cuda.current_stream().synchronize()  # copies done before commit and reuse
        for req, target in zip(reqs, targets):
            planner.commit_tensor(req, target)
        loading.pop(0)


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor as writable bytes (no copy; still resizable after)."""
    return tensor_memory(tensor)


def _chunk_offsets(chunks: Sequence[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """An item's chunks with the byte offset each starts at: (digest, offset, size)."""
    out, offset = [], 0
    for digest, size in chunks:
        out.append((digest, offset, size))
        offset += size
    return out


def _laid_out_like(item: StorageItem, req: Any, target: torch.Tensor) -> bool:
    """Whether ``req`` reads the whole stored item into a tensor laid out exactly like it."""
    return (
        type(target) is torch.Tensor
        and target.dtype == dtype_from_name(item.dtype)
        and tuple(target.shape) == item.shape
        and target.is_contiguous()
        and tuple(req.lengths) == item.shape
        and not any(req.storage_offsets)
    )
