"""The one way tests damage a store: flip a byte of a file, found by checkpoint and tensor."""

from __future__ import annotations

import os
from pathlib import Path

from ckptflow import catalog, catalog_listing
from ckptflow import format as fmt
from ckptflow.store import open_store


def flip_byte(path: str | os.PathLike, offset: int = -1) -> None:
    """XOR one byte of ``path`` with 0xFF (``offset`` from the start, or from the end if negative)."""
    blob = bytearray(Path(path).read_bytes())
    blob[offset] ^= 0xFF
    Path(path).write_bytes(bytes(blob))


def chunk_path(root: str | os.PathLike, digest: str) -> Path:
    return Path(root) / fmt.chunk_key(digest)


def chunks_of(root: str | os.PathLike, run: str, step: int) -> dict[str, int]:
    """digest -> raw length of every chunk ``(run, step)`` needs."""
    return dict(catalog.read_manifest(open_store(os.fspath(root)), run, step).chunks)


def only_in(root: str | os.PathLike, run: str, step: int, *others: int) -> list[str]:
    """Chunks of ``step`` that none of the ``others`` steps use, sorted."""
    used = set().union(*(chunks_of(root, run, s) for s in others)) if others else set()
    return sorted(set(chunks_of(root, run, step)) - used)


def tensor_chunk(root: str | os.PathLike, run: str, step: int, fqn: str) -> str:
    """The first chunk of tensor ``fqn`` in ``(run, step)``."""
    manifest = catalog.read_manifest(open_store(os.fspath(root)), run, step)
    (item,) = [i for i in manifest.items() if i.fqn == fqn]
    return item.chunks[0][0]


def corrupt_chunk(root: str | os.PathLike, run: str, step: int, digest: str | None = None) -> str:
    """Flip the last byte of a chunk of ``(run, step)``: ``digest``, or by default the first
    (by digest) that no other checkpoint of the run uses, so only this one is damaged."""
    if digest is None:
        others = [s for s in catalog_listing.committed_steps(open_store(os.fspath(root)), run) if s != step]
        digest = only_in(root, run, step, *others)[0]
    flip_byte(chunk_path(root, digest))
    return digest


def manifest_path(root: str | os.PathLike, run: str, step: int) -> Path:
    return Path(root) / fmt.manifest_key(run, step)


def reseal_manifest(root: str | os.PathLike, run: str, step: int, mutate) -> None:
    """Apply ``mutate`` to the manifest's JSON and seal it again: a record whose checksum
    is valid but whose content a buggy or hostile writer got wrong."""
    import json

    from ckptflow.sealed import seal

    path = manifest_path(root, run, step)
    record = json.loads(path.read_bytes())
    record.pop("checksum")
    mutate(record)
    path.write_bytes(seal(record))


def grow_first_tensor(record: dict) -> None:
    """Make the first tensor one row larger than its shards cover."""
    tensor = next(iter(record["dcp"]["tensors"].values()))
    tensor["size"][0] += 1


def rank_files(store, run: str, step: int) -> set[str]:
    """Keys of every rank record under a step (whichever save attempt wrote them)."""
    from ckptflow.store import open_store as _open

    store = _open(os.fspath(store)) if isinstance(store, (str, os.PathLike)) else store
    return {info.key for info in store.list(fmt.step_prefix(run, step) + "ranks/")}
