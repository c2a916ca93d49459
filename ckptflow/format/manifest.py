"""The commit record and the rank records, typed: parsed once, validated once.

Everything a restore relies on is checked when the sealed JSON is parsed: the
checksum (``sealed``), the field types, and the DCP index (``dcp_index``: every
tensor's shards cover it exactly, chunk lengths add up). ``verify``, the blocking
integrity check, ``export`` and ``restore`` all read through ``Manifest.parse``, so
they apply one set of rules and cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptflow.errors import ManifestError, NewerFormatError, decoding
from ckptflow.format import checksum
from ckptflow.format import layout as fmt
from ckptflow.format import rng as rng_format
from ckptflow.format.dcp_index import DcpIndex, StorageItem, parse_dcp_index
from ckptflow.format.save_cost import SaveCost
from ckptflow.format.sealed import Fields, seal, unseal
from ckptflow.format.state_tree import json_value_problem

MAX_WORLD_SIZE = 1 << 20
KINDS = ("full", "incremental")


# ---- the records ----------------------------------------------------------------------
@dataclass(frozen=True)
class ManifestStats:
    logical_bytes: int
    unique_bytes: int
    stored_bytes: int
    chunks: int
    chunks_written: int
    bytes_written: int
    stored_written: int = 0  # encoded bytes of the chunks this save wrote (absent before codec "auto")
    delta_chunks: int = 0
    bytes_unread: int = 0  # of the state, left unread: no write reached them since the previous save read them

    @property
    def added_bytes(self) -> int:
        """Bytes this save added to the store as they are stored (encoded): what it cost in
        space. A manifest written before ckptflow recorded that (codec "auto") gives its raw count."""
        return self.stored_written or self.bytes_written


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
    chunks: Mapping[str, int]  # digest -> raw length: every chunk a restore reads, delta bases included
    stats: ManifestStats
    bases: Mapping[str, str] = field(default_factory=dict)  # delta chunk -> its base (both in ``chunks``)
    # digest -> fast checksum of its raw bytes (``ckptflow.format.checksum``): what restore checks;
    # absent in manifests written before, whose chunks restore checks by their address
    fast_checksums: Mapping[str, str] = field(default_factory=dict)
    # digest -> xxh3-128 of the object as its saver stored it, for encoded, non-delta chunks
    # (``checksum.stored_checksum``): lets restore verify them without decoding twice
    stored_checksums: Mapping[str, str] = field(default_factory=dict)
    lossy: Mapping[str, Any] | None = None  # a lossy archive copy: what was lost (``ckptflow.chunks.lossy``)
    tied: tuple[tuple[str, ...], ...] = ()  # tensor names that were one tensor when saved (``_parse_tied``)
    address: str = checksum.ADDRESS  # the hash naming its chunks: "sha256" in format 1 (``ckptflow.format.checksum``)
    rank_records_by_save: bool = False  # rank records named by save id (see format.rank_key)
    save_cost: SaveCost | None = None  # what the save cost (``ckptflow.format.save_cost``); None before it existed
    digest: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)  # fields a newer writer added

    @property
    def ref(self) -> tuple[str, int]:
        return (self.run, self.step)

    @property
    def logical_bytes(self) -> int:
        return self.stats.logical_bytes

    def rank_key(self, rank: int) -> str:
        return fmt.rank_key(self.run, self.step, rank, self.save_id if self.rank_records_by_save else "")

    def rank_keys(self) -> list[str]:
        return [self.rank_key(r) for r in range(self.world_size)]

    def rank_of(self, key: str) -> int | None:
        """The rank whose record of this commit ``key`` is; None for any other file (a
        losing writer's record, debris). Decided from the name alone."""
        prefix = fmt.step_prefix(self.run, self.step) + "ranks/"
        stem = key.removeprefix(prefix).removesuffix(".json")
        rank, _, owner = stem.partition(".")
        if not key.startswith(prefix) or not key.endswith(".json") or not rank.isdigit() or len(rank) > 9:
            return None
        if owner != (self.save_id if self.rank_records_by_save else "") or int(rank) >= self.world_size:
            return None
        return int(rank)

    def items(self) -> Iterator[StorageItem]:
        return iter(self.dcp.items)

    def to_json(self) -> dict:
        packed = any(item.packed_at is not None for item in self.dcp.items)
        return {
            "format_version": fmt.PACKED_FORMAT if packed else fmt.FORMAT_VERSION,
            "run": self.run,
            "step": self.step,
            "kind": self.kind,
            "save_id": self.save_id,
            "base_step": self.base_step,
            "created_at": self.created_at,
            "committed_at": self.committed_at,
            "world_size": self.world_size,
            "codec": self.codec,
            "metadata": dict(self.metadata),
            "dcp": self.dcp.to_json(),
            "address": self.address,
            "chunks": dict(self.chunks),
            **({"bases": dict(self.bases)} if self.bases else {}),
            **({checksum.FIELD: dict(self.fast_checksums)} if self.fast_checksums else {}),
            **({checksum.STORED_FIELD: dict(self.stored_checksums)} if self.stored_checksums else {}),
            **({"lossy": dict(self.lossy)} if self.lossy is not None else {}),
            **({"tied": [list(group) for group in self.tied]} if self.tied else {}),
            "stats": dict(self.stats.__dict__),
            **({"rank_records": "by_save_id"} if self.rank_records_by_save else {}),
            **({"save_cost": self.save_cost.to_json()} if self.save_cost is not None else {}),
            **self.extra,
        }

    def seal(self) -> bytes:
        return seal(self.to_json())

    @classmethod
    def from_json(cls, doc: dict, where: str, digest: str = "") -> Manifest:
        check = Fields(where)
        run = check.string(doc, "run")
        step = check.integer(doc, "step")
        kind = check.string(doc, "kind")
        if kind not in KINDS:
            raise check.bad(f"has kind {kind!r}, not one of {KINDS}")
        world_size = check.integer(doc, "world_size", minimum=1)
        if world_size > MAX_WORLD_SIZE:
            raise check.bad(f"has world_size {world_size}, more than {MAX_WORLD_SIZE}")
        address = _parse_address(check, doc)
        chunks = check.mapping(doc, "chunks")
        if not all(fmt.is_digest(d) for d in chunks) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in chunks.values()
        ):
            raise check.bad(f"has a chunk entry that is not a {address} digest with a non-negative length")
        stats_doc = check.mapping(doc, "stats")
        stats = ManifestStats(
            **{
                k: check.integer(stats_doc, k)
                if k in _REQUIRED_STATS
                else check.integer(stats_doc, k, optional=True) or 0
                for k in ManifestStats.__dataclass_fields__
            }
        )
        metadata = doc.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise check.bad("has metadata that is not an object")
        dcp = parse_dcp_index(check, check.mapping(doc, "dcp"), chunks)
        bases = _parse_bases(check, doc, chunks)
        fast_checksums = _parse_checksums(check, doc, chunks)
        stored_checksums = _parse_stored_checksums(check, doc, chunks, bases)
        lossy = doc.get("lossy")
        if lossy is not None and not isinstance(lossy, dict):
            raise check.bad("has a 'lossy' record that is not an object")
        known = {*_MANIFEST_FIELDS, "format_version", "rank_records", checksum.FIELD, checksum.STORED_FIELD}
        return cls(
            run=run,
            step=step,
            kind=kind,
            save_id=check.string(doc, "save_id", optional=True) or "",
            base_step=check.integer(doc, "base_step", optional=True),
            created_at=check.timestamp(doc, "created_at"),
            committed_at=check.timestamp(doc, "committed_at")
            if "committed_at" in doc
            else check.timestamp(doc, "created_at"),
            world_size=world_size,
            codec=check.string(doc, "codec", optional=True) or "raw",
            metadata=metadata,
            dcp=dcp,
            chunks=chunks,
            stats=stats,
            bases=bases,
            fast_checksums=fast_checksums,
            stored_checksums=stored_checksums,
            lossy=lossy,
            tied=_parse_tied(check, doc),
            address=address,
            rank_records_by_save=doc.get("rank_records") == "by_save_id",
            save_cost=SaveCost.from_json(doc.get("save_cost")),
            digest=digest,
            extra={k: v for k, v in doc.items() if k not in known},
        )

    @classmethod
    def parse(cls, blob: bytes, where: str, *, run: str | None = None, step: int | None = None) -> Manifest:
        """Verify and parse a sealed manifest; with ``run``/``step``, also that it sits
        where it claims to (a manifest copied to another step is not that step)."""
        with decoding(where, ManifestError):  # whatever the checks miss is damage too, never a crash
            manifest = cls.from_json(unseal(blob, where), where, fmt.digest_of(blob))
        if (run is not None and manifest.run != run) or (step is not None and manifest.step != step):
            raise ManifestError(
                f"{where} describes run {manifest.run!r} step {manifest.step}, not run {run!r} step {step}: "
                "it was copied to the wrong place"
            )
        return manifest


