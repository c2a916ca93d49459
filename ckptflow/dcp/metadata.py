"""DCP ``Metadata`` <-> JSON, so a checkpoint's index is never pickled.

Only the fields ckptflow's reader needs survive the round trip: per-tensor dtype,
global size and shard layout, the storage index (our chunk lists), and planner data.
Non-tensor values DCP would pickle are refused, or kept as JSON (``json_values``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from ckptflow.errors import ManifestError, UnsupportedStateError
from ckptflow.format.dcp_index import DcpIndex, StorageItem
from ckptflow.format.state_tree import flatten

JSON_VALUE = "json"  # a writer's storage data for a non-tensor value kept as JSON (CheckpointWriter json_values)


def plan_bytes(plan: SavePlan) -> int:
    """The tensor bytes one rank's plan writes, before dedup."""
    return sum(
        math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
        for item in plan.items
        if item.tensor_data is not None and item.tensor_data.properties.dtype is not None
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"manifest names unknown dtype {name!r}; was it written by a newer torch?")
    return dtype


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def metadata_to_json(md: Metadata, storage: dict[MetadataIndex, dict]) -> dict:
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata) and JSON_VALUE in storage.get(MetadataIndex(fqn), {}):
            values[fqn] = storage[MetadataIndex(fqn)][JSON_VALUE]
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise ManifestError(f"state entry {fqn!r} is not a tensor; ckptflow stores only tensors through DCP")
        tensors[fqn] = {
            "dtype": dtype_name(item.properties.dtype),
            "size": list(item.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in item.chunks],
        }
    items = [
        {
            "fqn": idx.fqn,
            "offset": None if idx.offset is None else list(idx.offset),
            "index": idx.index,
            **data,
        }
        for idx, data in sorted(storage.items(), key=lambda kv: (kv[0].fqn, list(kv[0].offset or ())))
        if JSON_VALUE not in data
    ]
    doc = {"version": md.version, "tensors": tensors, "items": items, "planner_data": _plain(md.planner_data)}
    return {**doc, "values": values} if values else doc


def metadata_from_index(index: DcpIndex) -> tuple[Metadata, dict[MetadataIndex, StorageItem]]:
    """DCP ``Metadata`` for a parsed manifest's index (already validated by ``Manifest.parse``)."""
    sdm: dict[str, Any] = {
        fqn: TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype_from_name(t.dtype)),
            size=torch.Size(t.size),
            chunks=[ChunkStorageMetadata(torch.Size(s.offsets), torch.Size(s.sizes)) for s in t.shards],
        )
        for fqn, t in index.tensors.items()
    }
    sdm.update({fqn: BytesStorageMetadata() for fqn in index.values})
    storage = {
        MetadataIndex(item.fqn, None if item.offset is None else torch.Size(item.offset), item.index): item
        for item in index.items
    }
    planner = index.planner_data
    if isinstance(planner, dict):
        planner = {k: tuple(v) if isinstance(v, list) else v for k, v in planner.items()}
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage, version=index.version)
    return md, storage


def byte_io_refusal(fqn: str, run: str, step: int) -> str:
    """Why a non-tensor value handed to ``dcp.save`` with this writer is refused, and the
    ways out (DCP would ``torch.save`` it into a BYTE_IO item: a pickle)."""
    return (
        f"{fqn!r} is not a tensor: as a dcp.save StorageWriter, ckptflow stores tensors only, since DCP would pickle "
        f"this value into a BYTE_IO item and ckptflow never pickles; nothing was committed for run {run!r} step "
        f"{step}. Either save the whole state with ckptflow.Checkpointer(root, run).save(step, state) (tensors as "
        "chunks, every other value, numbers, strings, lists, dicts, as JSON, restored as it was by "
        "Checkpointer.restore), or opt in to JSON values for this writer (CheckpointWriter(..., json_values=True): "
        "numbers, strings, lists, tuples, dicts, bytes are stored as JSON in the manifest instead of DCP's pickle), "
        "or hand dcp.save tensors only (torch.tensor(value))"
    )


def json_value(planner: SavePlanner, fqn: str, index: MetadataIndex) -> Any:
    """The JSON form of the value DCP would pickle at ``fqn``, taken from the planner before
    DCP's ``torch.save`` (``DefaultSavePlanner.lookup_object``): what ``json_values=True``
    stores in the manifest. Anything JSON cannot hold is refused, naming it."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        raise UnsupportedStateError(
            f"{fqn!r} is not a tensor and the planner {type(planner).__name__} does not hand out the value "
            "(lookup_object), so it cannot be stored as JSON; use DCP's DefaultSavePlanner or the Checkpointer"
        )
    try:
        skeleton, tensors = flatten(lookup(index))
    except UnsupportedStateError as e:
        raise UnsupportedStateError(f"{fqn!r} cannot be stored as JSON (json_values=True): {e}") from None
    if tensors:
        raise UnsupportedStateError(f"{fqn!r} holds tensors inside a value DCP did not flatten; save them as tensors")
    return skeleton
