"""A commit made by a writer whose lease was lost (``ckptflow.catalog.commit.confirm_commit``):
what it names is looked for under a fresh lease; if a GC swept any of it, the manifest goes
to quarantine and the save fails with nothing committed."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from ckptflow import Checkpointer, StoreUnavailableError, gc, open_store
from ckptflow.catalog.commit import confirm_commit
from ckptflow.chunks import leases
from ckptflow.errors import StoreError, StoreFullError
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.lifecycle.expire import expire
from support.faulty_store import FaultyStore
from support.refused import unwritable

RUN = "r"


def _step_one_committed(tmp_path):
    """A store holding run ``RUN`` step 1, its manifest's key, bytes and parsed form."""
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN) as ck:
        ck.save(1, {"w": torch.arange(64.0)})
    store = open_store(root)
    key = fmt.manifest_key(RUN, 1)
    blob = store.get(key)
    return store, key, blob, Manifest.parse(blob, key)


def test_a_commit_removed_by_another_process_before_its_check_is_told_not_committed(tmp_path):
    """The writer stalled past its lease; meanwhile retention expired the step it had just
    committed and a GC swept its chunks. Confirming the commit used to let the bare
    ``ObjectNotFoundError`` of the manifest's re-read escape ('... manifest.json does not
    exist'), which said neither that nothing was committed nor what to do."""
    store, key, blob, manifest = _step_one_committed(tmp_path)
    expire(store, RUN, 1)
    assert gc(store, grace=0, now=time.time() + 5).deleted  # its chunks are swept
    before = sorted(i.key for i in store.list(""))

    with pytest.raises(StoreUnavailableError) as raised:
        confirm_commit(store, manifest, blob, lease=f"the save lease of run {RUN!r} step 1", again="save")

    message = str(raised.value)
    assert f"the manifest was already gone from {store.url}/{key}" in message, message
    assert "expired, or moved aside by another save of the step" in message
    assert message.endswith("so nothing was committed: save again")
    assert sorted(i.key for i in store.list("")) == before  # it changed nothing, its lease released


def test_a_swept_commit_says_the_lease_timing_in_force(tmp_path, monkeypatch):
    """The stall it names is half of ``DEAD_AFTER`` as set when the check runs (a process
    that sets a shorter one, as the stalled-save tests' children do); it used to name the
    value imported when the module loaded (15 s)."""
    monkeypatch.setattr(leases, "DEAD_AFTER", 8.0)
    store, key, blob, manifest = _step_one_committed(tmp_path)
    store.delete(fmt.chunk_key(sorted(manifest.chunks)[0]))  # what a GC that judged the writer dead swept

    with pytest.raises(StoreUnavailableError, match=r"the process stalled for over 4 s\)") as raised:
        confirm_commit(store, manifest, blob, lease=f"the save lease of run {RUN!r} step 1", again="save")
    assert "moved to" in str(raised.value) and not store.exists(key)


@pytest.mark.parametrize("locks_exclude", [True, False], ids=["local lock", "lock holds nothing (S3)"])
@pytest.mark.parametrize("meanwhile", ["expired", "committed again"])
def test_a_manifest_removed_while_it_is_set_aside_is_said_to_be_so_and_no_copy_stays(
    tmp_path, meanwhile, locks_exclude
):
    """The manifest is removed (retention expired it; a save may have committed the step
    again) between the read that finds it and the conditional delete that moves it aside:
    the message said 'changed since, and left as it is' although it was gone, and the
    quarantine copy the failed move made stayed, evidence of a quarantine that never was.
    Where the run's lock holds nothing (S3), another save moving the same version aside may
    have taken that copy for its own: it stays."""
    inner, key, blob, manifest = _step_one_committed(tmp_path)
    inner.delete(fmt.chunk_key(sorted(manifest.chunks)[0]))  # what a GC that judged the writer dead swept
    store = FaultyStore(inner)
    store.locks_exclude = locks_exclude  # one thread here: no other mover, whatever the lock holds

    def remove_first(op: str, name: str) -> bool:
        if op == "delete" and name == key and inner.exists(key):  # the move's conditional delete, about to run
            inner.delete(key)
            if meanwhile == "committed again":
                inner.put_if_absent(key, b"another save's commit")
        return False

    store.fail_if = remove_first
    before = sorted(i.key for i in inner.list("") if i.key != key)
    with pytest.raises(StoreUnavailableError) as raised:
        confirm_commit(store, manifest, blob, lease=f"the save lease of run {RUN!r} step 1", again="save")

    message = str(raised.value)
    said = "changed since, and left as it is at" if meanwhile == "committed again" else "already gone from"
    assert f"the manifest was {said} {inner.url}/{key}" in message, message
    copies = [i.key for i in inner.list(f"runs/{RUN}/quarantine/")]
    if locks_exclude:
        assert not copies, "the failed move left its copy"
        assert sorted(i.key for i in inner.list("") if i.key != key) == before
    else:
        assert len(copies) == 1, "a copy another mover may hold as its own was deleted"


