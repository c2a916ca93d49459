"""torch.distributed.checkpoint ``StorageWriter`` / ``StorageReader`` over a ckptflow store.

DCP does the planning (replicated-tensor dedup, resharding on load, async staging);
these classes only move bytes: each rank splits its write items into content-addressed
chunks, hashes and writes them from a thread pool, writes its rank record, and the
coordinator commits the manifest last. The reader verifies every chunk it reads.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.futures
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from ckptflow import format as fmt
from ckptflow.auto_codec import SaveEncoder
from ckptflow.checksum import ADDRESS
from ckptflow.checksum import FIELD as FAST_CHECKSUMS
from ckptflow.chunks import CheckedChunk, ChunkStore, ChunkWrite, Encoder
from ckptflow.dcp_index import StorageItem
from ckptflow.dcp_meta import dtype_from_name, dtype_name, metadata_from_index, metadata_to_json
from ckptflow.errors import CheckpointExistsError, StoreFullError, StoreUnavailableError, UnsupportedStateError
from ckptflow.failures import DAMAGE, Failure, ReadAborted, failure_of
from ckptflow.leases import save_lease
from ckptflow.manifest import Manifest, RankRecord
from ckptflow.sealed import seal

Progress = Callable[[int], None]

# Single-process use (no process group) is a supported mode here, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy arrays are buffers


@dataclass
class SaveSpec:
    """Everything one rank's writer needs beyond the tensors DCP hands it."""

    run: str
    step: int
    kind: str  # "full" rewrites every chunk; "incremental" trusts chunks already stored
    base_step: int | None
    skeleton: Any
    rng: dict | None
    metadata: dict
    world_size: int
    save_id: str  # one id per save attempt, shared by all ranks; ties rank records to their manifest
    chunk_bytes: int = 8 << 20
    codec: str = "raw"
    created_at: float = field(default_factory=time.time)
    encoder: SaveEncoder | None = None  # codec "auto": chooses raw, zstd or a delta per chunk


def _plan_bytes(plan: SavePlan) -> int:
    """The tensor bytes one rank's plan writes, before dedup."""
    return sum(
        math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
        for item in plan.items
        if item.tensor_data is not None and item.tensor_data.properties.dtype is not None
    )


