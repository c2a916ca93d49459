"""The commit record and the rank records, typed: parsed once, validated once.

Everything a restore relies on is checked here, when the sealed JSON is parsed: the
checksum, the field types, that every tensor's shards cover it exactly (no gap, no
overlap, nothing out of bounds), that every shard has one storage item whose chunk
lengths add up to its bytes, and that every chunk an item names is in the chunk list
with the same length. ``verify``, the blocking integrity check, ``export`` and
``restore`` all read through ``Manifest.parse``, so they apply one set of rules and
cannot disagree about whether a checkpoint is whole.

Bounds keep a hostile or broken record from making a reader allocate without limit:
the record's size is capped before it is read (``MAX_RECORD_BYTES``), its nesting
depth after it is parsed, and ``world_size`` against what one checkpoint can have.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptflow import format as fmt
from ckptflow.errors import ManifestError

MAX_RECORD_BYTES = 1 << 30  # a manifest listing 10 TB in 8 MiB chunks is ~150 MiB
MAX_DEPTH = 128  # JSON nesting; a real state dict is a handful of levels deep
MAX_WORLD_SIZE = 1 << 20
KINDS = ("full", "incremental")


# ---- sealing -------------------------------------------------------------------------
def canonical(obj: Any) -> bytes:
    """The bytes a record's checksum covers: compact JSON in the record's own key order
    (the order it was written in, which parsing keeps)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()


def seal(record: Mapping[str, Any]) -> bytes:
    """Serialize ``record`` followed by its own checksum."""
    body = {k: v for k, v in record.items() if k != "checksum"}
    return canonical({**body, "checksum": hashlib.sha256(canonical(body)).hexdigest()})


def _depth_ok(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return True


def unseal(blob: bytes, where: str) -> dict:
    """Parse and verify a sealed record; ``ManifestError`` naming ``where`` otherwise."""
    if len(blob) > MAX_RECORD_BYTES:
        raise ManifestError(f"{where} is {len(blob)} bytes, more than any ckptflow record ({MAX_RECORD_BYTES})")
    try:
        record = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{where} is not valid JSON ({e}); the record is corrupt") from None
    except RecursionError:
        raise ManifestError(f"{where} is nested deeper than any ckptflow record; it is corrupt or hostile") from None
    if not isinstance(record, dict) or "checksum" not in record:
        raise ManifestError(f"{where} has no checksum field; it is not a ckptflow record")
    if not _depth_ok(record, MAX_DEPTH):
        raise ManifestError(f"{where} is nested deeper than {MAX_DEPTH} levels; it is corrupt or hostile")
    claimed = record.pop("checksum")
    body = canonical(record)
    actual = hashlib.sha256(body).hexdigest()
    if claimed != actual:
        # records written before key order was kept were sealed over sorted keys
        legacy = json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
        if claimed != hashlib.sha256(legacy).hexdigest():
            raise ManifestError(f"{where} fails its checksum (stored {str(claimed)[:12]}…, computed {actual[:12]}…)")
    if record.get("format_version") != fmt.FORMAT_VERSION:
        raise ManifestError(
            f"{where} has format_version {record.get('format_version')!r}; this ckptflow reads "
            f"{fmt.FORMAT_VERSION}: upgrade ckptflow to read it"
        )
    return record


# ---- field checks --------------------------------------------------------------------
class _Checker:
    """Typed field access that raises one ``ManifestError`` naming the record."""

    def __init__(self, where: str):
        self.where = where

    def bad(self, what: str) -> ManifestError:
        return ManifestError(f"{self.where} {what}; it is malformed")

    def _get(self, doc: Mapping, name: str, optional: bool) -> Any:
        if name not in doc and not optional:
            raise self.bad(f"lacks field {name!r}")
        return doc.get(name)

    def int(self, doc: Mapping, name: str, *, minimum: int = 0, optional: bool = False) -> Any:
        value = self._get(doc, name, optional)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.bad(f"has field {name!r} = {value!r}, not an integer >= {minimum}")
        return value

    def num(self, doc: Mapping, name: str) -> float:
        value = self._get(doc, name, False)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.bad(f"has field {name!r} = {value!r}, not a finite number")
        return float(value)

    def str(self, doc: Mapping, name: str, *, optional: bool = False) -> Any:
        value = self._get(doc, name, optional)
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise self.bad(f"has field {name!r} of type {type(value).__name__}, not a string")
        return value

    def obj(self, doc: Mapping, name: str) -> dict:
        value = self._get(doc, name, False)
        if not isinstance(value, dict):
            raise self.bad(f"has field {name!r} of type {type(value).__name__}, not an object")
        return value

    def ints(self, value: Any, what: str) -> tuple[int, ...]:
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            raise self.bad(f"has {what} {value!r}, not a list of non-negative integers")
        return tuple(value)

    def dtype(self, value: Any, what: str) -> str:
        if not isinstance(value, str) or value not in fmt.DTYPE_SIZES:
            raise ManifestError(
                f"{self.where}: {what} names unknown dtype {value!r}; was it written by a newer ckptflow or torch?"
            )
        return value


# ---- the DCP index ---------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the saved state: dtype, global size, and how its shards tile it."""

    fqn: str
    dtype: str
    size: tuple[int, ...]
    shards: tuple[Shard, ...]

    @property
    def nbytes(self) -> int:
        return fmt.DTYPE_SIZES[self.dtype] * math.prod(self.size)


@dataclass(frozen=True)
class StorageItem:
    """One written shard: where it sits in its tensor and the chunks holding its bytes."""

    fqn: str
    offset: tuple[int, ...] | None
    index: int | None
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[tuple[str, int], ...]  # (digest, raw length), in byte order

    @property
    def nbytes(self) -> int:
        return fmt.DTYPE_SIZES[self.dtype] * math.prod(self.shape)


@dataclass(frozen=True)
class DcpIndex:
    version: Any
    tensors: Mapping[str, TensorEntry]
    items: tuple[StorageItem, ...]
    planner_data: Any

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "tensors": {
                fqn: {"dtype": t.dtype, "size": list(t.size),
                      "chunks": [{"offsets": list(s.offsets), "sizes": list(s.sizes)} for s in t.shards]}
                for fqn, t in self.tensors.items()
            },
            "items": [
                {"fqn": i.fqn, "offset": None if i.offset is None else list(i.offset), "index": i.index,
                 "dtype": i.dtype, "shape": list(i.shape), "chunks": [[d, n] for d, n in i.chunks]}
                for i in self.items
            ],
            "planner_data": self.planner_data,
        }


