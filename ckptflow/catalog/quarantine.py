"""Quarantine: a manifest proved damaged, moved aside before its step is saved again.

The damaged manifest is the evidence of what went wrong: it is copied to
``runs/<run>/quarantine/<step>-<digest>.json``, named by the sha256 of its bytes (the
commit the copy belongs to), and deleted only once that copy is known to hold those
bytes, and only if the manifest is still exactly that version. Two rejections of one
step never share a key unless they are the same bytes, however close together they
happen. Who may move a manifest aside, and when, is decided in ``ckptflow.catalog.commit``.
"""

from __future__ import annotations

from ckptflow.errors import ObjectNotFoundError
from ckptflow.format import layout as fmt
from ckptflow.store.base import Store


def move_aside(store: Store, run: str, step: int, blob: bytes, version: str, *, sole_mover: bool = False) -> str | None:
    """Copy ``blob``, the manifest of ``run`` step ``step`` read as ``version``, into
    quarantine, then delete the manifest if it is still that version: the copy's key, or
    None if the manifest changed in between (then it is left as it is). A copy already
    there with other bytes (damaged) is replaced first; any error leaves the manifest.
    A copy this call wrote stays when the move fails: another save moving the same version
    aside may have found it there and taken it for its own. With ``sole_mover`` (the caller
    holds the run's lock, ``fmt.run_lock_key``, under which every move is made, and the
    store's locks exclude others: ``Store.locks_exclude``) it goes, and the failed move
    leaves nothing: the version was removed otherwise (retention expired it)."""
    target = fmt.quarantine_key(run, step, fmt.digest_of(blob))
    wrote = store.put_if_absent(target, blob)
    if not wrote and not _holds(store, target, blob):
        store.replace(target, blob)
        wrote = True
    if store.delete_if(fmt.manifest_key(run, step), version):
        return target
    if wrote and sole_mover:
        store.delete(target)
    return None


def _holds(store: Store, key: str, blob: bytes) -> bool:
    try:
        return store.get(key) == blob
    except ObjectNotFoundError:  # deleted since: write it again
        return False
