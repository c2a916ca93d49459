"""The DCP index of a checkpoint, typed, and the rule that it describes whole tensors.

Every tensor's shards must tile it exactly (no gap, no overlap, nothing out of
bounds), every shard must have one storage item whose chunk lengths add up to its
bytes, and every chunk an item names must be in the manifest's chunk list with the
same length, except a pack: a small item's bytes may be one slice of a chunk shared with
other small items (``ckptflow.dcp.packs``), named with its offset, which must lie inside
the pack; a pack is no larger than the slices the manifest names in it nor than
``MAX_PACK_BYTES``, so a reader allocating a pack to restore one member of it allocates a
bounded amount whatever the manifest says. ``Manifest.parse`` applies
this, so verify, restore and export cannot disagree about whether a checkpoint's tensors
are whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptflow.format import layout as fmt
from ckptflow.format.sealed import Fields
from ckptflow.format.state_tree import json_value_problem
from ckptflow.format.tiling import tiling_problem


# ---- the DCP index ---------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """One tensor of the saved state: dtype, global size, and how its shards tile it."""

    fqn: str
    dtype: str
    size: tuple[int, ...]
    shards: tuple[Shard, ...]

    @property
    def nbytes(self) -> int:
        return fmt.DTYPE_SIZES[self.dtype] * math.prod(self.size)


@dataclass(frozen=True, kw_only=True)
class StorageItem:
    """One written shard: where it sits in its tensor and the chunks holding its bytes."""

    fqn: str
    offset: tuple[int, ...] | None
    index: int | None
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[tuple[str, int], ...]  # (digest, raw length), in byte order
    packed_at: int | None = None  # a packed item: its one chunk is a pack holding its bytes from here

    @property
    def nbytes(self) -> int:
        return fmt.DTYPE_SIZES[self.dtype] * math.prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class DcpIndex:
    version: Any
    tensors: Mapping[str, TensorEntry]
    items: tuple[StorageItem, ...]
    planner_data: Any
    values: Mapping[str, Any] = field(default_factory=dict)  # non-tensor values a plain dcp.save stored as JSON

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "tensors": {
                fqn: {
                    "dtype": t.dtype,
                    "size": list(t.size),
                    "chunks": [{"offsets": list(s.offsets), "sizes": list(s.sizes)} for s in t.shards],
                }
                for fqn, t in self.tensors.items()
            },
            "items": [
                {
                    "fqn": i.fqn,
                    "offset": None if i.offset is None else list(i.offset),
                    "index": i.index,
                    "dtype": i.dtype,
                    "shape": list(i.shape),
                    "chunks": [[d, n] if i.packed_at is None else [d, n, i.packed_at] for d, n in i.chunks],
                }
                for i in self.items
            ],
            "planner_data": self.planner_data,
            **({"values": dict(self.values)} if self.values else {}),
        }


def _check_cover(check: Fields, t: TensorEntry) -> None:
    problem = tiling_problem(t.size, [(s.offsets, s.sizes) for s in t.shards])
    if problem:
        raise check.bad(f"has shards of tensor {t.fqn!r} (shape {list(t.size)}) that do not tile it: {problem}")


def parse_dcp_index(check: Fields, doc: dict, chunks: Mapping[str, int]) -> DcpIndex:
    tensors_doc, items_doc = doc.get("tensors"), doc.get("items")
    if not isinstance(tensors_doc, dict) or not isinstance(items_doc, list):
        raise check.bad("has a DCP index without 'tensors' and 'items'")
    tensors: dict[str, TensorEntry] = {}
    for fqn, t in tensors_doc.items():
        if not isinstance(t, dict) or not isinstance(t.get("chunks"), list):
            raise check.bad(f"has a DCP index entry {fqn!r} without dtype and chunks")
        shards = []
        for c in t["chunks"]:
            if not isinstance(c, dict):
                raise check.bad(f"has a shard of {fqn!r} that is not an object")
            shards.append(
                Shard(check.ints(c.get("offsets"), "offsets of", fqn), check.ints(c.get("sizes"), "sizes of", fqn))
            )
        entry = TensorEntry(
            fqn=fqn,
            dtype=check.dtype(t.get("dtype"), "tensor", fqn),
            size=check.ints(t.get("size"), "size of", fqn),
            shards=tuple(shards),
        )
        _check_cover(check, entry)
        tensors[fqn] = entry
    items: list[StorageItem] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    per_tensor: dict[str, int] = {}
    in_packs: dict[str, int] = {}  # per pack, the bytes of the slices named in it
    for it in items_doc:
        if not isinstance(it, dict) or not isinstance(it.get("chunks"), list) or not isinstance(it.get("fqn"), str):
            raise check.bad("has a DCP storage item without fqn or chunks")
        fqn = it["fqn"]
        offset = None if it.get("offset") is None else check.ints(it["offset"], "offset of item", fqn)
        index = it.get("index")
        if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
            raise check.bad(f"has item {fqn!r} with index {index!r}")
        refs = []
        stored = 0
        packed_at = _packed_at(check, fqn, it["chunks"], chunks)
        for ref in it["chunks"]:
            if not (
                type(ref) is list
                and len(ref) == (2 if packed_at is None else 3)
                and type(ref[0]) is str
                and type(ref[1]) is int
                and (chunks.get(ref[0]) == ref[1] or packed_at is not None)
            ):
                raise check.bad(f"has item {fqn!r} referencing a chunk missing from its chunk list")
            refs.append((ref[0], ref[1]))
            stored += ref[1]
        if packed_at is not None:
            in_packs[refs[0][0]] = in_packs.get(refs[0][0], 0) + refs[0][1]
        item = StorageItem(
            fqn=fqn,
            offset=offset,
            index=index,
            dtype=check.dtype(it.get("dtype"), "item", fqn),
            shape=check.ints(it.get("shape"), "shape of item", fqn),
            chunks=tuple(refs),
            packed_at=packed_at,
        )
        tensor = tensors.get(fqn)
        if tensor is None:
            raise check.bad(f"has a storage item for {fqn!r}, which is not in its tensor index")
        if item.dtype != tensor.dtype:
            raise check.bad(f"stores {fqn!r} as {item.dtype} but indexes it as {tensor.dtype}")
        shard = Shard(offset or tuple(0 for _ in tensor.size), item.shape)
        if shard not in tensor.shards:
            raise check.bad(
                f"has an item of {fqn!r} at {list(shard.offsets)} shaped {list(item.shape)} that is no shard of it"
            )
        if (fqn, shard.offsets) in seen:
            raise check.bad(f"stores the shard of {fqn!r} at {list(shard.offsets)} twice")
        seen.add((fqn, shard.offsets))
        per_tensor[fqn] = per_tensor.get(fqn, 0) + 1
        if stored != item.nbytes:
            raise check.bad(
                f"has chunks of {fqn!r} adding up to {stored} bytes, but its shape and dtype need {item.nbytes}"
            )
        items.append(item)
    for digest, named in in_packs.items():
        if chunks[digest] > named:
            raise check.bad(f"has a pack {digest[:16]}… of {chunks[digest]} bytes of which its items name only {named}")
    for fqn, tensor in tensors.items():
        stored = per_tensor.get(fqn, 0)
        if stored != len(tensor.shards):
            raise check.bad(f"stores {stored} of the {len(tensor.shards)} shards of tensor {fqn!r}")
    values = doc.get("values", {})
    if not isinstance(values, dict):
        raise check.bad("has DCP values that are not an object")
    for fqn, value in values.items():
        if fqn in tensors:
            raise check.bad(f"has {fqn!r} both as a tensor and as a JSON value")
        if json_value_problem(value):
            raise check.bad(f"has a DCP value {fqn!r} that {json_value_problem(value)}")
    return DcpIndex(
        version=doc.get("version"),
        tensors=tensors,
        items=tuple(items),
        planner_data=doc.get("planner_data"),
        values=values,
    )


def _packed_at(check: Fields, fqn: str, refs: list, chunks: Mapping[str, int]) -> int | None:
    """Where item ``fqn``'s bytes start in its pack, if ``refs`` names one: a single
    ``[digest, length, offset]``, the slice inside the pack's length (else None)."""
    if not (len(refs) == 1 and type(refs[0]) is list and len(refs[0]) == 3):
        return None
    digest, length, offset = refs[0]
    size = chunks.get(digest) if type(digest) is str else None
    if not (type(length) is int and type(offset) is int and size is not None and length > 0 and offset >= 0):
        raise check.bad(f"has item {fqn!r} referencing a slice of a pack missing from its chunk list")
    if size > fmt.MAX_PACK_BYTES:
        raise check.bad(
            f"has item {fqn!r} in a pack {digest[:16]}… of {size} bytes; no pack is larger than {fmt.MAX_PACK_BYTES}"
        )
    if offset + length > size:
        raise check.bad(
            f"has item {fqn!r} at bytes {offset}-{offset + length} of a pack {digest[:16]}… of {size} bytes"
        )
    return offset
