"""Saving over a step: the one case in which a manifest already there may be moved aside.

A save commits by creating its manifest create-only, so of two writers only one commits.
A manifest already at the step is moved aside (into quarantine) only when it is proved
damaged: its whole checkpoint is verified as restore checks it (``catalog.verify_checkpoint``)
and found damaged. One that verifies stays, whoever wrote it and whatever an earlier
restore said of it (``CheckpointExistsError``); one that cannot be read proves nothing
(``StoreUnavailableError``), nor does one a newer ckptflow wrote (``NewerFormatError``).
Either way nothing changes.

When. Before the save writes anything (``check_step``), so a save over a valid commit
costs nothing, and again at commit (``commit_manifest``), under the run's lock, where the
manifest is read once more: the version proved damaged when the save began is moved aside,
any other (a commit made meanwhile) is verified then, and refused if it verifies. Nothing
moves before the commit, so a save that fails on the way changes nothing. (The version
proved damaged at the start is not verified again at commit: a save that replays the
training bit for bit rewrites the damaged chunk with the right bytes, and that repair is
the save's own doing.) A refused save leaves only its chunks (content-addressed) and rank
records named by its own save id, which no manifest names; GC reclaims both.

What holds where. On a local store the run's lock (``Store.locked``: a ``flock`` the
kernel drops when its holder dies) serialises every commit that finds a manifest at its
step, across threads and processes; the move deletes only the version read
(``Store.delete_if``: a rename takes exactly one file, then it is compared). A save that
finds no manifest commits without the lock: it can only create one where none is, and a
replacing save sees that as a failed create and verifies what was created. On S3 there is
no lock: several saves may verify the same damaged manifest, but the conditional delete
(``If-Match``) removes only the version read and the create-only put lets exactly one
commit; the others find the winner's manifest, verify it and refuse.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import quarantine
from ckptflow.chunks import leases
from ckptflow.chunks.leases import save_lease
from ckptflow.errors import (
    CheckpointExistsError,
    CkptflowError,
    ManifestError,
    NewerFormatError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreError,
    StoreUnavailableError,
)
from ckptflow.format import layout as fmt
from ckptflow.format import sealed
from ckptflow.format.manifest import Manifest
from ckptflow.store.base import Store

log = logging.getLogger("ckptflow")
ROUNDS = 5  # a manifest that changes this often under the lock: give up rather than spin


def check_step(store: Store, run: str, step: int, pool: ThreadPoolExecutor, *, rejected: bool) -> str | None:
    """Before a save of ``run`` step ``step`` writes anything: None if the step holds no
    manifest, or the sha256 of the one there, proved damaged now (the commit moves it
    aside). A manifest that parses is refused at once unless ``rejected`` (this process's
    restore rejected the step); else its checkpoint is verified in full."""
    for _ in range(ROUNDS):
        found = _read(store, run, step)
        if found is None:
            return None
        digest = fmt.digest_of(found[0])
        if not rejected and _parses(found[0], run, step):
            raise _exists(store, run, step, digest, "; nothing was written")
        if _damage(store, run, step, digest, pool, "; nothing was written") is not None:
            return digest
    raise _unsettled(store, run, step)


def commit_manifest(
    store: Store, run: str, step: int, blob: bytes, pool: ThreadPoolExecutor, *, replaces: str | None
) -> None:
    """Create the manifest ``blob`` of ``run`` step ``step``. A manifest already there is
    moved aside first if it is the version ``replaces`` (``check_step`` proved it damaged)
    or is proved damaged now; otherwise the save is refused."""
    key = fmt.manifest_key(run, step)
    if store.put_if_absent(key, blob):
        return
    refused = (
        ": another writer committed the step while this save ran, so this save was not committed (its chunks and "
        "rank records are unreferenced; GC reclaims them)"
    )
    with store.locked(fmt.run_lock_key(run)):
        for _ in range(ROUNDS):
            found = _read(store, run, step)
            if found is not None:
                existing, version = found
                digest = fmt.digest_of(existing)
                damage = "proved damaged when this save began" if digest == replaces else None
                damage = damage or _damage(store, run, step, digest, pool, refused)
                if damage is None:
                    continue  # changed since it was read: look again
                moved = quarantine.move_aside(store, run, step, existing, version)
                if moved is None:
                    continue
                log.warning("moved the damaged manifest of run %r step %d aside to %s: %s", run, step, moved, damage)
            if store.put_if_absent(key, blob):
                return
    raise _unsettled(store, run, step)


def confirm_commit(
    store: Store,
    manifest: Manifest,
    blob: bytes,
    *,
    lease: str,
    again: str,
    chunks: Store | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> None:
    """After the commit of ``manifest`` (sealed as ``blob``) in ``store`` by a writer whose
    ``lease`` was lost since it was last checked before the commit (the process stalled
    between the check and the put): a GC may have judged the writer dead and swept what the
    manifest names before it was there to mark. Under a fresh lease (so no GC sweeps now,
    and every later one marks the manifest) each chunk (in ``chunks``, default ``store``)
    and rank record it names is looked for: all there, the commit stands; any gone, the
    manifest is moved to quarantine and ``StoreUnavailableError`` says to ``again`` (the
    work: save, archive), nothing committed; one that cannot be moved (its run's lock or
    the store refused: an ``OSError`` of a local store, or an outage) stays committed, and
    the error says so."""
    chunks = store if chunks is None else chunks
    key = fmt.manifest_key(manifest.run, manifest.step)
    wanted = [(chunks, fmt.chunk_key(digest)) for digest in sorted(manifest.chunks)]
    wanted += [(store, record) for record in manifest.rank_keys()]
    stuck: StoreError | OSError | None = None
    try:
        with save_lease(store, work=f"check of the commit {store.url}/{key}"):
            there = (pool.map if pool else map)(lambda w: w[0].exists(w[1]), wanted)
            gone = [k for (_, k), held in zip(wanted, there) if not held]
            if not gone:
                log.warning("%s in %s was lost while its manifest was committed; everything it names is stored, so "
                            "the commit stands", lease, store.url)  # fmt: skip
                return
            try:
                where = _set_aside(store, manifest, blob)
            except (StoreError, OSError) as e:  # checked, and found swept: not 'could not be checked'
                stuck = e
    except StoreUnavailableError as e:
        raise StoreUnavailableError(
            f"{lease} in {store.url} was lost while its manifest was committed, and whether a GC swept what it names "
            f"could not be checked ({e}): run 'ckptflow verify' on it, and {again} again if it is damaged"
        ) from e
    swept = (
        f"{lease} in {store.url} was lost while its manifest was committed (the process stalled for over "
        f"{leases.DEAD_AFTER / 2:.0f} s), and a GC swept {len(gone)} object(s) it names ({gone[0]})"
    )
    if stuck is not None:
        said = str(stuck) if isinstance(stuck, CkptflowError) else f"{type(stuck).__name__}: {stuck}"
        raise StoreUnavailableError(
            f"{swept}; the manifest could not be moved aside ({said}), so it stays committed at {store.url}/{key}, "
            f"naming what is gone: run 'ckptflow verify' on it, and {again} again once the store takes writes"
        ) from stuck
    raise StoreUnavailableError(f"{swept}; the manifest was {where}, so nothing was committed: {again} again")


def _set_aside(store: Store, manifest: Manifest, blob: bytes) -> str:
    """Move the manifest ``blob`` just committed to quarantine; where it is now, in words.
    Another process may have changed it since the put (a save of the step that proved it
    damaged committed its own), or removed it (retention expired it; such a save moved it
    aside and has not committed yet): either way it is no longer this writer's to move."""
    key = fmt.manifest_key(manifest.run, manifest.step)
    gone = f"already gone from {store.url}/{key} (expired, or moved aside by another save of the step)"
    with store.locked(fmt.run_lock_key(manifest.run)):  # as every move is made (``commit_manifest``)
        try:
            found, version = store.get_versioned(key, sealed.MAX_RECORD_BYTES)
        except ObjectNotFoundError:
            return gone
        if found == blob:
            moved = quarantine.move_aside(
                store, manifest.run, manifest.step, blob, version, sole_mover=store.locks_exclude
            )
            if moved:
                return f"moved to {store.url}/{moved}"
            if not store.exists(key):  # removed between the read and the conditional delete
                return gone
    return f"changed since, and left as it is at {store.url}/{key}"


