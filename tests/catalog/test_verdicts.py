"""Lifecycle records read back in the shape ckptflow writes them, or not at all.

A verdict decides things: ``ok`` blocks an export or a promotion, ``metrics`` rank the
"best" checkpoint. A record of another shape (hand-edited, another tool's, truncated and
rewritten) counts as no record, with a warning naming it, and never as a verdict it does
not state: ``"ok": "false"`` is a truthy string, and was read as passed."""

from __future__ import annotations

import logging

import pytest
import torch

from ckptflow import Checkpointer
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.verdicts import Subject, read_record, record_key, records_by_subject
from ckptflow.reports import inventory
from ckptflow.store import open_store

RUN = "r"
DAMAGED = [
    ("validation", b'{"ok": "false", "problems": ["chunk x damaged"]}', "'ok' is 'false'"),
    ("validation", b'[{"ok": true}]', "a JSON list"),
    ("validation", b'{"ok": true, "recorded_at": "yesterday"}', "'recorded_at'"),
    ("archive", b'{"url": "s3://b/x"}', "'ok' is None"),
    ("evaluation", b'{"metrics": "abc"}', "'metrics'"),
    ("evaluation", b'{"metrics": {"val_loss": true}}', "'metrics'"),
    ("evaluation", b'{"metrics": {"val_loss": NaN}}', "'metrics'"),
    ("validation", b'{"ok": ' * 50_000, "nest"),
    ("validation", b'{"ok": false, "x": ' + b"[" * 200 + b"]" * 200 + b"}", "nest"),  # JSON parses it; too deep
]


@pytest.fixture
def store(tmp_path):
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN) as ck:
        ck.save(1, {"w": torch.ones(8)})
    return open_store(root)


@pytest.mark.parametrize("what, body, problem", DAMAGED)
def test_a_record_of_another_shape_counts_as_none_and_is_named(store, caplog, what, body, problem):
    subject = Subject.of(catalog.read_manifest(store, RUN, 1))
    store.replace(record_key(subject, what), body)
    with caplog.at_level(logging.WARNING, logger="ckptflow.catalog.verdicts"):
        assert read_record(store, subject, what) is None
        assert what not in records_by_subject(store).get((RUN, 1, subject.digest), {})
        [entry] = inventory.collect(store)
    assert entry.records.get(what) is None and entry.validation == "not checked" and entry.valid is None
    warned = [r.getMessage() for r in caplog.records]
    assert warned and all(record_key(subject, what) in w and "delete it" in w for w in warned), warned
    assert any(problem in w for w in warned), warned


def test_a_record_in_the_shape_written_is_read(store):
    subject = Subject.of(catalog.read_manifest(store, RUN, 1))
    store.replace(record_key(subject, "validation"), b'{"ok": false, "problems": ["x"], "recorded_at": 1.5}')
    store.replace(record_key(subject, "evaluation"), b'{"metrics": {"val_loss": 0.25}, "recorded_at": 2}')
    assert read_record(store, subject, "validation") == {"ok": False, "problems": ["x"], "recorded_at": 1.5}
    [entry] = inventory.collect(store)
    assert entry.validation == "failed" and entry.records["evaluation"]["metrics"] == {"val_loss": 0.25}
