"""Recovery records and the operational metrics built from them."""

import json
import os
import re

import pytest
import torch

from ckptflow import Checkpointer, HostMemoryError, NoValidCheckpointError, StateMismatchError, lifecycle, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import recovery_log
from ckptflow.cli import main as cli
from ckptflow.format import layout as fmt
from ckptflow.reports import recoveries
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
    records = recovery_log.read_all(store, "r")
    assert [(r["ok"], r["step"], len(r["skipped"])) for r in records] == [(True, 2, 0), (True, 1, 1)]
    step1 = catalog.read_manifest(store, "r", 1).digest
    assert records[1]["digest"] == result.digest == step1 != records[0]["digest"]  # which commit, by digest
    assert all(r["duration_s"] >= 0 and r["tier"] == store.url for r in records)
    (failed,) = recovery_log.read_all(store, "empty")
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
    assert recovery_log.read_all(store) == []


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


def test_rpo_is_the_longest_gap_between_recovery_ready_commits_in_the_window():
    ready = [0.0, 10.0, 40.0, 45.0, 100.0]
    assert recoveries.longest_gap(ready, start=5, end=50) == 30.0  # 100 is after the window; 0 anchors 10
    assert recoveries.longest_gap(ready, start=41, end=50) == 5.0  # 40 anchors 45
    assert recoveries.longest_gap([3.0], start=0, end=50) is None
    assert recoveries.longest_gap([], start=0, end=50) is None


def test_rpo_rto_and_freshness_from_a_store(tmp_path, capsys):
    """Three commits, the middle one never validated (not recovery-ready): RPO spans it;
    RTO adds the configured detection time to the measured restore; freshness compares
    the newest recovery-ready commit with the target."""
    root = str(tmp_path / "store")
    with Checkpointer(root, "r") as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(float(step)))
        ck.restore(_state(0.0))
        infos = {i.step: i for i in ck.list()}
    store = open_store(root)
    for step in (1, 3):
        lifecycle.validate(store, "r", step)
    now = infos[3].created_at + 100
    (m,) = recoveries.store_metrics(store, now=now, detection_s=30.0)
    assert m.rpo_s == pytest.approx(infos[3].created_at - infos[1].created_at)
    assert m.checkpoints_in_window == 3 and m.newest_ready_at == infos[3].created_at
    assert m.rto_median_s == pytest.approx(30.0 + m.restore_s) and m.rto_worst_s == pytest.approx(30.0 + m.restore_s)
    assert recoveries.store_metrics(store, now=now + 2 * recoveries.DAY)[0].checkpoints_in_window == 0
    fresh = recoveries.freshness([m], target_s=3600, now=now)
    assert fresh.ok and fresh.run == "r" and fresh.age_s == pytest.approx(100)
    assert not recoveries.freshness([m], target_s=60, now=now).ok
    assert not recoveries.freshness([], target_s=60, now=now).ok  # nothing recovery-ready: stale

    assert cli(["stats", root, "--detection", "30s", "--archive", root]) == 0
    out = capsys.readouterr().out
    assert "RPO" in out and "RTO (MED / WORST)" in out and "detection (30.0 s" in out
    assert "archive" in out.split("bytes per tier:")[1].splitlines()[0]


def test_a_first_launch_that_finds_nothing_to_restore_is_not_a_failed_recovery(tmp_path):
    """The documented fresh start (catch NoValidCheckpointError, train from scratch) was
    counted as a failed recovery: 1 recovery, 0 succeeded, success rate 0% for a run that
    never lost anything. A restore that fails on a run with checkpoints still counts."""
    root = str(tmp_path)
    state = {"w": torch.zeros(8)}
    with Checkpointer(root, "job") as ck:
        with pytest.raises(NoValidCheckpointError):
            ck.restore(state)  # the first launch: nothing saved yet
        ck.save(1, state)
    store = open_store(root)
    m = recoveries.run_metrics(store, "job")
    assert (m.recoveries, m.recoveries_ok, m.recovery_success_rate, m.last_recovery) == (0, 0, None, None)
    with Checkpointer(root, "job") as ck:
        with pytest.raises(NoValidCheckpointError):
            ck.restore(state, step=7)  # a restore that fails once checkpoints exist is a failed recovery
    m = recoveries.run_metrics(store, "job")
    assert (m.recoveries, m.recoveries_ok) == (1, 0)