def _overlap(a: Shard, b: Shard) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def _check_cover(check: _Checker, t: TensorEntry) -> None:
    """Shards inside the tensor, pairwise disjoint, volumes adding up to the tensor's:
    together that is an exact tiling."""
    volume = 0
    for s in t.shards:
        if len(s.offsets) != len(t.size) or len(s.sizes) != len(t.size):
            raise check.bad(f"has a shard of tensor {t.fqn!r} with {len(s.offsets)} dimensions, not {len(t.size)}")
        if any(o + n > d for o, n, d in zip(s.offsets, s.sizes, t.size)):
            raise check.bad(f"has a shard of tensor {t.fqn!r} at {list(s.offsets)} that leaves its size {list(t.size)}")
        volume += math.prod(s.sizes)
    if volume != math.prod(t.size):
        raise check.bad(f"has shards of tensor {t.fqn!r} covering {volume} of its {math.prod(t.size)} elements")
    live = [s for s in t.shards if math.prod(s.sizes)]
    if len(t.size) and len(live) > 1:  # sweep along dim 0: compare only shards whose rows meet
        live.sort(key=lambda s: s.offsets[0])
        active: list[Shard] = []
        for s in live:
            active = [a for a in active if a.offsets[0] + a.sizes[0] > s.offsets[0]]
            if any(_overlap(a, s) for a in active):
                raise check.bad(f"has overlapping shards of tensor {t.fqn!r} at {list(s.offsets)}")
            active.append(s)
    elif len(live) > 1:
        raise check.bad(f"has {len(live)} shards of the scalar {t.fqn!r}")


