"""Expiry: delete one checkpoint's records from a store. Chunks are left to GC, which
knows what else references them."""

from __future__ import annotations

from ckptflow.catalog.ledger import record_expiry
from ckptflow.catalog.verdicts import commit_record_keys
from ckptflow.errors import CkptflowError, ExpireError, ObjectNotFoundError
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.format.sealed import MAX_RECORD_BYTES
from ckptflow.store.base import Store


def expire(store: Store, run: str, step: int, *, keep_records: bool = False) -> list[str]:
    """Delete the commit record first (the checkpoint stops existing at once), then every
    other object of the step, then the lifecycle records of that commit (those keyed by
    its manifest's digest) unless ``keep_records`` (a hot copy expired while the archive
    keeps the checkpoint: its verdicts still describe it). Records of another commit of
    the step stay: an archive copy of an earlier commit is still described by them.
    Before that, the commit goes into the ledger of expired checkpoints (``ledger``).

    Raises ``ExpireError`` naming what is left if any delete fails, or, deleting nothing,
    when the commit record cannot be read (a store that did not answer); calling again
    after the cause is fixed finishes the job (the records of a commit whose record
    is already gone then stay: keyed by a digest no tier holds, they describe nothing).
    Returns the keys deleted.
    """
    manifest_key = fmt.manifest_key(run, step)
    try:
        blob: bytes | None = store.get_bounded(manifest_key, MAX_RECORD_BYTES)
    except ObjectNotFoundError:
        blob = None
    except CkptflowError as e:
        raise ExpireError(
            f"could not read {store.url}/{manifest_key}, so nothing of {run} step {step} was deleted: {e}"
        ) from e
    if blob is not None:
        try:  # the cost model's "retention saved" counts what expiry removed
            record_expiry(store, Manifest.parse(blob, f"manifest {store.url}/{manifest_key}", run=run, step=step))
        except CkptflowError:
            pass  # a damaged commit record: nothing to account for
    keys = [manifest_key] + sorted(i.key for i in store.list(fmt.step_prefix(run, step)) if i.key != manifest_key)
    if blob is not None and not keep_records:
        keys += commit_record_keys(store, run, step, fmt.digest_of(blob))
    failed: list[str] = []
    for key in keys:
        try:
            store.delete(key)
        except (CkptflowError, OSError) as e:
            if key == manifest_key:
                raise ExpireError(
                    f"could not delete the commit record {store.url}/{key}, so checkpoint {run} step "
                    f"{step} still exists: {e}"
                ) from e
            failed.append(f"{key} ({e})")
    if failed:
        raise ExpireError(
            f"checkpoint {run} step {step} no longer exists in {store.url}, but {len(failed)} of its "
            f"objects could not be deleted: {'; '.join(failed[:5])}; run the expiry again"
        )
    return keys