def test_a_failed_recovery_still_counts_once_retention_expired_the_checkpoints_before_it(tmp_path):
    """The run's first commit is when its first checkpoint was committed, expired or not (the
    ledger keeps its time): measured from the oldest checkpoint still held, every failed
    recovery older than it read as a first launch once retention expired the ones before."""
    root = str(tmp_path)
    with Checkpointer(root, "job") as ck:
        ck.save(1, {"w": torch.zeros(8)})
        with pytest.raises(NoValidCheckpointError):
            ck.restore({"w": torch.zeros(8)}, step=7)  # a failed recovery of a run with a checkpoint
        ck.save(2, {"w": torch.zeros(8)})
    store = open_store(root)
    lifecycle.expire(store, "job", 1)
    m = recoveries.run_metrics(store, "job")
    assert (m.recoveries, m.recoveries_ok) == (1, 0)


def test_a_restore_into_a_wrongly_built_state_is_rejected_not_a_failed_recovery(tmp_path, capsys):
    """Two restores into a state built with another shape showed as 2 recoveries, 0 succeeded
    (success rate 0%) in ``ckptflow stats``: the caller's error read as a checkpoint that
    could not be recovered. They are counted apart, as rejected, with the reason."""
    root = str(tmp_path / "store")
    with Checkpointer(root, "r") as ck:
        ck.save(1, _state(1.0))
        for _ in range(2):
            wrong = {"model": {"w": torch.zeros(65)}}
            with pytest.raises(StateMismatchError):
                ck.restore(wrong)
            assert torch.equal(wrong["model"]["w"], torch.zeros(65))  # rejected: nothing changed
    store = open_store(root)
    records = recovery_log.read_all(store, "r")
    assert [(r["ok"], r["rejected"]) for r in records] == [(False, "state mismatch")] * 2
    m = recoveries.run_metrics(store, "r")
    assert (m.recoveries, m.recoveries_ok, m.rejected, m.recovery_success_rate) == (0, 0, 2, None)
    assert (m.fallbacks, m.selectors, m.last_recovery) == (0, {}, None)

    assert cli(["stats", root, "--json"]) == 0
    (ops,) = json.loads(capsys.readouterr().out)["operations"]
    assert (ops["recoveries"], ops["rejected"], ops["recovery_success_rate"]) == (0, 2, None)
    assert cli(["stats", root]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if "RECOVERIES" in line)  # the operations table
    header, row = lines[at : at + 2]
    cells = dict(zip(re.split(r"\s{2,}", header), re.split(r"\s{2,}", row)))
    assert (cells["RECOVERIES"], cells["SUCCEEDED"], cells["REJECTED"]) == ("0", "0", "2")
    assert "REJECTED: restores refused because the state passed does not have the checkpoint's structure" in out

    with Checkpointer(root, "r") as ck:  # a real recovery still counts, the rejected ones still do not
        assert ck.restore(_state(0.0)).step == 1
    m = recoveries.run_metrics(store, "r")
    assert (m.recoveries, m.recoveries_ok, m.rejected, m.recovery_success_rate) == (1, 1, 2, 1.0)
    assert m.last_recovery is not None and m.last_recovery["ok"] is True


