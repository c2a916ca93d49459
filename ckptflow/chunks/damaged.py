"""Chunk objects proved damaged, so that no save reuses them, in this process or another.

A save finds a chunk it is about to write already in the store and keeps that object
(``ChunkStore.put``: content addressing); an incremental save keeps the chunks of its
previous save without even looking. If a reader has refused that very object (its bytes
do not match their address, or do not decode), keeping it makes the new checkpoint as
unrestorable as the old one: a job that fell back past step 20 and retrains
deterministically produces step 20's chunks again, same addresses; a frozen layer's chunk
that scrub found rotten is referenced by every incremental save until the next full one,
and a job that crashes meanwhile finds no checkpoint it can restore.

So a chunk reader notes every object whose bytes it read and refused (``note``): in this
process, and in the store at ``damaged/<digest>.json`` (``fmt.damaged_key``), because
scrub, ``verify`` and export run in other processes than the training job. Every save
lists the records once before it writes (``load``), and ``put`` writes a noted chunk anew
(an atomic replace of bytes proved wrong by bytes that hash to the address: a repair, for
every checkpoint that shares it), then forgets it and deletes its record (``repaired``).
A record written by a reader that read the bytes before a repair outlives it and costs
one more rewrite, no more; GC deletes the records of chunks it no longer stores. A failure
to read proves nothing and is never noted.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time

from ckptflow.errors import CkptflowError
from ckptflow.format import layout as fmt
from ckptflow.store.base import ObjectInfo, Store

log = logging.getLogger("ckptflow")
_NAME = re.compile(rf"{re.escape(fmt.DAMAGED_PREFIX)}([0-9a-f]{{64}})\.json")
_DAMAGED: dict[tuple[str, str], str | None] = {}  # (store URL, digest) -> its record's version, if listed
_STUCK: dict[tuple[str, str], str] = {}  # records this process repaired yet could not delete, by version
_lock = threading.Lock()


def note(store: Store, digest: str, error: str) -> None:
    """Chunk object ``digest`` of ``store`` was read and refused (``error``): no save of this
    process keeps it, and a record tells every other process's saves (written anew at each
    finding, so a record a save could not delete is told from a new finding by its version).
    A store that cannot take the record now is logged, not raised: the damage found is what
    the caller reports."""
    with _lock:
        _DAMAGED.setdefault((store.url, digest), None)
    body = json.dumps({"digest": digest, "error": error[:2000], "found_at": time.time()})
    try:
        store.metadata_store().replace(fmt.damaged_key(digest), body.encode())
    except (CkptflowError, OSError) as e:
        log.warning(
            "chunk %s… of %s is damaged but the store could not record it (%s); saves in this process write it "
            "anew, saves elsewhere keep it until their next full save",
            digest[:16],
            store.url,
            e,
        )


def records(store: Store) -> dict[str, ObjectInfo]:
    """Every chunk object ``store`` records as damaged: digest -> its record (one listing;
    records are small objects, kept in a readable class on a cold tier)."""
    listing = store.metadata_store().list(fmt.DAMAGED_PREFIX)
    return {m[1]: info for info in listing if (m := _NAME.fullmatch(info.key))}


def listed(store: Store) -> tuple[dict[str, ObjectInfo] | None, str]:
    """``(records(store), "")``, or ``(None, why)`` where they cannot be listed (another
    user's prefix, an outage): what no caller stops for, since the records only save work
    or repair, and each says so in its own words."""
    try:
        return records(store), ""
    except (CkptflowError, OSError) as e:
        return None, f"the damage records in {store.url}/{fmt.DAMAGED_PREFIX} cannot be listed ({e})"


def load(store: Store) -> None:
    """Note every chunk object ``store`` records as damaged, and forget those whose record
    is gone (repaired by another process, or GC'd): what a save does before it decides which
    chunks to keep. Records that cannot be listed (another user's, an outage) are logged,
    and the save goes on without them: it then keeps what it would have kept before records
    existed, and a store that is down fails its writes anyway."""
    found, why = listed(store)
    if found is None:
        log.warning("%s: this save may keep chunks other processes found damaged; let the training job read and "
                    "write that prefix", why)  # fmt: skip
        return
    remember(store, found)


def remember(store: Store, found: dict[str, ObjectInfo]) -> None:
    """Take ``found`` (``records(store)``) as what ``store`` records as damaged now, so a
    chunk written anew (a save, a repair) deletes the record another process wrote."""
    versions = {digest: info.version or repr(info.mtime) for digest, info in found.items()}
    with _lock:
        for url, digest in [key for key, version in _DAMAGED.items() if version is not None]:
            if url == store.url and digest not in versions:
                del _DAMAGED[(url, digest)]
        for digest, version in versions.items():
            if _STUCK.get((store.url, digest)) != version:  # not a record of a damage already repaired
                _DAMAGED[(store.url, digest)] = version


def known(url: str, digest: str) -> bool:
    with _lock:
        return (url, digest) in _DAMAGED


def repaired(store: Store, digest: str) -> None:
    """``digest`` was just written anew in ``store`` from bytes that hash to it: forgotten,
    and its record (if this process knew of one) deleted. A record this process may not
    delete (another user's) is remembered by its version, so this process does not write
    the chunk anew again for it; a finding after the repair renews the record."""
    with _lock:
        if (store.url, digest) not in _DAMAGED:
            return
        version = _DAMAGED.pop((store.url, digest))
    try:
        store.metadata_store().delete(fmt.damaged_key(digest))
    except (CkptflowError, OSError) as e:  # the repair stands
        if version is not None:
            with _lock:
                _STUCK[(store.url, digest)] = version
        log.warning("chunk %s… of %s was repaired but its damage record stays (%s)", digest[:16], store.url, e)
