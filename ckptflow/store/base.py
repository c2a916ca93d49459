"""The small interface every storage backend implements.

Checkpoint logic only ever needs seven operations, so a new backend (S3, GCS, a
parallel filesystem) is one class; the optional capabilities have defaults. Keys are ``/``-separated relative names that
``validate_key`` has accepted; a backend never sees ``..`` or an absolute path.
"""

from __future__ import annotations

import contextlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptflow.errors import CkptflowError, InvalidNameError, ObjectTooLargeError

Buffers = bytes | memoryview | Sequence[bytes | memoryview]

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z")


def validate_key(key: str) -> str:
    """Refuse any key that is not a plain relative path of safe segments."""
    if not isinstance(key, str) or not key:
        raise InvalidNameError(f"store key must be a non-empty string, got {key!r}")
    for segment in key.split("/"):
        if not _SEGMENT.match(segment) or segment in (".", ".."):
            raise InvalidNameError(
                f"store key {key!r} has an unsafe segment {segment!r}: segments must start "
                "with a letter or digit and contain only letters, digits, '.', '_' or '-'"
            )
    return key


def as_buffers(data: Buffers) -> list[bytes | memoryview]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [data]
    return list(data)


@dataclass(frozen=True)
class SettledDeletes:
    """What ``Store.settle_interrupted_deletes`` did, and what it could not do yet."""

    restored: list[str] = field(default_factory=list)  # keys whose version, taken aside, was put back
    # keys taken aside too recently to tell a delete under way from one killed: what they hold
    # (a commit, whose chunks GC could not mark) is settled by a later GC; a lock is never
    # listed here (it is never put back, so it holds nothing GC must keep)
    pending: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing or stat knows of one object."""

    key: str
    size: int
    mtime: float  # seconds since the epoch
    #: A token every write of the object changes, even one that keeps its size and sets its
    #: time back: S3's ETag, a local file's inode and change time. "" where a backend has none.
    version: str = ""


class Store(ABC):
    """One store root. All methods are safe to call from several threads.

    Seven operations are required; the rest are optional capabilities declared here
    with defaults, so code above ``store/`` asks a store what it can do instead of
    probing its type.
    """

    url: str
    #: Re-reading an object is cheap (a page cache): restore verifies chunks by streaming
    #: them through a small buffer, then reads them again straight into the tensors.
    cheap_reread: bool = False
    #: New objects land in a storage class that cannot be read until thawed (Glacier).
    writes_cold: bool = False
    #: Cold objects can be thawed (``request_thaw``).
    can_thaw: bool = False
    #: Small objects can be replaced conditionally (``get_versioned`` / ``replace_if``).
    compare_and_swap: bool = False
    #: ``locked`` excludes every other thread and process of this store (a local flock);
    #: without it the lock holds nothing and only conditional writes keep callers right.
    locks_exclude: bool = False

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; ``ObjectNotFoundError`` if absent."""

    @abstractmethod
    def put_if_absent(self, key: str, data: Buffers) -> bool:
        """Create ``key`` atomically unless it exists. True if this call created it.

        Readers never see a partial object, and two concurrent creators cannot both win:
        this is both chunk dedup and the create-only manifest commit.
        """

    @abstractmethod
    def replace(self, key: str, data: Buffers) -> None:
        """Atomically create or overwrite ``key``: readers see the old or the new bytes."""

    @abstractmethod
    def list(self, prefix: str, *, recursive: bool = True) -> Iterator[ObjectInfo]:
        """Objects under ``prefix`` (a key ending in ``/`` or empty), sorted by key, with
        their sizes and modification times.

        With ``recursive=False`` only direct children are listed; a child "directory"
        appears once as an ``ObjectInfo`` whose key ends in ``/`` and whose size is 0.
        """

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; deleting an absent key is not an error."""

    @abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and modification time; ``ObjectNotFoundError`` if absent."""

    # ---- optional capabilities, with defaults --------------------------------------
    def list_after(self, prefix: str, start_after: str = "", *, roll_up: str = "") -> Iterator[ObjectInfo]:
        """``list(prefix)`` (recursive) from the first key sorting after ``start_after``,
        and with ``roll_up`` every key whose part after ``prefix`` contains it listed once
        as that part up to and including it (size 0; S3's ``Delimiter``).

        A backend that can do either itself (S3: ``StartAfter``, ``Delimiter``) pays only
        for what is returned: a reader that knows where new keys begin does not list the
        rest, and one that needs a step's commit record lists one entry for its rank
        records, however many ranks saved it."""
        seen: set[str] = set()
        for info in self.list(prefix):
            if info.key <= start_after:
                continue
            cut = info.key.find(roll_up, len(prefix)) if roll_up else -1
            if cut < 0:
                yield info
            elif (rolled := info.key[: cut + len(roll_up)]) not in seen:
                seen.add(rolled)
                yield ObjectInfo(rolled, 0, 0.0)

    def get_bounded(self, key: str, limit: int | None) -> bytes:
        """``get``, refusing (``ObjectTooLargeError``) an object larger than ``limit`` bytes
        before reading it whole: a record or chunk is never allowed to make a reader
        allocate more than its manifest says it holds."""
        if limit is not None and (size := self.stat(key).size) > limit:
            raise ObjectTooLargeError(f"{self.url}/{key} holds {size} bytes, more than the {limit} expected")
        return self.get(key)

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except KeyError:
            return False
        return True

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """Chunk writes (one save's) that need be durable only once the block ends, when
        the save goes on to name them in a commit: a backend may defer per-object work
        (the local store's directory fsyncs) to the end instead. Default: no deferral."""
        return contextlib.nullcontext()

    def touch(self, key: str) -> None:
        """Refresh ``key``'s modification time so GC's grace period restarts for it.

        Backends where this is expensive may make it a no-op and document how their
        garbage collection stays safe instead.
        """
        return None

    def scan(
        self, key: str, buffer: memoryview, consume: Callable[[memoryview], None], *, limit: int | None = None
    ) -> tuple[int, Any]:
        """Feed the object to ``consume`` piece by piece: (its size, its version).

        The version names the exact object read (``None`` where the backend cannot say),
        so a later ``get_into`` can tell whether it reads the same bytes. The default
        reads the whole object; a backend with cheap re-reads streams through ``buffer``.
        An object over ``limit`` bytes is refused (``ObjectTooLargeError``) before it is read.
        """
        data = memoryview(self.get_bounded(key, limit))
        for start in range(0, len(data), max(1, len(buffer))):
            consume(data[start : start + len(buffer)])
        return len(data), None

    def in_memory(self, key: str) -> bool:
        """Whether reading ``key`` now needs no I/O (a local file all in the page cache): then
        a read is CPU work. False where unknown, and for a missing object."""
        return False

    def read_head(self, key: str, size: int) -> bytes:
        """The first ``size`` bytes of the object (all of it if shorter): enough of a
        chunk to learn its codec and delta base without reading its payload."""
        return self.get(key)[:size]

    def get_into(
        self,
        key: str,
        buffers: Sequence[bytearray | memoryview],
        *,
        consume: Callable[[memoryview], None] | None = None,
        piece: int = 256 << 10,
    ) -> tuple[int, Any]:
        """Read the object into ``buffers`` in order: (its size, its version).

        The buffers are filled only when the object's size equals their total size;
        otherwise they are left alone and the caller decides what to do. ``consume``,
        if given, is handed every filled buffer in pieces of at most ``piece`` bytes, in
        order (a piece never spans two buffers): a backend that reads piece by piece
        hands each over while it is still in the CPU cache.
        """
        data = memoryview(self.get(key))
        views = [memoryview(b).cast("B") for b in buffers]
        if len(data) == sum(len(v) for v in views):
            offset = 0
            for view in views:
                view[:] = data[offset : offset + len(view)]
                offset += len(view)
                if consume is not None:
                    for start in range(0, len(view), max(1, piece)):
                        consume(view[start : start + piece])
        return len(data), None

    def stale_temp_files(self, older_than: float) -> Iterator[ObjectInfo]:
        """Partial objects left by writers that died mid-write (for GC), and on a backend with
        directories the empty ones they left (key ending in "/"); a backend whose writes are
        atomic without temp objects has none."""
        return iter(())

    def delete_temp(self, name: str) -> None:
        """Remove one of ``stale_temp_files``."""
        return None

    def settle_interrupted_deletes(self, *, locks: Collection[str] = (), dry_run: bool = False) -> SettledDeletes:
        """Finish what conditional deletes (``delete_if``) killed midway left: the version
        they were to delete goes, any other version goes back under its key, except under
        one of ``locks`` (exclusive locks, ``ckptflow.chunks.leases``): there it goes too,
        since its holder gave it up once its heartbeat found it gone. For GC, before it
        marks (a manifest put back protects its chunks); a backend whose conditional delete
        is one request leaves nothing. ``dry_run`` changes nothing and says what it would do
        (for GC's dry run)."""
        return SettledDeletes()

    def metadata_store(self) -> Store:
        """Where small records (manifests, rank records) go: this store, or for a store
        that writes cold objects a view of the same root in a readable class."""
        return self

    def request_thaw(self, key: str, *, days: int = 1, tier: str = "Standard") -> bool:
        """Ask the backend to make a cold object readable for ``days``; False if it is
        not cold or a thaw is already under way."""
        raise CkptflowError(f"{self.url} has no cold storage classes: thaw applies to s3:// stores")

    @contextlib.contextmanager
    def locked(self, name: str) -> Iterator[None]:
        """Hold the exclusive lock ``name`` (a key) while the block runs, against every
        thread and process of this store that asks for it. The default holds nothing: a
        store without locks keeps its callers right with conditional writes alone
        (``put_if_absent``, ``delete_if``); the lock only spares them duplicate work."""
        validate_key(name)
        yield

    # ---- compare-and-swap (optional capability) -------------------------------------
    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str]:
        """A small object's bytes and an opaque version token for ``replace_if`` and
        ``delete_if``; ``ObjectNotFoundError`` if absent, ``ObjectTooLargeError`` (before
        reading it) if larger than ``limit``."""
        raise CkptflowError(f"{self.url} cannot replace objects conditionally (no compare-and-swap)")

    def version_and_size(self, key: str) -> tuple[str, int]:
        """The version ``get_versioned`` would give ``key``, and the size of that same
        version, without holding its bytes: for an object too large to read whole (a
        damaged record) that must still be deleted only while it is that object.
        ``ObjectNotFoundError`` if absent."""
        raise CkptflowError(f"{self.url} cannot replace objects conditionally (no compare-and-swap)")

    def delete_if(self, key: str, expected: str) -> bool:
        """Delete ``key`` only if it is still the version ``expected`` (from
        ``get_versioned``): True if this call deleted it; False if it is absent or another
        writer changed it in between (nothing is deleted)."""
        raise CkptflowError(f"{self.url} cannot delete objects conditionally (no compare-and-swap)")

    def replace_if(self, key: str, data: Buffers, expected: str | None) -> bool:
        """Replace ``key`` only if it is still the version ``expected`` (from
        ``get_versioned``), or create it only if absent when ``expected`` is None.

        True if this call wrote; False if another writer changed the object in between
        (nothing is written: read again and retry). Readers see old or new bytes.
        """
        raise CkptflowError(f"{self.url} cannot replace objects conditionally (no compare-and-swap)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