def test_a_load_this_machine_cannot_hold_is_a_failed_recovery_not_a_rejected_state(tmp_path, monkeypatch):
    """``load()`` is given no state, yet a tensor this machine cannot allocate raised
    StateMismatchError (the caller's state does not fit), and its record was kept out of
    the rejected ones only by a flag the caller passed (``into_state``). It raises
    HostMemoryError, as ``restore()`` running out of host memory does: a failed recovery
    whose record names the reason, never a rejection and never a fallback."""
    from ckptflow.dcp import allocation

    root = str(tmp_path / "store")
    with Checkpointer(root, "r") as ck:
        ck.save(1, _state(1.0))
    monkeypatch.setattr(allocation, "_physical_memory", lambda: 128)  # a machine smaller than the 256-byte tensor
    with Checkpointer(root, "r") as ck, pytest.raises(HostMemoryError, match="ran out of host memory") as raised:
        ck.load()
    assert "more memory" in str(raised.value) and not isinstance(raised.value, StateMismatchError)
    (record,) = recovery_log.read_all(open_store(root), "r")
    assert (record["ok"], record["rejected"], record["skipped"]) == (False, None, [])
    assert "ran out of host memory" in record["error"] and "more memory" in record["error"]
    m = recoveries.run_metrics(open_store(root), "r")
    assert (m.recoveries, m.recoveries_ok, m.rejected, m.fallbacks, m.recovery_success_rate) == (1, 0, 0, 0, 0.0)

    with Checkpointer(root, "r") as ck, pytest.raises(StateMismatchError):  # restore into a wrong state: rejected
        ck.restore({"model": {"w": torch.zeros(65)}})
    assert recoveries.run_metrics(open_store(root), "r").rejected == 1


def test_a_load_that_fell_back_past_damage_then_ran_out_of_memory_records_what_it_skipped(tmp_path, monkeypatch):
    """Step 2 (a small tensor) is damaged, step 1's tensor does not fit this machine: the
    load skipped 2 and stopped at 1. Its record is a failed recovery with that fallback;
    HostMemoryError carried no ``skipped``, so the damage the job met was in no record."""
    from ckptflow.dcp import allocation
    from support.corrupt import corrupt_chunk

    root = str(tmp_path / "store")
    with Checkpointer(root, "r") as ck:
        ck.save(1, {"model": {"w": torch.ones(64)}})
        ck.save(2, {"model": {"w": torch.ones(16)}})
    corrupt_chunk(root, "r", 2)
    monkeypatch.setattr(allocation, "_physical_memory", lambda: 128)  # holds step 2's 64 bytes, not step 1's 256
    with Checkpointer(root, "r") as ck, pytest.raises(HostMemoryError, match="step 1") as raised:
        ck.load()
    assert [step for step, _ in raised.value.skipped] == [2]
    (record,) = recovery_log.read_all(open_store(root), "r")
    assert (record["ok"], record["rejected"]) == (False, None) and [s for s, _ in record["skipped"]] == [2]
    m = recoveries.run_metrics(open_store(root), "r")
    assert (m.recoveries, m.recoveries_ok, m.rejected, m.fallbacks) == (1, 0, 0, 1)


def test_a_restore_that_fell_back_past_damage_to_a_checkpoint_of_another_structure_is_a_failed_recovery(tmp_path):
    """The run added a bias at step 2; step 2 is damaged, so restore skipped it and met step 1,
    which has no bias: StateMismatchError. Its record said rejected ("state mismatch": the
    caller's side) with nothing skipped, so the figures read 0 recoveries, 0 fallbacks, 1
    rejected: the damage that stopped the recovery was nowhere. The state fits the newest
    checkpoint; it is a failed recovery with its fallback, and the error says what was skipped."""
    from support.corrupt import corrupt_chunk, only_in

    root = str(tmp_path / "store")
    with Checkpointer(root, "r") as ck:
        ck.save(1, {"model": {"w": torch.ones(64)}})
        ck.save(2, {"model": {"w": torch.full((64,), 2.0), "b": torch.ones(4)}})
    corrupt_chunk(root, "r", 2, only_in(root, "r", 2, 1)[0])
    with Checkpointer(root, "r") as ck, pytest.raises(StateMismatchError, match="step 1") as raised:
        ck.restore({"model": {"w": torch.zeros(64), "b": torch.zeros(4)}})
    assert "newer checkpoints were skipped as damaged first: step 2" in str(raised.value)
    (record,) = recovery_log.read_all(open_store(root), "r")
    assert record["rejected"] is None and [step for step, _ in record["skipped"]] == [2]
    m = recoveries.run_metrics(open_store(root), "r")
    assert (m.recoveries, m.recoveries_ok, m.fallbacks, m.rejected) == (1, 0, 1, 0)
