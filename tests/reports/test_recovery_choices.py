"""The inventory says, per run, what each selector would recover to now (validated, best),
by the rule restore applies."""

from __future__ import annotations

import pytest
from torch import nn

from ckptflow import Checkpointer, lifecycle
from ckptflow.format.layout import READABLE_FORMATS
from ckptflow.reports import inventory
from ckptflow.store import open_store
from support.corrupt import chunk_path, flip_byte, only_in, reseal_manifest


def test_each_run_shows_its_latest_validated_and_best_checkpoint(tmp_path):
    root = str(tmp_path / "store")
    for run, losses in (("a", {1: 0.5, 2: 0.2, 3: 0.4}), ("b", {7: 0.9})):
        with Checkpointer(root, run) as ck:
            for step, loss in losses.items():
                ck.save(step, {"model": nn.Linear(2, 2)}, metadata={"val_loss": loss})
    store = open_store(root)
    for step in (1, 2):
        lifecycle.validate(store, "a", step)
    for step in (1, 2, 3):
        lifecycle.evaluate(store, store, "a", step)
    rows = inventory.recovery_choices(store, inventory.collect(store))
    assert rows == [
        {"run": "a", "latest": 3, "validated": 2, "best": 2, "best_by": "best:val_loss:min"},
        {"run": "b", "latest": 7, "validated": None, "best": 7, "best_by": "best:val_loss:min"},  # its trainer's
    ]
    rows = inventory.recovery_choices(store, inventory.collect(store), metric="val_loss", mode="max")
    assert rows[0]["best"] == 1


@pytest.mark.parametrize("again", ["newer format", "new commit"])
def test_a_validated_commit_the_archive_holds_behind_another_hot_commit_is_what_validated_recovers_to(tmp_path, again):
    """Step 2 validated and archived, then committed again in the hot store: restore's
    "validated" recovers the archive copy (tests/training/test_select.py), and the
    inventory says so rather than naming step 1."""
    root = str(tmp_path / "store")
    with Checkpointer(root, "a") as ck:
        for step in (1, 2):
            ck.save(step, {"model": nn.Linear(2, 2)}, metadata={"val_loss": 0.5})
    hot, archive = open_store(root), open_store(str(tmp_path / "archive"))
    for step in (1, 2):
        lifecycle.validate(hot, "a", step)
        assert lifecycle.archive(hot, archive, "a", step).ok
    if again == "newer format":
        reseal_manifest(root, "a", 2, lambda record: record.update(format_version=max(READABLE_FORMATS) + 1))
    else:
        flip_byte(chunk_path(root, only_in(root, "a", 2)[0]))
        with Checkpointer(root, "a") as ck:
            ck.restore({"model": nn.Linear(2, 2)})  # rejects step 2: a save may replace it
            ck.save(2, {"model": nn.Linear(2, 2)}, metadata={"val_loss": 0.1})
    [row] = inventory.recovery_choices(hot, inventory.collect(hot, archive))
    assert row["validated"] == 2
    assert row["latest"] == ("stops at 2 (unreadable)" if again == "newer format" else 2)
    with Checkpointer(root, "a", tiers=[archive.root]) as ck:
        assert ck.restore({"model": nn.Linear(2, 2)}, select="validated").step == 2
    [row] = inventory.recovery_choices(hot, inventory.collect(hot))  # without the archive: only step 1 was validated
    assert row["validated"] == 1
