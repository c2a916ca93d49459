"""The small interface every storage backend implements.

Checkpoint logic only ever needs these seven operations, so a new backend (S3, GCS,
a parallel filesystem) is one class. Keys are ``/``-separated relative names that
``validate_key`` has accepted; a backend never sees ``..`` or an absolute path.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ckptflow.errors import InvalidNameError

Buffers = bytes | memoryview | Sequence[bytes | memoryview]

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


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
class ObjectInfo:
    """What a listing or stat knows of one object."""

    key: str
    size: int
    mtime: float  # seconds since the epoch


class Store(ABC):
    """One store root. All methods are safe to call from several threads."""

    url: str

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
        """Objects under ``prefix`` (a key ending in ``/`` or empty), sorted by key.

        With ``recursive=False`` only direct children are listed; a child "directory"
        appears once as an ``ObjectInfo`` whose key ends in ``/`` and whose size is 0.
        """

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; deleting an absent key is not an error."""

    @abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and modification time; ``ObjectNotFoundError`` if absent."""

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except KeyError:
            return False
        return True

    def touch(self, key: str) -> None:
        """Refresh ``key``'s modification time so GC's grace period restarts for it.

        Backends where this is expensive may make it a no-op and document how their
        garbage collection stays safe instead.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