def _parse_address(check: Fields, doc: dict) -> str:
    """Format 1 names chunks by sha256 and says nothing; format 2 says which hash."""
    if doc.get("format_version") == 1:
        if "address" in doc:
            raise check.bad("is format 1 but names an 'address' hash, which format 1 does not have")
        return "sha256"
    address = check.string(doc, "address")
    if address not in checksum.ADDRESSES:
        raise check.bad(f"names chunk address hash {address!r}, not one of {checksum.ADDRESSES}")
    return address


def _parse_bases(check: Fields, doc: dict, chunks: Mapping[str, int]) -> dict[str, str]:
    """Delta chunk -> base: both listed with the same length, and no base is itself a
    delta of this manifest (chains are one link long). Absent before codec "auto"."""
    bases = doc.get("bases") or {}
    if not isinstance(bases, dict):
        raise check.bad("has 'bases' that is not an object")
    for delta, base in bases.items():
        if not isinstance(base, str) or delta not in chunks or base not in chunks or chunks[delta] != chunks[base]:
            raise check.bad(f"has delta chunk {str(delta)[:16]}… whose base is not listed with its length")
        if base in bases or base == delta:
            raise check.bad(f"has delta chunk {delta[:16]}… on a base that is itself a delta")
    return bases


def _parse_checksums(check: Fields, doc: dict, chunks: Mapping[str, int]) -> dict[str, str]:
    """Chunk -> fast checksum, each of a listed chunk and well formed. Absent in
    manifests written before fast checksums (their chunks are checked by address)."""
    checksums = doc.get(checksum.FIELD) or {}
    if not isinstance(checksums, dict):
        raise check.bad(f"has {checksum.FIELD!r} that is not an object")
    for digest, value in checksums.items():
        if digest not in chunks:
            raise check.bad(f"has a fast checksum for chunk {str(digest)[:16]}…, which it does not list")
        if not checksum.is_checksum(value):
            raise check.bad(f"has a malformed fast checksum for chunk {str(digest)[:16]}…: {str(value)[:60]!r}")
    return checksums