def _parse_dcp(check: _Checker, doc: dict, chunks: Mapping[str, int]) -> DcpIndex:
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
            shards.append(Shard(check.ints(c.get("offsets"), f"offsets of {fqn!r}"), check.ints(c.get("sizes"), f"sizes of {fqn!r}")))
        entry = TensorEntry(fqn, check.dtype(t.get("dtype"), f"tensor {fqn!r}"), check.ints(t.get("size"), f"size of {fqn!r}"), tuple(shards))
        _check_cover(check, entry)
        tensors[fqn] = entry
    items: list[StorageItem] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    per_tensor: dict[str, int] = {}
    for it in items_doc:
        if not isinstance(it, dict) or not isinstance(it.get("chunks"), list) or not isinstance(it.get("fqn"), str):
            raise check.bad("has a DCP storage item without fqn or chunks")
        fqn = it["fqn"]
        offset = None if it.get("offset") is None else check.ints(it["offset"], f"offset of item {fqn!r}")
        index = it.get("index")
        if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
            raise check.bad(f"has item {fqn!r} with index {index!r}")
        refs = []
        for ref in it["chunks"]:
            if not (isinstance(ref, list) and len(ref) == 2 and isinstance(ref[0], str) and chunks.get(ref[0]) == ref[1]
                    and not isinstance(ref[1], bool)):
                raise check.bad(f"has item {fqn!r} referencing a chunk missing from its chunk list")
            refs.append((ref[0], ref[1]))
        item = StorageItem(fqn, offset, index, check.dtype(it.get("dtype"), f"item {fqn!r}"),
                           check.ints(it.get("shape"), f"shape of item {fqn!r}"), tuple(refs))
        tensor = tensors.get(fqn)
        if tensor is None:
            raise check.bad(f"has a storage item for {fqn!r}, which is not in its tensor index")
        if item.dtype != tensor.dtype:
            raise check.bad(f"stores {fqn!r} as {item.dtype} but indexes it as {tensor.dtype}")
        shard = Shard(offset or tuple(0 for _ in tensor.size), item.shape)
        if shard not in tensor.shards:
            raise check.bad(f"has an item of {fqn!r} at {list(shard.offsets)} shaped {list(item.shape)} that is no shard of it")
        if (fqn, shard.offsets) in seen:
            raise check.bad(f"stores the shard of {fqn!r} at {list(shard.offsets)} twice")
        seen.add((fqn, shard.offsets))
        per_tensor[fqn] = per_tensor.get(fqn, 0) + 1
        if sum(n for _, n in refs) != item.nbytes:
            raise check.bad(
                f"has chunks of {fqn!r} adding up to {sum(n for _, n in refs)} bytes, but its shape and dtype "
                f"need {item.nbytes}"
            )
        items.append(item)
    for fqn, tensor in tensors.items():
        stored = per_tensor.get(fqn, 0)
        if stored != len(tensor.shards):
            raise check.bad(f"stores {stored} of the {len(tensor.shards)} shards of tensor {fqn!r}")
    return DcpIndex(doc.get("version"), tensors, tuple(items), doc.get("planner_data"))


