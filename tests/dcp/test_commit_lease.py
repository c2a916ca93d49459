"""The coordinator's save lease covers every rank's writes: another rank, handed a plan its
coordinator planned under that lease, writes without waiting for a GC lock. A GC that took
its lock after the coordinator's lease waits for that lease, which ends only with the
commit, so a rank waiting for the GC stalled the save until the GC gave up (its ``wait``:
60 s by default; a ``--wait`` over 10 min failed the save).

Two ranks' planning is DCP's own (``DefaultSavePlanner``) run here in one process; the
writers, the store and the GC are real."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ckptflow import Checkpointer, CkptflowError, StoreUnavailableError, gc, open_store
from ckptflow.chunks import leases
from ckptflow.dcp import writer as writer_module
from ckptflow.dcp.commit_lease import CommitLease
from ckptflow.dcp.save_spec import SaveSpec
from ckptflow.dcp.writer import CheckpointWriter
from ckptflow.format import layout as fmt
from support.faulty_store import FaultyStore

GC_WAIT_S = 6.0


def test_another_rank_writes_without_waiting_for_a_gc_the_coordinators_lease_holds_off(tmp_path):
    with Checkpointer(str(tmp_path / "s"), "two") as ck:
        save_id = uuid.uuid4().hex
        spec = SaveSpec(
            run=ck.run, step=1, kind="full", base_step=None, skeleton={}, rng=None, metadata={}, world_size=2,
            save_id=save_id,
        )  # fmt: skip
        states = [{"a": torch.ones(256)}, {"b": torch.zeros(256)}]
        planners = [DefaultSavePlanner(), DefaultSavePlanner()]
        writers = [CheckpointWriter(ck.chunks, spec, ck.pool) for _ in range(2)]
        local = []
        for rank in range(2):
            planners[rank].set_up_planner(states[rank], is_coordinator=rank == 0)
            writers[rank].set_up_storage_writer(rank == 0, rank=rank)
            local.append(writers[rank].prepare_local_plan(planners[rank].create_local_plan()))
        plans, _metadata = planners[0].create_global_plan(local)
        plans = writers[0].prepare_global_plan(plans)  # the coordinator takes its lease

        swept: list = []
        sweep = threading.Thread(target=lambda: swept.append(gc(ck.store, grace="1h", wait=GC_WAIT_S)))
        sweep.start()  # a GC after the coordinator's lease: it waits for that lease
        try:
            deadline = time.monotonic() + 30
            while not ck.store.exists(leases.GC_LOCK) and time.monotonic() < deadline:
                time.sleep(0.01)
            started = time.monotonic()
            writers[1].write_data(planners[1].finish_plan(plans[1]), planners[1]).wait()
            waited = time.monotonic() - started
        finally:
            sweep.join(60)
            writers[0].lease.release()
    assert waited < GC_WAIT_S / 2, f"rank 1 waited {waited:.1f} s for a GC that waited for its coordinator"
    assert swept[0].skipped is not None and swept[0].deleted == []  # the save in flight was never swept


def test_a_save_abandoned_at_exit_says_so_whatever_became_of_its_lease(tmp_path, monkeypatch):
    """Ctrl-C at exit abandons an async save in flight (``save_handle``); the exit handlers
    run meanwhile and the store stops answering its lease's renewals, so the lease is lost.
    The save used to fail with the lease's error ('... was lost before its commit, so a GC
    may have swept its chunks ...: save again'), which hid that it had been abandoned."""
    monkeypatch.setattr(leases, "HEARTBEAT", 0.05)
    monkeypatch.setattr(leases, "DEAD_AFTER", 0.5)
    view = FaultyStore(open_store(str(tmp_path / "s")))
    writing = view.pause_before("put_if_absent", lambda key: "/ranks/" in key)
    with Checkpointer(view, "run") as ck:
        handle = ck.save(1, {"w": torch.ones(256)}, blocking=False)
        assert writing.reached.wait(30)
        handle._writer.abandoned = True  # what the exit's Ctrl-C handler does
        view.fail_if = lambda op, key: op == "touch" and key.startswith(leases.LEASES)  # renewals fail
        deadline = time.monotonic() + 30
        while not handle._writer.lease._held.lost and time.monotonic() < deadline:
            time.sleep(0.01)
        writing.release()
        with pytest.raises(CkptflowError, match="was abandoned at exit: not committed") as raised:
            handle.wait()
    assert "lease" not in str(raised.value), raised.value
    assert not view.exists(fmt.manifest_key("run", 1))


def test_a_save_abandoned_at_exit_while_its_manifest_is_sealed_commits_nothing(tmp_path, monkeypatch):
    """Ctrl-C at exit may land while the save's manifest is being built and sealed (a large
    save's manifest takes a while); the exit handlers then run before the process ends, and
    the save must not commit meanwhile: the exit said 'abandoned, not committed'. With the
    abandoned check done before the manifest was built, the save went on to commit."""
    view = FaultyStore(open_store(str(tmp_path / "s")))
    writing = view.pause_before("put_if_absent", lambda key: "/ranks/" in key)
    with Checkpointer(view, "run") as ck:
        handle = ck.save(1, {"w": torch.ones(256)}, blocking=False)
        assert writing.reached.wait(30)
        sealing = writer_module.seal

        def sealed_as_ctrl_c_lands(record):
            blob = sealing(record)
            handle._writer.abandoned = True  # what the exit's Ctrl-C handler does, at this moment
            return blob

        monkeypatch.setattr(writer_module, "seal", sealed_as_ctrl_c_lands)
        writing.release()
        with pytest.raises(CkptflowError, match="was abandoned at exit: not committed"):
            handle.wait()
    assert not view.exists(fmt.manifest_key("run", 1))


def test_a_lost_lease_refusal_says_the_lease_timing_in_force(tmp_path, monkeypatch):
    """The refusal names half of ``DEAD_AFTER`` as it is set when it is raised (a process
    that sets a shorter one, as the stalled-save tests' children do); it used to name the
    value imported when the module loaded (15 s)."""
    monkeypatch.setattr(leases, "HEARTBEAT", 0.05)
    monkeypatch.setattr(leases, "DEAD_AFTER", 8.0)
    store = open_store(str(tmp_path / "s"))
    lease = CommitLease(store, "run 'run' step 1")
    lease.hold([])
    try:
        [held] = store.list(leases.LEASES)
        store.delete(held.key)  # its next renewal finds it gone: lost
        deadline = time.monotonic() + 30
        while not lease._held.lost and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(StoreUnavailableError, match=r"unrenewed for over 4 s") as raised:
            lease.check_held()
        assert "15 s" not in str(raised.value)
    finally:
        lease.release()
