"""Which leases of a ``LockFamily`` are held (``ckptflow.chunks.leases``): what an exclusive
holder (GC, retention) lists once it holds its lock, to wait for the shared holders in
flight and to clear the leases their dead holders left.

The liveness rule and its timings (``DEAD_AFTER``, ``POLL``) are the lock's: they are read
from ``leases`` at each call, so one setting rules both sides of the handshake.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ckptflow.chunks import leases as held
from ckptflow.chunks import owners
from ckptflow.chunks.leases import SAVES, LockFamily
from ckptflow.errors import CkptflowError, ObjectNotFoundError
from ckptflow.store.base import ObjectInfo, Store


@dataclass
class Leases:
    live: list[ObjectInfo] = field(default_factory=list)  # saves in flight now
    dead: list[ObjectInfo] = field(default_factory=list)  # left by writers that died


def leases(store: Store, holders: dict[str, bytes] | None = None, *, family: LockFamily = SAVES) -> Leases:
    """``family``'s leases in ``store``: dead if not renewed for ``DEAD_AFTER`` or if their
    holder is gone from this machine. ``holders`` caches lease bodies (never rewritten)."""
    found = Leases()
    holders = {} if holders is None else holders
    for info in store.list(family.leases):
        if held.age(info) < held.DEAD_AFTER:
            try:
                body = holders.get(info.key) or holders.setdefault(info.key, store.get_bounded(info.key, 1 << 16))
            except ObjectNotFoundError:
                continue  # released since the listing
            except (CkptflowError, OSError):  # unreadable: it proves nothing, so it holds
                body = b""
            if not owners.gone(body):
                found.live.append(info)
                continue
        found.dead.append(info)
    return found


def wait_for_leases(store: Store, timeout: float, *, family: LockFamily = SAVES) -> Leases:
    """Wait up to ``timeout`` s for ``family``'s live leases to clear; what is held after it."""
    deadline = time.monotonic() + timeout
    holders: dict[str, bytes] = {}
    while (found := leases(store, holders, family=family)).live and time.monotonic() < deadline:
        time.sleep(held.POLL)
    return found
