"""Listing-validated indexes: what was read from many small objects, kept in the store so
the next reader does one GET instead of thousands.

On S3 every object read is a round trip: the inventory of 10,000 checkpoints is 10,000
manifests plus their lifecycle records. An ``ObjectIndex`` keeps, per object key, the
value derived from it together with the object's size, modification time and version
(``ObjectInfo.version``: S3's ETag, a local file's inode and change time) as the listing
showed them. A reader lists (which it does anyway), takes every entry whose object is
listed unchanged, reads only the new or changed objects (in parallel), and writes the
index back when what it holds changes (never on a read that learnt nothing). An index
that fails its checksum or cannot be read is simply rebuilt.

What the index can see is what the listing shows: any write of an object, in place or
by replace, with its times set back or not, changes its version and so is read anew. A
change that no metadata records (bit rot below the filesystem, an object altered
behind S3's back) is invisible to it, as it is to any listing: a value from the index
says what was committed, not that the object is still intact. Reading the object
(restore, verify, scrub) is what checks that.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptflow.errors import CkptflowError, ObjectNotFoundError, ObjectTooLargeError, RecordTooLargeError
from ckptflow.format.sealed import MAX_RECORD_BYTES, parse_json, seal, unseal
from ckptflow.store.base import ObjectInfo, Store

PREFIX = "index/"
# entries [size, mtime, version, value]; 3: the values' shape is named by "schema". A reader
# of version 2 (an older ckptflow) checks nothing else, so it would take values of a newer
# shape (``CheckpointInfo(**value)`` failing on a field it does not have); it rebuilds a version 3
# index instead, as this one rebuilds its index: while both versions read a store, each
# rebuild costs a read of the objects, never a wrong value
VERSION = 3
log = logging.getLogger("ckptflow")
Derive = Callable[[ObjectInfo, bytes], Any]


class ObjectIndex:
    """``limit``: the most bytes an indexed object may hold; a larger one is refused unread
    (``RecordTooLargeError`` as its value), so one multi-GB object never costs its size in memory.
    ``schema`` names the shape of what ``derive`` returns: an index written under another
    (an older ckptflow's values, lacking a field or holding one no longer kept) is rebuilt,
    since its objects, unchanged, would otherwise keep their old values for good. An index
    of ``index_version`` 2 (before schemas) is rebuilt too, and this one is not taken by a
    reader of that version (``VERSION``)."""

    def __init__(
        self, store: Store, name: str, derive: Derive, *, limit: int, schema: int = 1, threads: int | None = None
    ):
        self.store, self.key, self.derive, self.limit = store, f"{PREFIX}{name}.json", derive, limit
        self.schema = schema
        self.threads = threads or (2 if store.cheap_reread else 32)

    def _load(self) -> dict[str, Any]:
        try:
            doc = unseal(self.store.get_bounded(self.key, MAX_RECORD_BYTES), f"index {self.store.url}/{self.key}")
        except ObjectNotFoundError:
            return {}
        except (CkptflowError, OSError) as e:  # damaged or unreadable: rebuild it
            log.debug("rebuilding %s/%s: %s", self.store.url, self.key, e)
            return {}
        entries = doc.get("entries")
        current = doc.get("index_version") == VERSION and doc.get("schema", 1) == self.schema
        return entries if current and isinstance(entries, dict) else {}

    def values(self, listed: Iterable[ObjectInfo]) -> dict[str, Any]:
        """``derive`` of every listed object (or the exception reading it raised), from the
        index where the object is unchanged, read otherwise."""
        listed = list(listed)
        known = self._load()
        out: dict[str, Any] = {}
        stale: list[ObjectInfo] = []
        for info in listed:
            entry = known.get(info.key)
            if isinstance(entry, list) and len(entry) == 4 and entry[:3] == _stamp(info):
                out[info.key] = entry[3]
            else:
                stale.append(info)

        def read(info: ObjectInfo) -> Any:
            try:
                return self.derive(info, self.store.get_bounded(info.key, self.limit))
            except ObjectTooLargeError as e:
                return RecordTooLargeError(f"{e}; no ckptflow record is that large: it is corrupt or hostile")
            except (CkptflowError, OSError) as e:
                return e

        with ThreadPoolExecutor(self.threads, thread_name_prefix="ckptflow-index") as pool:
            fresh = dict(zip((i.key for i in stale), pool.map(read, stale)))
        out.update(fresh)
        keep = {i.key: [*_stamp(i), out[i.key]] for i in listed if not isinstance(out[i.key], Exception)}
        # written back only when what it holds changes: an object that does not read (a damaged
        # one) has no entry, and the index was written again on every read for that difference
        if keep != known:
            self._save(keep)
        return out

    def _save(self, entries: dict[str, Any]) -> None:
        try:
            doc = {"format_version": 1, "index_version": VERSION, "schema": self.schema, "entries": entries}
            self.store.replace(self.key, seal(doc))
        except (CkptflowError, OSError) as e:  # read-only credentials: the next reader reads again
            log.debug("could not write %s/%s: %s", self.store.url, self.key, e)


def _stamp(info: ObjectInfo) -> list[Any]:
    """What an entry must match to be used: the object as the listing shows it."""
    return [info.size, info.mtime, info.version]


def record_value(info: ObjectInfo, blob: bytes) -> Any:
    """A record's JSON within the bounds every ckptflow record reader keeps (``parse_json``):
    the index must not accept a record that ``catalog.records.read_object`` refuses."""
    return parse_json(blob, f"record {info.key}")
