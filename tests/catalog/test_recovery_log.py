"""Recovery records of another shape are damage the recovery figures leave out, by name."""

from __future__ import annotations

import logging

import pytest
import torch

from ckptflow import Checkpointer, open_store
from ckptflow.catalog import recovery_log
from ckptflow.catalog.records import SMALL_RECORD_BYTES
from ckptflow.errors import NoValidCheckpointError
from ckptflow.reports import advice, recoveries

RUN = "r"
DAMAGED = {  # each crashed stats/advise (AttributeError, TypeError) or skewed their figures
    "list": b"[1, 2, 3]",
    "string-at": b'{"at": "yesterday", "ok": true, "step": 1, "duration_s": 0.5}',
    "null-at": b'{"at": null, "ok": true, "step": 1, "duration_s": 0.5}',
    "nan-duration": b'{"at": 1.0, "ok": true, "step": 1, "duration_s": NaN}',  # RTO "nan h"
    "bool-duration": b'{"at": 1.0, "ok": true, "step": 1, "duration_s": true}',  # counted as 1.0 s
    "string-ok": b'{"at": 1.0, "ok": "no", "step": 1, "duration_s": 0.5}',  # counted as succeeded
    "huge-duration": b'{"at": 1.0, "ok": true, "step": 1, "duration_s": 1' + b"0" * 400 + b"}",
    "nested": b"[" * 100_000 + b"]" * 100_000,
    "truncated": b'{"at": 1.0, "ok": tr',
    # rejected and loaded at once: stats left it out as rejected, advise took it for a restore (MTBF, restore time)
    "rejected-ok": b'{"at": 1.0, "ok": true, "step": 1, "duration_s": 900.0, "rejected": "state mismatch"}',
    "rejected-list": b'{"at": 1.0, "ok": false, "rejected": ["state mismatch"]}',
}


@pytest.fixture
def store(tmp_path):
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN) as ck:
        ck.save(1, {"w": torch.ones(4)})
        ck.save(2, {"w": torch.ones(4)})
        ck.restore({"w": torch.zeros(4)})
    store = open_store(root)
    for name, body in DAMAGED.items():
        store.replace(f"{recovery_log.PREFIX}{RUN}/20000101T000000-{name}.json", body)
    return store


def test_damaged_records_are_skipped_by_name(store, caplog):
    with caplog.at_level(logging.WARNING, "ckptflow"):
        (real,) = recovery_log.read_all(store, RUN)
    assert real["ok"] is True and real["step"] == 2
    for name in DAMAGED:
        assert any(f"-{name}.json" in r.getMessage() and "delete it" in r.getMessage() for r in caplog.records)


def test_the_figures_count_only_the_real_restore(store):
    metrics = recoveries.run_metrics(store, RUN)
    assert (metrics.recoveries, metrics.recoveries_ok, metrics.rejected) == (1, 1, 0)
    assert metrics.restore_s == metrics.restore_worst_s < 60
    assert "median of 1 restores" in advice.advise(store, RUN).sources["restore_s"]


def test_a_record_over_the_limit_is_not_read(store, monkeypatch):
    big = b" " * SMALL_RECORD_BYTES + b'{"at": 1.0, "ok": true, "step": 1, "duration_s": 0.5}'
    store.replace(f"{recovery_log.PREFIX}{RUN}/20000101T000000-big.json", big)
    monkeypatch.setattr(store, "get", lambda key: pytest.fail(f"{key} was read unbounded"))
    assert len(recovery_log.read_all(store, RUN)) == 1


def test_a_failed_restore_records_the_checkpoints_its_selector_passed_over(tmp_path):
    """No checkpoint is validated: restore(select="validated") fails, and its recovery record
    says why each one was not a candidate, as a successful one's does (not an empty list)."""
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.full((4,), float(step))})
        with pytest.raises(NoValidCheckpointError, match="'validated' and whole") as raised:
            ck.restore({"w": torch.zeros(4)}, select="validated")
    [record] = recovery_log.read_all(open_store(root), RUN)
    assert record["ok"] is False and record["select"] == "validated"
    assert record["passed_over"] == [[2, "not validated yet"], [1, "not validated yet"]]
    assert raised.value.passed_over == [(2, "not validated yet"), (1, "not validated yet")]