def _done(value: Any) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class CheckpointWriter(StorageWriter):
    def __init__(self, chunks: ChunkStore, spec: SaveSpec, pool: ThreadPoolExecutor, progress: Progress | None = None):
        super().__init__()
        self.chunks, self.spec, self.pool, self.progress = chunks, spec, pool, progress
        self.rank = 0
        self.is_coordinator = True
        self.manifest: Manifest | None = None

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
        return plans

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"{self.spec.run}/{self.spec.step}")

    def _put(self, piece: memoryview, tensor: torch.Tensor, encoder: Encoder | None) -> ChunkWrite:
        write = self.chunks.put(
            piece,
            codec="raw" if encoder else self.spec.codec,
            itemsize=tensor.element_size(),
            floating=tensor.is_floating_point(),
            rewrite=self.spec.kind == "full",
            encoder=encoder,
        )
        if self.progress:
            self.progress(len(piece))
        return write

    def _chunk_encoder(self, item: Any, tensor: torch.Tensor, index: int) -> Encoder | None:
        if self.spec.encoder is None:
            return None
        offset = None if item.index.offset is None else tuple(item.index.offset)
        return self.spec.encoder.for_chunk(
            item.index.fqn, offset, dtype_name(tensor.dtype), index, tensor.element_size(), tensor.is_floating_point()
        )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        try:
            with save_lease(self.chunks.store) as lease:
                results = self._write_chunks(plan, planner)
                if lease.lost:  # GC may have taken the store for dead-writer chunks meanwhile
                    raise StoreUnavailableError(
                        f"the save lease of run {self.spec.run!r} step {self.spec.step} in {self.chunks.store.url} "
                        "could not be renewed while chunks were written, so GC may have swept some; save again"
                    )
            self._write_rank_record(results)
        except StoreFullError as e:
            needed = _plan_bytes(plan)
            raise StoreFullError(
                f"saving run {self.spec.run!r} step {self.spec.step} (rank {self.rank}) needs up to {needed} bytes "
                f"for its tensors in {self.chunks.store.url} (less where chunks are already stored): {e}",
                needed=needed,
            ) from e
        return _done(results)

    def _write_chunks(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        pending: list[tuple[Any, torch.Tensor, memoryview, list[Future]]] = []
        try:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise UnsupportedStateError(
                        f"{item.index.fqn!r} is not a tensor, so DCP would store it as a BYTE_IO item, which would "
                        "be pickled, and ckptflow never pickles: save it through a Checkpointer, which keeps "
                        "every non-tensor value of the state as JSON in its rank record, or convert it to a tensor"
                    )
                tensor = planner.resolve_data(item)
                assert isinstance(tensor, torch.Tensor)  # BYTE_IO items were refused above
                raw = _bytes_view(tensor)
                step = self.spec.chunk_bytes
                futures = [
                    self.pool.submit(
                        self._put, raw[off : off + step], tensor, self._chunk_encoder(item, tensor, off // step)
                    )
                    for off in range(0, len(raw), step)
                ]
                pending.append((item, tensor, raw, futures))
            return [self._result(item, tensor, raw, futures) for item, tensor, raw, futures in pending]
        finally:  # on failure: no chunk write may outlive the lease
            queued = [f for *_, futures in pending for f in futures]
            for f in queued:
                f.cancel()
            wait(queued)

    @staticmethod
    def _result(item: Any, tensor: torch.Tensor, raw: memoryview, futures: list[Future]) -> WriteResult:
        writes = [f.result() for f in futures]
        data = {
            "dtype": dtype_name(tensor.dtype),
            "shape": list(tensor.shape),
            "chunks": [[w.digest, w.raw_bytes] for w in writes],
            "_writes": [[w.stored_bytes, w.written, w.base, w.base_bytes, w.checksum] for w in writes],
        }
        return WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=data)

    def _write_rank_record(self, results: list[WriteResult]) -> None:
        spec = self.spec
        record = RankRecord(
            spec.run, spec.step, self.rank, spec.world_size, spec.save_id, spec.skeleton, spec.rng, len(results)
        )
        self.chunks.store.put_if_absent(fmt.rank_key(spec.run, spec.step, self.rank, spec.save_id), record.seal())

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        spec = self.spec
        storage: dict[MetadataIndex, dict] = {}
        chunk_sizes: dict[str, int] = {}
        stored: dict[str, int] = {}
        bases: dict[str, str] = {}
        checksums: dict[str, str] = {}
        written_digests: set[str] = set()
        written_bytes = written_stored = logical = 0
        for rank_results in results:
            for wr in rank_results:
                data = dict(wr.storage_data)
                writes = data.pop("_writes")
                storage[wr.index] = data
                logical += wr.size_in_bytes
                for (digest, raw_len), (size, was_written, base, base_bytes, checksum) in zip(data["chunks"], writes):
                    chunk_sizes[digest] = raw_len
                    checksums[digest] = checksum
                    stored[digest] = size
                    if base is not None:  # restore, verify and GC must see the base: list it
                        bases[digest] = base
                        chunk_sizes[base] = raw_len
                        stored.setdefault(base, base_bytes)
                    if was_written and digest not in written_digests:
                        written_digests.add(digest)
                        written_bytes += raw_len
                        written_stored += size
        manifest = {
            "format_version": fmt.FORMAT_VERSION,
            "run": spec.run,
            "step": spec.step,
            "kind": spec.kind,
            "save_id": spec.save_id,
            "base_step": spec.base_step,
            "created_at": spec.created_at,
            "committed_at": time.time(),
            "world_size": spec.world_size,
            "codec": spec.codec,
            "metadata": spec.metadata,
            "address": ADDRESS,
            "dcp": metadata_to_json(metadata, storage),
            "chunks": dict(sorted(chunk_sizes.items())),
            **({"bases": dict(sorted(bases.items()))} if bases else {}),
            FAST_CHECKSUMS: dict(sorted(checksums.items())),
            "stats": {
                "logical_bytes": logical,
                "unique_bytes": sum(chunk_sizes.values()),
                "stored_bytes": sum(stored.values()),
                "chunks": len(chunk_sizes),
                "chunks_written": len(written_digests),
                "bytes_written": written_bytes,
                "stored_written": written_stored,
                "delta_chunks": len(bases),
            },
            "rank_records": "by_save_id",
        }
        key = fmt.manifest_key(spec.run, spec.step)
        blob = seal(manifest)
        parsed = Manifest.parse(
            blob, f"manifest {self.chunks.store.url}/{key} (before commit)"
        )  # never commit what a reader refuses
        if not self.chunks.store.put_if_absent(key, blob):
            raise CheckpointExistsError(
                f"step {spec.step} of run {spec.run!r} was committed by another writer while this save ran "
                f"({self.chunks.store.url}/{key}); this save's data is unreferenced and GC will reclaim it"
            )
        self.manifest = parsed


class CheckpointReader(StorageReader):
    """Reads one committed checkpoint in two passes, so a bad checkpoint touches nothing.

    Pass one verifies every chunk this rank needs, against the fast checksum its manifest
    records (``ckptflow.checksum``; the sha256 address for manifests without one); ``agree``
    then combines every rank's verdict (a collective: all ranks call ``read_data``). Only
    if all ranks verified cleanly does pass two read local raw chunks straight into the
    destination tensors, checking them there again. So restore needs no second copy of
    the model in host memory, and a rejected checkpoint leaves the caller's tensors as they were.
    """

    def __init__(
        self,
        chunks: ChunkStore,
        manifest: Manifest,
        pool: ThreadPoolExecutor,
        progress: Progress | None = None,
        agree: Callable[[Failure | None], Failure | None] | None = None,
    ):
        super().__init__()
        self.chunks = chunks.scoped(manifest.chunks, manifest.fast_checksums, manifest.address)  # reads checked fast
        self.manifest, self.pool, self.progress = manifest, pool, progress
        self.agree = agree or (lambda failure: failure)
        self.metadata, self.storage = metadata_from_index(manifest.dcp)

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

    def _verify_all(self, indexes: list[MetadataIndex]) -> tuple[dict[str, CheckedChunk], Failure | None]:
        """Every chunk checked; a damaged chunk anywhere outweighs a read that failed
        elsewhere (the checkpoint is bad whatever else happened)."""
        needed: dict[str, int] = {}
        for index in indexes:
            needed.update(self.storage[index].chunks)  # lengths add up: Manifest.parse checked
        futures = {digest: self.pool.submit(self._check, digest, size) for digest, size in needed.items()}
        checked: dict[str, CheckedChunk] = {}
        errors: list[BaseException] = []
        for digest, future in futures.items():
            try:
                checked[digest] = future.result()
            except Exception as e:
                errors.append(e)
        if not errors:
            return checked, None
        damage = [e for e in errors if isinstance(e, DAMAGE)]
        return {}, failure_of(damage[0] if damage else errors[0])

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        by_storage: dict[MetadataIndex, list] = defaultdict(list)
        for req in plan.items:
            by_storage[req.storage_index].append(req)
        try:
            checked, failure = self._verify_all(list(by_storage))
        except Exception as e:  # never skip ``agree``: the other ranks wait in it
            checked, failure = {}, failure_of(e)
        failure = self.agree(failure)
        if failure:
            raise ReadAborted(failure)
        loading = []
        try:
            for index, reqs in by_storage.items():
                item = self.storage[index]
                targets = [planner.resolve_tensor(req).detach() for req in reqs]
                if len(reqs) == 1 and _whole_item_target(item, reqs[0], targets[0]):
                    buffer = targets[0]  # chunks land in place: no staging tensor, no copy
                else:  # resharding, another device or dtype: read the item, then copy slices
                    to_gpu = any(t.device.type == "cuda" for t in targets)
                    buffer = torch.empty(item.shape, dtype=dtype_from_name(item.dtype), pin_memory=to_gpu)
                raw, offset, futures = _writable_bytes(buffer), 0, []
                for digest, size in item.chunks:
                    futures.append(
                        self.pool.submit(self.chunks.read_checked, checked[digest], raw[offset : offset + size])
                    )
                    offset += size
                loading.append((reqs, targets, buffer, futures))
            for reqs, targets, buffer, futures in loading:
                for f in futures:
                    f.result()
                for req, target in zip(reqs, targets):
                    if target is not buffer:
                        src = buffer
                        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                            src = src.narrow(dim, start, length)
                        target.copy_(src, non_blocking=buffer.is_pinned())
                if buffer.is_pinned():
                    torch.cuda.current_stream().synchronize()  # copies done before commit and reuse
                for req, target in zip(reqs, targets):
                    planner.commit_tensor(req, target)
        finally:  # on failure: no read may write into the caller's tensors after this returns
            pending = [f for *_, futures in loading for f in futures]
            for f in pending:
                f.cancel()
            wait(pending)
        return _done(None)


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor as writable bytes (no copy)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _whole_item_target(item: StorageItem, req: Any, target: torch.Tensor) -> bool:
    """Whether ``req`` reads the whole stored item into a tensor laid out exactly like it."""
    return (
        type(target) is torch.Tensor
        and target.device.type == "cpu"
        and target.dtype == dtype_from_name(item.dtype)
        and tuple(target.shape) == item.shape
        and target.is_contiguous()
        and tuple(req.lengths) == item.shape
        and not any(req.storage_offsets)
    )
