"""Each rank's write results (``write_result``), and the manifest a save commits from all of
them (``manifest_record``, ``CheckpointWriter.finish``)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from ckptflow.dcp import put_batches
from ckptflow.dcp.metadata import JSON_VALUE, dtype_name, metadata_to_json
from ckptflow.dcp.put_batches import Slot
from ckptflow.dcp.save_spec import SaveSpec
from ckptflow.format import layout as fmt
from ckptflow.format.checksum import ADDRESS
from ckptflow.format.checksum import FIELD as FAST_CHECKSUMS
from ckptflow.format.checksum import STORED_FIELD as STORED_CHECKSUMS


def write_result(
    item: Any, tensor: torch.Tensor | None, value: Any, futures: list[Slot], packed_at: int | None
) -> WriteResult:
    """One write item's result, once its chunk writes (``futures``) are done: its chunks, and
    what ``manifest_record`` reads of each write (``_writes``). ``value``: the tensor's size in
    bytes, or a JSON value (``tensor`` None); ``packed_at``: where in its pack a packed tensor is."""
    if tensor is None:  # a JSON value (json_values=True): no chunks, it travels in the manifest
        return WriteResult(index=item.index, size_in_bytes=0, storage_data={JSON_VALUE: value})
    writes = [put_batches.result(slot) for slot in futures]
    data = {
        "dtype": dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "chunks": [
            [w.digest, w.raw_bytes] if packed_at is None else [w.digest, value, packed_at] for w, _unread in writes
        ],
        "_writes": [
            [w.stored_bytes, w.written, w.base, w.base_bytes, w.checksum, w.stored_checksum, unread, w.raw_bytes]
            for w, unread in writes
        ],
    }
    return WriteResult(index=item.index, size_in_bytes=value, storage_data=data)


def manifest_record(spec: SaveSpec, metadata: Metadata, results: list[list[WriteResult]]) -> dict:
    """The manifest's JSON: each chunk listed once with its raw size, checksums and base
    (a chunk two ranks wrote is one entry), the DCP index, and the save's statistics."""
    storage: dict[MetadataIndex, dict] = {}
    chunk_sizes: dict[str, int] = {}
    stored: dict[str, int] = {}
    bases: dict[str, str] = {}
    checksums: dict[str, str] = {}
    stored_checksums: dict[str, str] = {}  # where a rank stored the object (now or by the previous save)
    written_digests: set[str] = set()
    written_bytes = written_stored = logical = unread_bytes = 0
    for rank_results in results:
        for wr in rank_results:
            data = dict(wr.storage_data)
            if JSON_VALUE in data:
                storage[wr.index] = data
                continue
            writes = data.pop("_writes")
            storage[wr.index] = data
            logical += wr.size_in_bytes
            for ref, (size, was_written, base, base_bytes, checksum, as_stored, unread, raw_len) in zip(
                data["chunks"], writes
            ):
                digest = ref[0]  # a pack's member names its slice: ref[1] bytes at ref[2]
                unread_bytes += ref[1] if unread else 0
                chunk_sizes[digest] = raw_len
                checksums[digest] = checksum
                if as_stored:
                    stored_checksums[digest] = as_stored
                stored[digest] = size
                if base is not None:  # restore, verify and GC must see the base: list it
                    bases[digest] = base
                    chunk_sizes[base] = raw_len
                    stored.setdefault(base, base_bytes)
                if was_written and digest not in written_digests:
                    written_digests.add(digest)
                    written_bytes += raw_len
                    written_stored += size
    packed = any(len(ref) == 3 for data in storage.values() for ref in data.get("chunks", ()))
    return {
        "format_version": fmt.PACKED_FORMAT if packed else fmt.FORMAT_VERSION,
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
        # a chunk two ranks found stored two ways (one as a delta) keeps its entry: readers drop it
        **({STORED_CHECKSUMS: dict(sorted(stored_checksums.items()))} if stored_checksums else {}),
        **({"tied": spec.tied} if spec.tied else {}),
        **({"lossy": spec.lossy} if spec.lossy is not None else {}),
        "stats": {
            "logical_bytes": logical,
            "unique_bytes": sum(chunk_sizes.values()),
            "stored_bytes": sum(stored.values()),
            "chunks": len(chunk_sizes),
            "chunks_written": len(written_digests),
            "bytes_written": written_bytes,
            "bytes_unread": unread_bytes,
            "stored_written": written_stored,
            "delta_chunks": len(bases),
        },
        "rank_records": "by_save_id",
        **({"save_cost": spec.clock.cost().to_json()} if spec.clock is not None else {}),
        **({"save_decision": spec.decision} if spec.decision is not None else {}),
    }
