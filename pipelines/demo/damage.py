"""The demo's deliberate damage: flip one byte of a chunk only the newest checkpoint uses,
so restore must skip it and the lifecycle's integrity check must block it."""

from __future__ import annotations

import os

from ckptflow.catalog import checkpoints as catalog
from ckptflow.format import layout as fmt
from ckptflow.store import open_store


def corrupt_newest(root: str, run: str) -> int:
    """Damage the newest checkpoint of ``run`` in the local store at ``root``; returns its step."""
    store = open_store(root)
    infos = catalog.list_checkpoints(store, run)
    newest = infos[-1]
    chunks = lambda step: set(catalog.read_manifest(store, run, step).chunks)
    older = set().union(*(chunks(i.step) for i in infos[:-1])) if len(infos) > 1 else set()
    victim = min(chunks(newest.step) - older)
    path = os.path.join(root, fmt.chunk_key(victim))
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    return newest.step
