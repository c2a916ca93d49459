"""The inventory says, per run, what each selector would recover to now (validated, best),
by the rule restore applies."""

from __future__ import annotations

from torch import nn

from ckptflow import Checkpointer, lifecycle
from ckptflow.reports import inventory
from ckptflow.store import open_store


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
        {"run": "b", "latest": 7, "validated": None, "best": None, "best_by": "best:val_loss:min"},
    ]
    rows = inventory.recovery_choices(store, inventory.collect(store), metric="val_loss", mode="max")
    assert rows[0]["best"] == 1
