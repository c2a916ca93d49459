"""A model version's files from the registry's store into a model directory, streamed.

Model files are multi-GB (safetensors weights of a 7B-70B model): each goes from the
store to its temporary file one ``DOWNLOAD_PIECE`` at a time (``Store.scan``: a local
file read through the buffer, an S3 GET body read piece by piece), hashed as it passes,
so a deploy holds one piece of it in memory, not the file. Nothing is read that the
version record does not bound: every file's recorded size must be the size of the object
the store holds, checked for all files before a byte of any is read.

As before, every file lands under a temporary name and all are renamed into place only
once each hashes to its record; whatever fails removes the temporary files, so the
directory holds what it held (and one the download made is removed).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from ckptflow.errors import ObjectNotFoundError, ObjectTooLargeError, RegistryError
from ckptflow.store.base import Store

DOWNLOAD_PIECE = 1 << 20  # what a download holds of a model file at once
_REBUILD = "write it again from its checkpoint (ckptflow.lifecycle.promote.rebuild), then download again"
Files = Mapping[str, Mapping[str, Any]]  # file name -> {"sha256": ..., "size": ...}


def download(
    store: Store, files: Files, key_of: Callable[[str], str], version: str, directory: str | os.PathLike
) -> None:
    """``Registry.download`` of ``files`` of ``version`` ("model vN"), each stored at
    ``key_of(its sha256)``: every size checked, then each file streamed to a temporary
    file and checked, then all renamed into place."""
    unchanged = f"nothing in {os.fspath(directory)} was changed"
    keys = {name: _sized_key(store, files[name], key_of, f"{version} file {name}", unchanged) for name in sorted(files)}
    made = _missing_directories(directory)
    os.makedirs(directory, exist_ok=True)
    fetched: list[tuple[str, str]] = []  # (temporary path, final path)
    piece = memoryview(bytearray(DOWNLOAD_PIECE))
    try:
        for name, key in keys.items():
            final = os.path.join(directory, name)
            fetched.append((f"{final}.tmp-{uuid.uuid4().hex}", final))
            _stream_file(store, key, files[name], fetched[-1][0], piece, f"{version} file {name}", unchanged)
        for tmp, final in fetched:
            os.replace(tmp, final)
        made = []
    finally:
        for tmp, _ in fetched:
            if os.path.exists(tmp):
                os.unlink(tmp)
        for path in made:  # a failed download leaves no directory it made (each still empty)
            with contextlib.suppress(OSError):
                os.rmdir(path)


def _missing_directories(directory: str | os.PathLike) -> list[str]:
    """The directories ``os.makedirs(directory)`` would make, innermost first."""
    missing, path = [], os.path.abspath(directory)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _sized_key(store: Store, f: Mapping[str, Any], key_of: Callable[[str], str], where: str, unchanged: str) -> str:
    """The key of file ``f``, once its recorded size is a byte count and the size of the
    object the store holds there: a record that says less than the store holds would
    otherwise let the object decide how much is read. A deleted object is named as the
    version's file, with how to bring it back, not as a bare key the store lacks."""
    size, key = f.get("size"), key_of(f["sha256"])
    if type(size) is not int or size < 0:
        raise RegistryError(
            f"{where} records size {size!r}, not a byte count: the version record is damaged; "
            f"{unchanged}: promote its checkpoint again (a new version) and download that"
        )
    try:
        held = store.stat(key).size
    except ObjectNotFoundError:
        raise _missing(store, key, where, unchanged) from None
    if held != size:
        raise RegistryError(
            f"{where} records {size} bytes but {store.url}/{key} holds {held}: the stored file was "
            f"damaged or replaced; {unchanged}: {_REBUILD}"
        )
    return key


def _missing(store: Store, key: str, where: str, unchanged: str) -> RegistryError:
    return RegistryError(f"{where} is missing: {store.url}/{key} was deleted; {unchanged}: {_REBUILD}")


def _stream_file(
    store: Store, key: str, f: Mapping[str, Any], path: str, piece: memoryview, where: str, unchanged: str
) -> None:
    """Object ``key`` into the new file ``path``: each piece the store hands over is hashed
    and written; the file is flushed to disk once it hashes to its sha256."""
    hasher = hashlib.sha256()
    with open(path, "xb") as out:

        def consume(part: memoryview) -> None:
            hasher.update(part)
            out.write(part)

        try:
            got = store.scan(key, piece, consume, limit=f["size"])[0]
        except ObjectTooLargeError:  # grew since its size was read
            got = None
        except ObjectNotFoundError:  # deleted since its size was read
            raise _missing(store, key, where, unchanged) from None
        if got != f["size"]:
            raise RegistryError(
                f"{where}: {store.url}/{key} changed while it was read (it no longer holds the {f['size']} bytes "
                f"recorded); {unchanged}: download again"
            )
        if hasher.hexdigest() != f["sha256"]:
            raise RegistryError(
                f"{where} does not match its sha256: {store.url}/{key} holds other bytes of its size (rotted or "
                f"overwritten); {unchanged}: {_REBUILD}"
            )
        out.flush()
        os.fsync(out.fileno())
