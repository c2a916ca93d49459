"""Expiry: delete one checkpoint's records from a store. Chunks are left to GC, which
knows what else references them."""

from __future__ import annotations

from collections.abc import Collection

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.ledger import record_expiry
from ckptflow.catalog.verdicts import step_record_keys
from ckptflow.errors import CkptflowError, ExpireError
from ckptflow.format import layout as fmt
from ckptflow.store.base import Store


def expire(
    store: Store, run: str, step: int, *, keep_records: bool = False, keep_digests: Collection[str] = ()
) -> list[str]:
    """Delete the commit record first (the checkpoint stops existing at once), then every
    other object of the step, then its lifecycle records unless ``keep_records`` (a hot
    copy expired while the archive keeps the checkpoint: its verdicts still describe it).
    ``keep_digests``: commits whose records stay all the same (another tier holds an
    earlier commit of the step). Before that, the commit goes into the ledger of expired
    checkpoints (``ledger``).

    Raises ``ExpireError`` naming what is left if any delete fails; calling again after
    the cause is fixed finishes the job. Returns the keys deleted.
    """
    try:  # the cost model's "retention saved" counts what expiry removed
        record_expiry(store, catalog.read_manifest(store, run, step))
    except CkptflowError:
        pass  # an unreadable commit record: nothing to account for
    manifest_key = fmt.manifest_key(run, step)
    keys = [manifest_key] + sorted(i.key for i in store.list(fmt.step_prefix(run, step)) if i.key != manifest_key)
    if not keep_records:
        keys += step_record_keys(store, run, step, keep_digests=keep_digests)
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
