"""Chunk objects this process proved damaged, so that no save reuses them.

A save finds a chunk it is about to write already in the store and keeps that object
(``ChunkStore.put``: content addressing). If a restore just rejected that very object
(its bytes do not match their address, or do not decode), keeping it makes the new
checkpoint as unrestorable as the old one: a job that fell back past step 20 and
retrains deterministically produces step 20's chunks again, same addresses, and would
reference the damaged objects. So a chunk reader notes every object whose bytes it
read and refused (``note``), and ``put`` writes such a chunk anew (an atomic replace of
bytes proved wrong by bytes that hash to the address: a repair, for every checkpoint
that shares it) and forgets it once repaired. A failure to read proves nothing and is
never noted. Process-wide, keyed by (store URL, digest).
"""

from __future__ import annotations

import threading

_DAMAGED: set[tuple[str, str]] = set()
_lock = threading.Lock()


def note(url: str, digest: str) -> None:
    with _lock:
        _DAMAGED.add((url, digest))


def known(url: str, digest: str) -> bool:
    with _lock:
        return (url, digest) in _DAMAGED


def repaired(url: str, digest: str) -> None:
    with _lock:
        _DAMAGED.discard((url, digest))
