"""Recovery records and the operational metrics built from them."""

import json
import os

import pytest
import torch

from ckptflow import Checkpointer, NoValidCheckpointError, lifecycle, open_store, recoveries
from ckptflow import format as fmt
from ckptflow.cli import main as cli
from ckptflow.store.local import LocalStore


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((64,), value)}}


def _corrupt_newest_chunk(root: str, run: str, step: int) -> None:
    store = open_store(root)
    manifest = json.loads(store.get(fmt.manifest_key(run, step)))
    path = os.path.join(root, fmt.chunk_key(next(iter(manifest["chunks"]))))
    blob = bytearray(open(path, "rb").read())
    blob[-1] ^= 0xFF
    open(path, "wb").write(bytes(blob))


def test_every_restore_leaves_a_record_and_the_metrics_count_them(tmp_path):
    root = str(tmp_path / "store")
    with Checkpointer(root, "r") as ck:
        ck.save(1, _state(1.0))
        ck.save(2, _state(2.0))
        assert ck.restore(_state(0.0)).step == 2
        _corrupt_newest_chunk(root, "r", 2)
        result = ck.restore(_state(0.0))
        assert result.step == 1 and result.skipped
    with Checkpointer(root, "empty") as ck, pytest.raises(NoValidCheckpointError):
        ck.restore(_state(0.0))

    store = open_store(root)
    records = recoveries.read_all(store, "r")
    assert [(r["ok"], r["step"], len(r["skipped"])) for r in records] == [(True, 2, 0), (True, 1, 1)]
    assert all(r["duration_s"] >= 0 and r["tier"] == store.url for r in records)
    (failed,) = recoveries.read_all(store, "empty")
    assert failed["ok"] is False and failed["step"] is None and "no valid checkpoint" in failed["error"]

    lifecycle.validate(store, "r", 1)
    metrics = {m.run: m for m in recoveries.store_metrics(store)}
    assert metrics["empty"].recoveries == 1 and metrics["empty"].recovery_success_rate == 0.0
    m = metrics["r"]
    assert (m.checkpoints, m.recoveries, m.recoveries_ok, m.fallbacks) == (2, 2, 2, 1)
    assert m.recovery_success_rate == 1.0
    infos = Checkpointer(root, "r").list()
    assert m.save_interval_s == pytest.approx(infos[1].created_at - infos[0].created_at)
    assert m.ready_s is not None and m.ready_s >= 0


def test_a_store_that_refuses_the_record_still_restores(tmp_path):
    class ReadOnlyRecoveries(LocalStore):
        def put_if_absent(self, key, data):
            if key.startswith(recoveries.PREFIX):
                raise PermissionError("read-only credentials")
            return super().put_if_absent(key, data)

    store = ReadOnlyRecoveries(str(tmp_path / "store"))
    with Checkpointer(store, "r") as ck:
        ck.save(1, _state(1.0))
        state = _state(0.0)
        assert ck.restore(state).step == 1
    assert torch.equal(state["model"]["w"], torch.full((64,), 1.0))
    assert recoveries.read_all(store) == []


def test_stats_reports_recoveries(tmp_path, capsys):
    root = str(tmp_path / "store")
    with Checkpointer(root, "r") as ck:
        ck.save(1, _state(1.0))
        ck.restore(_state(0.0))
    assert cli(["stats", root, "--json"]) == 0
    (ops,) = json.loads(capsys.readouterr().out)["operations"]
    assert ops["run"] == "r" and ops["recoveries"] == 1 and ops["recovery_success_rate"] == 1.0
    assert cli(["stats", root]) == 0
    out = capsys.readouterr().out
    assert "RECOVERIES" in out and "SUCCEEDED" in out