def _read(store: Store, run: str, step: int) -> tuple[bytes, str] | None:
    """The manifest at the step and its version; None if there is none."""
    key = fmt.manifest_key(run, step)
    try:
        return store.get_versioned(key, sealed.MAX_RECORD_BYTES)
    except ObjectNotFoundError:
        return None
    except ObjectTooLargeError as e:
        raise CkptflowError(
            f"{e}: no ckptflow manifest is that large, so it is corrupt or hostile, and too large to move into "
            f"quarantine here; nothing of this save of run {run!r} step {step} was committed: move it out of the "
            "store by hand, then save again"
        ) from None
    except StoreError:  # says what could not be read, and why (denied, cold, a link)
        raise
    except OSError as e:
        raise _unavailable(store, run, step, f"{type(e).__name__}: {e}") from e


def _parses(blob: bytes, run: str, step: int) -> bool:
    try:
        Manifest.parse(blob, "manifest", run=run, step=step)
    except (ManifestError, NewerFormatError):  # verified in full next
        return False
    return True


def _damage(store: Store, run: str, step: int, digest: str, pool: ThreadPoolExecutor, outcome: str) -> str | None:
    """What proves the checkpoint whose manifest has sha256 ``digest`` damaged; None if its
    manifest changed meanwhile. Raises if it verifies (``outcome`` says what became of
    the save), or if it could not be read."""
    report = catalog.verify_checkpoint(store, run, step, pool, deep=False)
    if report.digest == digest and report.damaged:
        return "; ".join(report.problems)
    if report.newer is not None:
        raise NewerFormatError(
            f"step {step} of run {run!r} in {store.url} holds a checkpoint a newer ckptflow wrote, which this one "
            f"cannot verify, so it is neither replaced nor moved aside: {report.newer.message}. This save was not "
            "committed: save under another step, or upgrade ckptflow"
        )
    if report.unavailable:
        raise _unavailable(store, run, step, "; ".join(report.problems))
    if report.digest != digest:
        return None
    raise _exists(store, run, step, digest, f" and that checkpoint verifies{outcome}")


def _exists(store: Store, run: str, step: int, digest: str, outcome: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"step {step} of run {run!r} is already committed in {store.url}/{fmt.manifest_key(run, step)} "
        f"(manifest sha256 {digest}){outcome}: save under a new step, or expire it first (ckptflow.lifecycle.expire, "
        "as the retention job does; gc deletes no commit)"
    )


def _unavailable(store: Store, run: str, step: int, detail: str) -> StoreUnavailableError:
    return StoreUnavailableError(
        f"could not read the checkpoint already committed at step {step} of run {run!r} in {store.url}, so this "
        f"save cannot tell whether it is damaged and may be replaced: {detail}. Nothing was changed and this save "
        "was not committed: save again when the store can be read"
    )


def _unsettled(store: Store, run: str, step: int) -> CkptflowError:
    return CkptflowError(
        f"the manifest at {store.url}/{fmt.manifest_key(run, step)} changed {ROUNDS} times while this save of run "
        f"{run!r} step {step} looked at it; nothing of this save was committed: find what else writes that step, "
        "then save again"
    )
