"""Expiry: delete one checkpoint's records from a store. Chunks are left to GC, which
knows what else references them."""

from __future__ import annotations

from collections.abc import Collection

from ckptflow.catalog import ledger
from ckptflow.catalog.verdicts import step_record_keys
from ckptflow.errors import CkptflowError, ExpireError, ObjectNotFoundError, ObjectTooLargeError, is_damage
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.format.sealed import MAX_RECORD_BYTES
from ckptflow.store.base import Store


def expire(
    store: Store,
    run: str,
    step: int,
    *,
    keep_records: bool = False,
    keep_digests: Collection[str] | None = None,
    commit: str | None = None,
) -> list[str]:
    """Delete the commit record first (the checkpoint stops existing at once), then the
    step's other objects that are the commit's (``_objects_of_commit``: never those of a
    save of the step in flight), then lifecycle records unless ``keep_records`` (a hot copy
    expired while the archive keeps the checkpoint: its verdicts still describe it).
    Which records: with ``keep_digests`` (the caller knows which commits another tier
    holds, as retention does), every record of the step but theirs; without, only those
    of the commit expired (a record of another commit, one an archive may hold, stays).
    Before that, the commit goes into the ledger of expired checkpoints (``ledger``).

    ``commit``: the digest of the commit decided on (a retention plan's). Another one read
    at the step (committed again since the decision: a restore rejected the commit decided
    on and training saved the step anew) is an ``ExpireError`` and nothing is deleted: the
    commit read is the one expired, and nobody decided about that one. ``""``: the commit
    decided on is one whose record did not read as a checkpoint (damaged: no digest names
    it), so one that reads as a checkpoint now was committed since (a restore rejected the
    damaged one and training saved the step anew) and is not expired either.

    A commit record that cannot be read for a reason that proves nothing (an outage) is
    an ``ExpireError`` and nothing is deleted. ``ExpireError`` also names what is left if
    any delete fails: the next retention finishes the lifecycle records of a commit whose
    record went (``ledger.expiry_begun``), and GC its rank records. Returns the keys deleted
    (the commit record's only where this call found it there).
    """
    manifest_key, what = fmt.manifest_key(run, step), f"checkpoint {run} step {step}"
    blob: bytes | None = None
    version: str | None = None  # the commit read, deleted only while it is still that one
    manifest: Manifest | None = None
    found = True  # a commit record is there to delete
    try:
        if store.compare_and_swap:
            blob, version = store.get_versioned(manifest_key, MAX_RECORD_BYTES)
        else:
            blob = store.get_bounded(manifest_key, MAX_RECORD_BYTES)
        if commit and fmt.digest_of(blob) != commit:
            raise _committed_again(store, manifest_key, what)
        manifest = Manifest.parse(blob, f"manifest {store.url}/{manifest_key}", run=run, step=step)
        if commit == "":  # the commit decided on did not read as a checkpoint: this one does
            raise _committed_again(store, manifest_key, what)
        ledger.record_expiry(store, manifest)
    except ObjectNotFoundError:  # gone already (an expiry retried): a commit made since is not this one
        found = False
    except ObjectTooLargeError:  # larger than any record (damage): deleted only while it is that object
        if commit:  # the commit decided on was read whole: this is another object
            raise _committed_again(store, manifest_key, what) from None
        version = _version_unread(store, manifest_key, what)
        found = version is not None or not store.compare_and_swap
    except ExpireError:
        raise
    except CkptflowError as e:
        if not is_damage(e):
            raise _unreadable(store, manifest_key, what, e) from e
    keys = _objects_of_commit(store, run, step, manifest) if found else []
    if not keep_records and keep_digests is not None:
        keys += step_record_keys(store, run, step, keep=keep_digests)
    elif not keep_records and blob is not None:  # a damaged record's digest names no record: none go
        keys += step_record_keys(store, run, step, only=fmt.digest_of(blob))
    begun = (
        ledger.expiry_begun(store, run, step, fmt.digest_of(blob)) if blob is not None and not keep_records else None
    )
    if found:
        _delete_commit(store, manifest_key, version, what)
    failed: list[str] = []
    for key in keys:
        try:
            store.delete(key)
        except (CkptflowError, OSError) as e:
            failed.append(f"{key} ({e})")
    if failed:
        grace = "once they are older than its grace period"
        # a retry finds no commit record, so it knows which records are this commit's only from keep_digests
        again = " (or this expiry again with the same keep_digests)" if keep_digests is not None else ""
        then = (
            f"GC deletes its rank records {grace}"
            if keep_records
            else f"the next retention{again} finishes its lifecycle records, and GC its rank records {grace}"
        )
        raise ExpireError(
            f"checkpoint {run} step {step} no longer exists in {store.url}, but {len(failed)} of its "
            f"objects could not be deleted: {'; '.join(failed[:5])}; {then}"
        )
    if begun is not None:
        ledger.expiry_done(store, begun)
    return [manifest_key, *keys] if found else keys


def _objects_of_commit(store: Store, run: str, step: int, manifest: Manifest | None) -> list[str]:
    """The step's objects that belong to the commit expired: the rank records it names, and
    anything written before its commit record (its records when it is damaged and names
    none, a failed attempt's). Anything newer may be a save of this step in flight (one
    replacing a damaged commit): its records stay. Without a commit record (an expiry
    retried after it went) nothing tells them apart, so none go: GC deletes stray rank
    records once they are older than its grace period."""
    infos = list(store.list(fmt.step_prefix(run, step)))
    commit = next((i for i in infos if i.key == fmt.manifest_key(run, step)), None)
    if commit is None:
        return []
    named = {i.key for i in infos if manifest is not None and manifest.rank_of(i.key) is not None}
    return sorted(i.key for i in infos if i is not commit and (i.mtime < commit.mtime or i.key in named))


def _version_unread(store: Store, key: str, what: str) -> str | None:
    """The version of a commit record too large to read (``Store.version_and_size``); None
    if it is gone, or where the store has no versions. One within the bound is another
    object: the step was committed again since the read."""
    if not store.compare_and_swap:
        return None
    try:
        version, size = store.version_and_size(key)
    except ObjectNotFoundError:
        return None
    except (CkptflowError, OSError) as e:
        raise _unreadable(store, key, what, e) from e
    if size <= MAX_RECORD_BYTES:
        raise _committed_again(store, key, what)
    return version


def _unreadable(store: Store, key: str, what: str, error: Exception) -> ExpireError:
    return ExpireError(f"could not read {store.url}/{key}, so nothing of {what} was deleted: {error}")


def _delete_commit(store: Store, key: str, version: str | None, what: str) -> None:
    """Delete the commit record ``key``, only while it is the ``version`` read (where the
    store can say): a damaged commit may be moved to quarantine and the step saved again
    between the read and the delete, and that new, valid commit is not the one expired."""
    try:
        if version is None:
            store.delete(key)
            return
        if store.delete_if(key, version) or not store.exists(key):
            return
    except (CkptflowError, OSError) as e:
        raise ExpireError(f"could not delete the commit record {store.url}/{key}, so {what} still exists: {e}") from e
    raise _committed_again(store, key, what)


def _committed_again(store: Store, key: str, what: str) -> ExpireError:
    return ExpireError(
        f"{store.url}/{key} was committed again while {what} was being expired, so nothing of it was deleted; "
        "the next retention plan decides about the new commit"
    )
