"""Archival into a tier whose garbage collection outlives the wait: the tier is busy for
now (retried as an outage), the error names the archival, and nothing is written there."""

import pytest
import torch
from torch import nn

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.verdicts import Subject, read_record
from ckptflow.chunks import leases
from ckptflow.errors import StoreUnavailableError
from ckptflow.store import open_store


def test_an_archival_that_waited_out_a_live_gc_is_retried_as_busy_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(leases, "SAVE_WAIT", 0.3)
    hot, cold = open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "cold"))
    with Checkpointer(hot, "r") as ck:
        ck.save(1, {"model": nn.Linear(8, 4), "step": torch.tensor(1)})
    with leases.gc_lock(cold):  # a live GC of the archive tier: its heartbeat renews the lock
        with pytest.raises(StoreUnavailableError) as raised:
            lifecycle.archive(hot, cold, "r", 1)
    message = str(raised.value)
    assert "archival of run 'r' step 1 into" in message and "try the save again" not in message
    assert not list(cold.list("chunks/")) and not list(cold.list("runs/"))
    manifest = catalog.read_manifest(hot, "r", 1)
    assert read_record(hot, Subject.of(manifest), "archive") is None