# ---- the records ----------------------------------------------------------------------
@dataclass(frozen=True)
class ManifestStats:
    logical_bytes: int
    unique_bytes: int
    stored_bytes: int
    chunks: int
    chunks_written: int
    bytes_written: int


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's commit record. ``digest`` (sha256 of the sealed file) names exactly
    what was committed: a step saved twice has two digests."""

    run: str
    step: int
    kind: str
    save_id: str
    base_step: int | None
    created_at: float
    committed_at: float
    world_size: int
    codec: str
    metadata: Mapping[str, Any]
    dcp: DcpIndex
    chunks: Mapping[str, int]  # digest -> raw length: every chunk a restore reads
    stats: ManifestStats
    digest: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)  # fields a newer writer added

    @property
    def ref(self) -> tuple[str, int]:
        return (self.run, self.step)

    @property
    def logical_bytes(self) -> int:
        return self.stats.logical_bytes

    def rank_keys(self) -> list[str]:
        return [fmt.rank_key(self.run, self.step, r) for r in range(self.world_size)]

    def items(self) -> Iterator[StorageItem]:
        return iter(self.dcp.items)

    def to_json(self) -> dict:
        return {
            "format_version": fmt.FORMAT_VERSION, "run": self.run, "step": self.step, "kind": self.kind,
            "save_id": self.save_id, "base_step": self.base_step, "created_at": self.created_at,
            "committed_at": self.committed_at, "world_size": self.world_size, "codec": self.codec,
            "metadata": dict(self.metadata), "dcp": self.dcp.to_json(), "chunks": dict(self.chunks),
            "stats": dict(self.stats.__dict__), **self.extra,
        }

    def seal(self) -> bytes:
        return seal(self.to_json())

    @classmethod
    def from_json(cls, doc: dict, where: str, digest: str = "") -> "Manifest":
        check = _Checker(where)
        run = check.str(doc, "run")
        step = check.int(doc, "step")
        kind = check.str(doc, "kind")
        if kind not in KINDS:
            raise check.bad(f"has kind {kind!r}, not one of {KINDS}")
        world_size = check.int(doc, "world_size", minimum=1)
        if world_size > MAX_WORLD_SIZE:
            raise check.bad(f"has world_size {world_size}, more than {MAX_WORLD_SIZE}")
        chunks = check.obj(doc, "chunks")
        if not all(isinstance(d, str) and len(d) == 64 for d in chunks) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in chunks.values()
        ):
            raise check.bad("has a chunk entry that is not a sha256 digest with a non-negative length")
        stats_doc = check.obj(doc, "stats")
        stats = ManifestStats(**{k: check.int(stats_doc, k) if k in _REQUIRED_STATS else check.int(stats_doc, k, optional=True) or 0
                                 for k in ManifestStats.__dataclass_fields__})
        metadata = doc.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise check.bad("has metadata that is not an object")
        dcp = _parse_dcp(check, check.obj(doc, "dcp"), chunks)
        known = {*_MANIFEST_FIELDS, "format_version"}
        return cls(
            run=run, step=step, kind=kind, save_id=check.str(doc, "save_id", optional=True) or "",
            base_step=check.int(doc, "base_step", optional=True), created_at=check.num(doc, "created_at"),
            committed_at=check.num(doc, "committed_at") if "committed_at" in doc else check.num(doc, "created_at"),
            world_size=world_size, codec=check.str(doc, "codec", optional=True) or "raw", metadata=metadata, dcp=dcp,
            chunks=chunks, stats=stats, digest=digest, extra={k: v for k, v in doc.items() if k not in known},
        )

    @classmethod
    def parse(cls, blob: bytes, where: str, *, run: str | None = None, step: int | None = None) -> "Manifest":
        """Verify and parse a sealed manifest; with ``run``/``step``, also that it sits
        where it claims to (a manifest copied to another step is not that step)."""
        manifest = cls.from_json(unseal(blob, where), where, fmt.digest_of(blob))
        if (run is not None and manifest.run != run) or (step is not None and manifest.step != step):
            raise ManifestError(
                f"{where} describes run {manifest.run!r} step {manifest.step}, not run {run!r} step {step}: "
                "it was copied to the wrong place"
            )
        return manifest


_REQUIRED_STATS = ("logical_bytes", "stored_bytes", "chunks", "bytes_written")
_MANIFEST_FIELDS = tuple(f for f in Manifest.__dataclass_fields__ if f not in ("digest", "extra"))


@dataclass(frozen=True)
class RankRecord:
    """What one rank wrote besides its chunks: its JSON state skeleton and RNG states."""

    run: str
    step: int
    rank: int
    world_size: int
    save_id: str
    state: Any
    rng: Mapping[str, Any] | None
    items: int

    def to_json(self) -> dict:
        return {
            "format_version": fmt.FORMAT_VERSION, "run": self.run, "step": self.step, "rank": self.rank,
            "world_size": self.world_size, "save_id": self.save_id, "state": self.state, "rng": self.rng,
            "items": self.items,
        }

    def seal(self) -> bytes:
        return seal(self.to_json())

    @classmethod
    def parse(cls, blob: bytes, where: str, manifest: Manifest, rank: int) -> "RankRecord":
        """Verify a rank record and that it belongs to ``manifest``'s save attempt."""
        doc = unseal(blob, where)
        check = _Checker(where)
        if doc.get("save_id") != manifest.save_id or doc.get("rank") != rank:
            raise ManifestError(
                f"{where} belongs to another save attempt of this step (save {doc.get('save_id')!r}, "
                f"manifest names {manifest.save_id!r}): two writers saved the same step at once, so this "
                "checkpoint cannot be trusted"
            )
        rng = doc.get("rng")
        if rng is not None and not isinstance(rng, dict):
            raise check.bad("has rng state that is not an object")
        return cls(run=check.str(doc, "run"), step=check.int(doc, "step"), rank=rank,
                   world_size=check.int(doc, "world_size", minimum=1), save_id=manifest.save_id,
                   state=doc.get("state"), rng=rng, items=check.int(doc, "items", optional=True) or 0)
