"""Quarantine: a rejected commit record moved aside before its step is saved again.

A manifest that restore rejected, or that does not parse, is the evidence of what went
wrong: it is copied to ``runs/<run>/quarantine/<step>-<digest>.json``, named by the
sha256 of its bytes (the commit the copy belongs to), and deleted only once that copy is
known to hold those bytes. Two rejections of one step never share a key unless they are
the same bytes, however close together they happen.
"""

from __future__ import annotations

from ckptflow import format as fmt
from ckptflow.errors import ObjectNotFoundError
from ckptflow.store.base import Store


def move_aside(store: Store, run: str, step: int) -> str:
    """Copy the manifest of ``run`` step ``step`` into quarantine, then delete it; the
    copy's key. A copy already there with other bytes (damaged) is replaced first; any
    error leaves the manifest where it was."""
    key = fmt.manifest_key(run, step)
    blob = store.get(key)
    target = fmt.quarantine_key(run, step, fmt.digest_of(blob))
    if not store.put_if_absent(target, blob) and not _holds(store, target, blob):
        store.replace(target, blob)
    store.delete(key)
    return target


def _holds(store: Store, key: str, blob: bytes) -> bool:
    try:
        return store.get(key) == blob
    except ObjectNotFoundError:  # deleted since: write it again
        return False
