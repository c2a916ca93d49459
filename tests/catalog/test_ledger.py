"""Ledger entries of another shape are damage the cost report leaves out, by name."""

from __future__ import annotations

import logging

import torch

from ckptflow import Checkpointer, open_store
from ckptflow.catalog import ledger
from ckptflow.reports import costs

DAMAGED = {  # each crashed the cost report (KeyError, TypeError) or priced retention below zero
    "no-run": b'{"logical_bytes": 100}',
    "list-digest": b'{"run": "r", "step": 9, "digest": ["a"], "logical_bytes": 100}',
    "negative": b'{"run": "r", "step": 9, "digest": "d", "logical_bytes": -5000000000000}',
    "bool": b'{"run": "r", "step": 9, "digest": "d", "logical_bytes": true}',
    "list": b"[]",
    "nested": b"[" * 100_000,
}


def test_damaged_ledger_entries_are_skipped_by_name(tmp_path, caplog):
    root = str(tmp_path / "store")
    with Checkpointer(root, "r") as ck:
        ck.save(1, {"w": torch.ones(4)})
    store = open_store(root)
    for name, body in DAMAGED.items():
        store.replace(f"{ledger.PREFIX}r/000000000009-{name}.json", body)
    with caplog.at_level(logging.WARNING, "ckptflow"):
        assert ledger.expired(store) == []
        report = costs.storage_costs(store)
    assert report.savings_bytes["retention"] == 0
    for name in DAMAGED:
        assert any(f"-{name}.json" in r.getMessage() for r in caplog.records), name
