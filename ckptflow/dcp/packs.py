"""Small tensors packed into shared chunks: one object and one fsync for many tensors.

A chunk object costs a fixed price wherever it is stored: on a local disk a temp file, an
fsync and a link (~0.25-0.5 ms here, the time it takes to write 256 KiB), on S3 a request.
A state with thousands of small tensors (biases, norms, LoRA adapters, their optimizer
moments) paid it per tensor: an incremental save of 2,000 changed 4 KiB tensors took
1.4 s for 8 MiB. So a save packs each run of consecutive small items (at most a quarter
of ``pack_bytes``) into a pack of at most ``pack_bytes``: one content-addressed chunk
like any other (verify, GC, archive and scrub see nothing new), and each member's storage
item names its slice of it (``ckptflow.format.dcp_index``).

What a pack gives up: it is one unit of change. A save that finds one member changed
writes the whole pack (at most ``pack_bytes``), and its members are always read, since
``written_pages`` tracks regions of one tensor's memory. The members are copied into the
pack before it is hashed, so a pack is a private copy (``private_copies``): a write to a
member during a blocking save cannot make its bytes differ from its address. Packs are
stored plainly (raw, or zstd where it shrinks them), never as deltas: a pack's members and
their order are what the plan gives, so a pack has no stable base.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptflow.chunks.io import Encoded, Encoder, plain_encoding

PACK_BYTES = 1 << 20  # 1 MiB: the write of a pack stays well under a millisecond; a quarter of it per member at most


def member_limit(pack_bytes: int) -> int:
    """The largest item packed with others: larger ones cost less than their object already."""
    return pack_bytes // 4


@dataclass
class Pack:
    """One pack being filled: its members' bytes and where each starts."""

    members: list[tuple[int, memoryview]] = field(default_factory=list)  # (offset in the pack, bytes)
    keys: list[tuple] = field(default_factory=list)  # per member (fqn, item offset, dtype, length): the pack's region
    itemsizes: set[int] = field(default_factory=set)
    floating: bool = True
    size: int = 0
    holder: list = field(default_factory=list)  # gets the future of the pack's write once submitted (``put_batches``)

    def add(self, key: tuple, raw: memoryview, itemsize: int, *, floating: bool) -> int:
        """Add ``raw`` (the member named ``key``); where its bytes start in the pack."""
        offset = self.size
        self.members.append((offset, raw))
        self.keys.append(key)
        self.itemsizes.add(itemsize)
        self.floating = self.floating and floating
        self.size += len(raw)
        return offset

    @property
    def region(self) -> tuple:
        """What the previous save's pack of the same members is found under (``regions``)."""
        return ("pack", tuple(self.keys))

    @property
    def itemsize(self) -> int:
        """The element size zstd's byte planes split by: the members' own if they share one."""
        return next(iter(self.itemsizes)) if len(self.itemsizes) == 1 else 1

    def plain_encoder(self) -> Encoder:
        """Codec "auto" for a pack: zstd where it shrinks it, else raw; never a delta."""
        itemsize, floating = self.itemsize, self.floating
        return lambda raw, _digest: Encoded(plain_encoding(raw, itemsize=itemsize, floating=floating))

    def fill(self, out: memoryview) -> None:
        """Copy every member into ``out`` (``size`` bytes)."""
        for offset, raw in self.members:
            out[offset : offset + len(raw)] = raw


class Packer:
    """Groups consecutive small items into packs of at most ``pack_bytes``."""

    def __init__(self, pack_bytes: int):
        self.pack_bytes = pack_bytes
        self.limit = member_limit(pack_bytes)
        self.current = Pack()

    def fits(self, nbytes: int) -> bool:
        """Whether an item of ``nbytes`` is packed (never an empty one: it has no chunk)."""
        return 0 < nbytes <= self.limit

    def add(self, key: tuple, raw: memoryview, itemsize: int, *, floating: bool) -> tuple[Pack | None, Pack, int]:
        """Add a small item: (the pack this closed, if any, so it can be written; the pack
        holding the item; where its bytes start in it). A pack holds one top-level entry of
        the state only (``model``, ``optim``, ...): an export reads the model's packs alone,
        and damage to an optimizer's pack never costs the weights."""
        closed = None
        full = self.current.size + len(raw) > self.pack_bytes
        if self.current.members and (full or _entry(self.current.keys[-1][0]) != _entry(key[0])):
            closed, self.current = self.current, Pack()
        return closed, self.current, self.current.add(key, raw, itemsize, floating=floating)

    def close(self) -> Pack | None:
        """The pack being filled, if it holds anything; a new one is started."""
        pack, self.current = self.current, Pack()
        return pack if pack.members else None


def _entry(fqn: str) -> str:
    """The top-level entry of the state an item belongs to."""
    return fqn.split(".", 1)[0]