def _parse_stored_checksums(
    check: Fields, doc: dict, chunks: Mapping[str, int], bases: Mapping[str, str]
) -> dict[str, str]:
    """Chunk -> checksum of its stored bytes, each well formed. Entries for chunks the
    manifest does not list, or lists as deltas, are dropped, not refused: the field only
    saves a restore work, and a copy a ckptflow from before it made (which keeps fields it
    does not know, such as a lossy archive copy's) may list other chunks. Absent before the
    field existed, and for chunks stored raw."""
    stored = doc.get(checksum.STORED_FIELD) or {}
    if not isinstance(stored, dict):
        raise check.bad(f"has {checksum.STORED_FIELD!r} that is not an object")
    for digest, value in stored.items():
        if not checksum.is_stored_checksum(value):
            raise check.bad(f"has a malformed stored checksum for chunk {str(digest)[:16]}…: {str(value)[:60]!r}")
    return {d: v for d, v in stored.items() if d in chunks and d not in bases}


def _parse_tied(check: Fields, doc: dict) -> tuple[tuple[str, ...], ...]:
    """Groups of tensor names the saver saw sharing one storage (``tree.shared_storage``),
    each of two or more names, no name in two groups. Absent before the record existed.
    A name need not be in this manifest's index (a lossy copy may drop its entry): readers
    use the names present."""
    tied = doc.get("tied", [])
    if not isinstance(tied, list) or not all(
        isinstance(group, list) and len(group) > 1 and all(isinstance(n, str) for n in group) for group in tied
    ):
        raise check.bad("has a 'tied' record that is not a list of groups of two or more tensor names")
    names = [n for group in tied for n in group]
    if len(set(names)) != len(names):
        raise check.bad("has a 'tied' record that names one tensor twice")
    return tuple(tuple(group) for group in tied)


_REQUIRED_STATS = ("logical_bytes", "stored_bytes", "chunks", "bytes_written")
_MANIFEST_FIELDS = tuple(
    f
    for f in Manifest.__dataclass_fields__
    if f not in ("digest", "extra", "rank_records_by_save", "fast_checksums", "stored_checksums")
)


@dataclass(frozen=True, kw_only=True)
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
            "format_version": fmt.FORMAT_VERSION,
            "run": self.run,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "save_id": self.save_id,
            "state": self.state,
            "rng": self.rng,
            "items": self.items,
        }

    def seal(self) -> bytes:
        return seal(self.to_json())

    @classmethod
    def parse(cls, blob: bytes, where: str, manifest: Manifest, rank: int) -> RankRecord:
        """Verify a rank record and that it belongs to ``manifest``'s save attempt."""
        with decoding(where, ManifestError):
            try:
                doc = unseal(blob, where)
            except NewerFormatError as e:  # a newer writer writes its manifest in that format too
                raise ManifestError(
                    f"{e}, but its manifest is one this ckptflow reads: it is not that commit's"
                ) from None
            return cls._parse(doc, where, manifest, rank)

    @classmethod
    def _parse(cls, doc: dict, where: str, manifest: Manifest, rank: int) -> RankRecord:
        check = Fields(where)
        if doc.get("save_id") != manifest.save_id or doc.get("rank") != rank:
            raise ManifestError(
                f"{where} belongs to another save attempt of this step (save {doc.get('save_id')!r}, "
                f"manifest names {manifest.save_id!r}): two writers saved the same step at once, so this "
                "checkpoint cannot be trusted"
            )
        state = doc.get("state")
        if not isinstance(state, dict):  # ``flatten`` of a state, which is a mapping
            raise check.bad("has a state that is not a JSON object")
        problem = json_value_problem(state, manifest.dcp.tensors)
        if problem:  # found now, not after the restore read tensors into place
            raise check.bad(f"has a state that {problem}")
        rng = doc.get("rng")
        problem = rng_format.problem(rng)
        if problem:  # found now, not after the restore read tensors into place
            raise check.bad(f"has rng state that {problem}")
        return cls(
            run=check.string(doc, "run"),
            step=check.integer(doc, "step"),
            rank=rank,
            world_size=check.integer(doc, "world_size", minimum=1),
            save_id=manifest.save_id,
            state=state,
            rng=rng,
            items=check.integer(doc, "items", optional=True) or 0,
        )
