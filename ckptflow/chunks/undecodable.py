"""Chunk objects saved wrongly: they hold exactly the bytes their saver stored (their
stored checksum matches) yet do not decode to their content.

Restore's first pass checks an encoded chunk beyond its memory budget by its stored
checksum alone and leaves decoding to the second pass (``ckptflow.chunks.reads``). Such
a chunk fails only there, with the state partly written (``PartialRestoreError``), and
would fail the same way in every process that restores it: a training job restarted by
its scheduler would stop at the same chunk each time. So the finding is recorded in the
store, at ``undecodable/<digest>.<stored checksum>.json`` (``fmt.undecodable_key``), and
a restore reads those records before it checks any chunk by its stored bytes alone: a
chunk named there is decoded in the first pass, before anything is written, and rejects
its checkpoint cleanly, so restore falls back past it. A record names the object as
stored, so a chunk rewritten since (another stored checksum) is checked afresh. The
records are evidence; nothing deletes them.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time

from ckptflow.errors import CkptflowError
from ckptflow.format import layout as fmt
from ckptflow.store.base import Store

log = logging.getLogger("ckptflow")
_NAME = re.compile(rf"{re.escape(fmt.UNDECODABLE_PREFIX)}([0-9a-f]{{64}})\.([0-9a-f]{{32}})\.json")
_FOUND: set[tuple[str, str]] = set()  # (digest, stored checksum) found in this process, recorded or not
_lock = threading.Lock()


def recorded(store: Store) -> frozenset[tuple[str, str]]:
    """(digest, stored checksum) of every chunk object found saved wrongly: those this
    process found and those the store records (one listing)."""
    listed = {(m[1], m[2]) for info in store.list(fmt.UNDECODABLE_PREFIX) if (m := _NAME.fullmatch(info.key))}
    with _lock:
        return frozenset(_FOUND | listed)


def record(store: Store, digest: str, stored: str, error: str) -> None:
    """Remember that chunk object ``digest`` (stored checksum ``stored``) does not decode
    to its content: in this process at once, and in the store for every later restore.
    A store that cannot take the record now is logged, not raised: the damage found is
    what the caller reports."""
    with _lock:
        _FOUND.add((digest, stored))
    body = json.dumps({"digest": digest, "stored_checksum": stored, "error": error[:2000], "found_at": time.time()})
    try:
        store.put_if_absent(fmt.undecodable_key(digest, stored), body.encode())
    except (CkptflowError, OSError) as e:
        log.warning(
            "chunk %s… was saved wrongly but %s could not record it (%s); restores in this process decode it "
            "before writing anything, others will meet it as this one did",
            digest[:16],
            store.url,
            e,
        )


class Listing:
    """``recorded(store)``, listed once, when first asked (a reader's whole restore); a
    listing that failed (an outage: the restore stops) is raised again, not retried per chunk."""

    def __init__(self, store: Store):
        self.store = store
        self._listed: frozenset[tuple[str, str]] | Exception | None = None
        self._lock = threading.Lock()

    def __contains__(self, found: tuple[str, str]) -> bool:
        with self._lock:
            if isinstance(self._listed, BaseException):
                raise self._listed
            if self._listed is None:
                try:
                    self._listed = recorded(self.store)
                except Exception as e:
                    self._listed = e
                    raise
        return found in self._listed
