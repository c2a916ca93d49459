"""Save leases and the GC lock: the handshake that keeps GC from deleting a chunk that a
save is reusing at that very moment.

The grace period alone cannot cover that case: GC lists a chunk as old and unreferenced,
a save then finds the same content already stored and reuses it, and GC deletes it.
So each rank takes a lease before it looks at any chunk and GC takes a lock before it
lists anything; each then checks for the other. On a store with read-after-write
consistency (local disks, S3) one side always sees the other: a save waits while GC
holds the lock, and GC waits (then gives up) while a live save holds a lease.

A lease older than GC's grace period counts as left by a writer that died, which is
one more reason the grace period must exceed the slowest save.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from ckptflow.errors import CkptflowError, ObjectNotFoundError
from ckptflow.store.base import ObjectInfo, Store

LEASES = "locks/leases/"
GC_LOCK = "locks/gc.json"
LOCK_TTL = 600.0  # seconds; a GC lock older than this was left by a GC that died
POLL = 0.05


def _owner() -> bytes:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode()


def _lock_age(store: Store) -> float | None:
    try:
        return time.time() - store.stat(GC_LOCK).mtime
    except ObjectNotFoundError:
        return None


@contextmanager
def save_lease(store: Store, timeout: float = LOCK_TTL) -> Iterator[None]:
    """Hold a lease for the chunk phase of a save; wait out a running GC first."""
    key = f"{LEASES}{uuid.uuid4().hex}.json"
    store.put_if_absent(key, _owner())
    try:
        deadline = time.monotonic() + timeout
        while (age := _lock_age(store)) is not None and age < LOCK_TTL:
            if time.monotonic() > deadline:
                raise CkptflowError(
                    f"garbage collection has held {store.url}/{GC_LOCK} for {age:.0f} s; "
                    "if no GC is running, delete that object"
                )
            time.sleep(POLL)
        yield
    finally:
        store.delete(key)


@contextmanager
def gc_lock(store: Store) -> Iterator[None]:
    """Exclusive lock for a GC sweep; a lock left by a dead GC is taken over."""
    if not store.put_if_absent(GC_LOCK, _owner()):
        age = _lock_age(store)
        if age is not None and age < LOCK_TTL:
            raise CkptflowError(
                f"another garbage collection holds {store.url}/{GC_LOCK} (taken {age:.0f} s ago); "
                "run gc again when it has finished"
            )
        store.delete(GC_LOCK)
        if not store.put_if_absent(GC_LOCK, _owner()):
            raise CkptflowError(f"another garbage collection just took {store.url}/{GC_LOCK}; run gc again later")
    try:
        yield
    finally:
        store.delete(GC_LOCK)


def live_leases(store: Store, cutoff: float) -> list[ObjectInfo]:
    """Leases newer than ``cutoff``: saves that are (or may still be) writing chunks."""
    return [info for info in store.list(LEASES) if info.mtime >= cutoff]


def wait_for_leases(store: Store, cutoff: float, timeout: float) -> list[ObjectInfo]:
    """Wait up to ``timeout`` s for live leases to clear; the ones still live after it."""
    deadline = time.monotonic() + timeout
    while (live := live_leases(store, cutoff)) and time.monotonic() < deadline:
        time.sleep(POLL)
    return live
