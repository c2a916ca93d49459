"""An expiry racing a save of the same step: the expiry deletes only the commit it read,
even where it could not read it (gone already, or too large to be a record)."""

from __future__ import annotations

import importlib

import pytest
import torch

from ckptflow import Checkpointer, ExpireError, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.format import layout as fmt
from ckptflow.store import open_store
from support.faulty_store import FaultyStore

expire_module = importlib.import_module("ckptflow.lifecycle.expire")  # the package exports the function
RECORD_BOUND = 1 << 16  # stands in for MAX_RECORD_BYTES (1 GiB): a commit record larger is damage


class SavingAfterRead(FaultyStore):
    """Runs ``save`` once, right after the expiry's read of the commit record (``op``)
    returned or raised: a save of the step that lands in the expiry's window."""

    def __init__(self, inner, op: str, save):
        super().__init__(inner)
        self.op, self.save = op, save

    def _after(self, op: str) -> None:
        if op == self.op and self.save is not None:
            save, self.save = self.save, None
            save()

    def get_versioned(self, key, limit=None):
        try:
            return super().get_versioned(key, limit)
        finally:
            self._after("get_versioned")

    def version_and_size(self, key):
        try:
            return super().version_and_size(key)
        finally:
            self._after("version_and_size")


def _saved(root: str):
    torch.manual_seed(0)
    with Checkpointer(root, "r", chunk_bytes=4096) as ck:
        ck.save(1, {"model": torch.nn.Linear(64, 64)})
    return open_store(root)


def _save_again(root: str):
    def save():
        torch.manual_seed(1)
        with Checkpointer(root, "r", chunk_bytes=4096) as ck:
            ck.save(1, {"model": torch.nn.Linear(64, 64)})

    return save


@pytest.mark.parametrize("window", ["get_versioned", "version_and_size"])
def test_an_oversized_damaged_commit_is_deleted_only_while_it_is_that_object(tmp_path, monkeypatch, window):
    """A commit record larger than any record is damage; its version could not be read with
    its bytes, so the expiry deleted whatever was at the key, unconditionally. A save that
    replaced the damaged commit meanwhile (quarantine, then a valid commit) lost its commit."""
    monkeypatch.setattr(expire_module, "MAX_RECORD_BYTES", RECORD_BOUND)
    root = str(tmp_path / "store")
    store = _saved(root)
    store.replace(fmt.manifest_key("r", 1), b"\0" * (RECORD_BOUND + 1))
    racing = SavingAfterRead(store, window, _save_again(root))
    with pytest.raises(ExpireError, match="committed again while checkpoint r step 1 was being expired"):
        lifecycle.expire(racing, "r", 1)
    saved = catalog.read_manifest(store, "r", 1)
    assert all(store.exists(key) for key in saved.rank_keys())
    assert catalog.verify_checkpoint(store, "r", 1).ok


def test_an_oversized_damaged_commit_nobody_replaced_is_expired(tmp_path, monkeypatch):
    monkeypatch.setattr(expire_module, "MAX_RECORD_BYTES", RECORD_BOUND)
    store = _saved(str(tmp_path / "store"))
    store.replace(fmt.manifest_key("r", 1), b"\0" * (RECORD_BOUND + 1))
    lifecycle.expire(store, "r", 1)
    assert not store.exists(fmt.manifest_key("r", 1))
    assert not list(store.list(fmt.step_prefix("r", 1)))  # its rank records, written before it, went too


def test_a_retried_expiry_leaves_a_commit_made_after_it_found_none(tmp_path):
    """The expiry is retried after its commit record went; the job saves the step again in
    between the retry's read (nothing there) and its delete. The retry deleted the new
    commit, and the new save's rank records as older than it."""
    root = str(tmp_path / "store")
    store = _saved(root)
    lifecycle.expire(store, "r", 1)
    racing = SavingAfterRead(store, "get_versioned", _save_again(root))
    lifecycle.expire(racing, "r", 1)
    saved = catalog.read_manifest(store, "r", 1)
    assert all(store.exists(key) for key in saved.rank_keys())
    assert catalog.verify_checkpoint(store, "r", 1).ok