class ReReadUnavailable(FaultyStore):
    """A store whose read of the manifest, as ``_set_aside`` reads it to move it, does not answer."""

    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str]:
        raise StoreUnavailableError(f"{self.url}/{key}: the store did not answer")


class QuarantineRefused(FaultyStore):
    """A store that refuses the quarantine copy ``_set_aside`` writes: full (``StoreFullError``)
    or denied (an S3 AccessDenied is a plain ``StoreError``)."""

    error: StoreError = StoreError("")

    def put_if_absent(self, key: str, data) -> bool:
        if "/quarantine/" in key:
            raise self.error
        return super().put_if_absent(key, data)


@pytest.mark.parametrize(
    "refused",
    ["run lock denied", "re-read raises OSError", "re-read unavailable", "copy: store full", "copy: access denied"],
)
def test_a_swept_commit_that_cannot_be_moved_aside_says_it_stays_committed(tmp_path, refused):
    """GC swept what the manifest names, and moving it aside failed: its run's lock file
    could not be made (a raw ``PermissionError: [Errno 1] Operation not permitted: '.../locks/runs'``
    escaped the save and the archival, told as no ckptflow error), or the store failed the
    manifest's re-read (an outage was told 'whether a GC swept what it names could not be
    checked', though it was checked). Either way the manifest stays committed: said so."""
    root = tmp_path / "store"
    with Checkpointer(str(root), RUN) as ck:
        ck.save(1, {"w": torch.arange(64.0)})
    inner = open_store(str(root))
    key = fmt.manifest_key(RUN, 1)
    blob = inner.get(key)
    manifest = Manifest.parse(blob, key)
    swept = fmt.chunk_key(sorted(manifest.chunks)[0])
    inner.delete(swept)  # what a GC that judged the writer dead swept
    store = ReReadUnavailable(inner) if refused == "re-read unavailable" else FaultyStore(inner)
    if refused.startswith("copy:"):
        store = QuarantineRefused(inner)
        store.error = (
            StoreFullError(f"{inner.url}: no space left on device", needed=len(blob))
            if refused == "copy: store full"
            else StoreError(f"{inner.url}: S3 PutObject failed: AccessDenied")
        )
    if refused == "re-read raises OSError":
        store.fail_if = lambda op, name: op == "get" and name == key
    (root / "locks" / "leases").mkdir(parents=True)  # the fresh lease is written; only the run's lock is refused
    lease = f"the save lease of run {RUN!r} step 1"
    with unwritable(root / "locks") if refused == "run lock denied" else contextlib.nullcontext():
        with pytest.raises(StoreUnavailableError) as raised:
            confirm_commit(store, manifest, blob, lease=lease, again="save")

    message = str(raised.value)
    assert f"a GC swept 1 object(s) it names ({swept}); the manifest could not be moved aside (" in message, message
    assert f"so it stays committed at {inner.url}/{key}, naming what is gone" in message, message
    assert "could not be checked" not in message, message
    assert inner.get(key) == blob and not list(inner.list(f"runs/{RUN}/quarantine/"))
