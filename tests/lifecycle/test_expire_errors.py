"""What an expiry that failed part way says is left, and who finishes it: only promises that hold."""

import pytest
import torch

from ckptflow import Checkpointer, ExpireError, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import ledger
from ckptflow.catalog.verdicts import step_record_keys
from ckptflow.format import layout as fmt
from ckptflow.store import open_store
from support.faulty_store import FaultyStore


def _store(tmp_path):
    torch.manual_seed(0)
    root = str(tmp_path / "store")
    with Checkpointer(root, "r", chunk_bytes=4096) as ck:
        ck.save(1, {"model": torch.nn.Linear(64, 64)})
    return open_store(root)


@pytest.mark.parametrize("keep_digests", [None, ()])
def test_the_expiry_error_promises_only_what_finishes_the_job(tmp_path, keep_digests):
    """``ExpireError`` said "the next retention (or this expiry again) finishes its lifecycle
    records". Called again as it was the first time without ``keep_digests``, the expiry
    finds no commit record, so it knows no digest and deletes none of them: the message
    sent an operator to a retry that does nothing. With ``keep_digests`` a retry does
    finish them; without, the ledger's mark is what the next retention finishes them by."""
    store = _store(tmp_path)
    lifecycle.validate(store, "r", 1)
    digest = catalog.read_manifest(store, "r", 1).digest
    [record] = step_record_keys(store, "r", 1, only=digest)
    faulty = FaultyStore(store)
    faulty.fail_if = lambda op, key: op == "delete" and key == record
    with pytest.raises(ExpireError) as raised:
        lifecycle.expire(faulty, "r", 1, keep_digests=keep_digests)
    message = str(raised.value)
    assert not store.exists(fmt.manifest_key("r", 1)) and store.exists(record)
    assert ("r", 1, digest) in [entry[:3] for entry in ledger.unfinished_expiries(store)]  # the next retention's
    faulty.fail_if = lambda op, key: False
    lifecycle.expire(faulty, "r", 1, keep_digests=keep_digests)  # "this expiry again", the cause fixed
    if keep_digests is None:
        assert store.exists(record)  # no digest known: nothing of the records goes
        assert "this expiry again" not in message, message
    else:
        assert not store.exists(record) and "this expiry again with the same keep_digests" in message
