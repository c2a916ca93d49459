"""Renewing and releasing an exclusive lock (GC, retention) when a store operation's outcome
is not known: a renewal whose write landed but whose re-read failed, a write that raised
after it completed. The holder finds out from its token in the lock's body whether the lock
is still its own; only another holder's token (or no lock) means it lost it."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from ckptflow import open_store
from ckptflow.chunks import lease_listing, leases
from support.faulty_store import FaultyStore

LOCK = leases.GC_LOCK
OTHER = json.dumps({"what": "garbage collection", "id": "another holder's token"}).encode()


@pytest.fixture
def fast(monkeypatch):
    """Heartbeats every 50 ms, dead after 2 s (``lost`` after 1 s without a renewal)."""
    monkeypatch.setattr(leases, "HEARTBEAT", 0.05)
    monkeypatch.setattr(leases, "DEAD_AFTER", 2.0)


class Outage:
    """A ``FaultyStore.fail_if`` that makes the lock's re-reads (``get_versioned``) fail,
    starting with the one right after the lock's first renewal, ``reads`` of them in all.
    ``then_slow`` makes the heartbeat slow once the first has failed, so no renewal runs
    after it: the holder leaves the block with the version it last knew, stale."""

    def __init__(self, monkeypatch, reads: int = 1, *, then_slow: bool = False):
        self.monkeypatch, self.left, self.then_slow = monkeypatch, reads, then_slow
        self.ops: list[str] = []
        self.failed = threading.Event()

    def __call__(self, op: str, key: str) -> bool:
        if key != LOCK:
            return False
        self.ops.append(op)
        if op != "get" or "replace" not in self.ops or self.left == 0:
            return False
        self.left -= 1
        if self.then_slow:
            self.monkeypatch.setattr(leases, "HEARTBEAT", 3600.0)  # the next beat waits until the lock is released
        self.failed.set()
        return True

    def renewals_after_failure(self) -> int:
        first = self.ops.index("get", self.ops.index("replace"))
        return self.ops[first:].count("replace")


def _until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("reads", [1, 3])
def test_a_renewal_whose_reread_failed_keeps_the_lock_and_releases_it(tmp_path, fast, monkeypatch, reads):
    """The renewal's write landed, its re-read of the new version failed (a transient
    outage): the holder kept the old version, every later renewal's compare-and-swap
    failed, it thought itself taken over, and its release was refused, so the lock stayed
    until DEAD_AFTER and blocked every save and GC meanwhile."""
    inner = open_store(str(tmp_path / "store"))
    view = FaultyStore(inner)
    view.fail_if = outage = Outage(monkeypatch, reads)
    with leases.gc_lock(view) as beat:
        assert outage.failed.wait(10)
        assert _until(lambda: outage.renewals_after_failure() >= 5 or beat.lost)
        lost = beat.lost
    assert (lost, inner.exists(LOCK)) == (False, False)  # held throughout, and released at once


def test_a_renewal_that_raised_after_its_write_landed_keeps_the_lock(tmp_path, fast):
    """The outcome of a renewal is not known when its write raises after it completed."""
    inner = open_store(str(tmp_path / "store"))
    view = FaultyStore(inner)
    with leases.gc_lock(view) as beat:
        view.arm(view.ops + 1, when="after", sticky=False)  # a renewal soon: its write lands, then it raises
        assert _until(lambda: bool(view.faults))
        assert _until(lambda: len(view.mutating_log()) >= 6 or beat.lost)
        lost = beat.lost
    assert (lost, inner.exists(LOCK)) == (False, False)


def test_a_lock_whose_first_read_failed_is_held_and_released(tmp_path, fast):
    """Right after taking the lock, the read of its version failed: the holder still holds
    it (raising left the lock behind for DEAD_AFTER)."""
    inner = open_store(str(tmp_path / "store"))
    view = FaultyStore(inner)
    reads: list[str] = []
    view.fail_if = lambda op, key: key == LOCK and op == "get" and not reads.append(op) and len(reads) == 1
    with leases.gc_lock(view) as beat:
        assert _until(lambda: len(view.mutating_log()) >= 4 or beat.lost)
        lost = beat.lost
    assert (lost, inner.exists(LOCK)) == (False, False)


def test_a_takeover_after_a_failed_reread_is_still_lost(tmp_path, fast, monkeypatch):
    inner = open_store(str(tmp_path / "store"))
    view = FaultyStore(inner)
    view.fail_if = outage = Outage(monkeypatch)
    with leases.gc_lock(view) as beat:
        assert outage.failed.wait(10)
        inner.replace(LOCK, OTHER)  # another holder took it over
        assert _until(lambda: beat.lost)
    assert inner.get(LOCK) == OTHER  # its lock stays


@pytest.mark.parametrize("taken", [False, True])
def test_a_release_with_a_stale_version_deletes_its_own_lock_never_anothers(tmp_path, fast, monkeypatch, taken):
    """The holder leaves with a stale version (its last renewal's re-read failed): it
    deletes the lock if the body is still its own, and leaves another holder's."""
    inner = open_store(str(tmp_path / "store"))
    view = FaultyStore(inner)
    view.fail_if = outage = Outage(monkeypatch, then_slow=True)
    with leases.gc_lock(view):
        assert outage.failed.wait(10)
        if taken:
            inner.replace(LOCK, OTHER)
    assert (inner.get(LOCK) == OTHER) if taken else not inner.exists(LOCK)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_release_that_meets_an_outage_retries(tmp_path, monkeypatch, caplog, when):
    """The release's delete fails before it deletes (tried again), or after (read: gone)."""
    monkeypatch.setattr(leases, "HEARTBEAT", 3600.0)  # no renewal: the ops are the create, then the delete
    inner = open_store(str(tmp_path / "store"))
    view = FaultyStore(inner)
    view.arm(1, when=when, sticky=False)
    with caplog.at_level("WARNING", logger="ckptflow"), leases.gc_lock(view):
        pass
    assert [op for _, op, _ in view.faults] == ["delete"]
    assert not inner.exists(LOCK) and "taken over" not in caplog.text and "could not" not in caplog.text


def test_a_lock_whose_create_raised_after_it_landed_is_not_left_behind(tmp_path):
    """Taking the lock raised, but the create had landed: the lock (this holder's) goes."""
    inner = open_store(str(tmp_path / "store"))
    view = FaultyStore(inner)
    view.arm(0, when="after", sticky=False)
    with pytest.raises(OSError, match="injected fault after put_if_absent"), leases.gc_lock(view):
        pass
    assert not inner.exists(LOCK)


def test_a_lock_held_by_another_is_refused_and_left_alone(tmp_path, caplog):
    inner = open_store(str(tmp_path / "store"))
    inner.put_if_absent(LOCK, OTHER)
    with caplog.at_level("WARNING", logger="ckptflow"):
        with pytest.raises(leases.SAVES.exclusive_error, match="another garbage collection holds"):
            with leases.gc_lock(inner):
                pass
    assert inner.get(LOCK) == OTHER and not caplog.text


@pytest.mark.parametrize("held", ["lease", "lock"])
def test_a_holder_that_may_have_looked_dead_stays_lost_once_renewals_succeed(tmp_path, fast, held):
    """Renewals failed for nearly DEAD_AFTER, then succeeded again: meanwhile another
    process may have judged the holder dead (a GC sweeping a save's chunks, a save going
    past a GC lock), so ``lost`` stays. Before, it went back to False, and a save
    committed with chunks a GC may have swept."""
    inner = open_store(str(tmp_path / "store"))
    view = FaultyStore(inner)
    down = threading.Event()
    view.fail_if = lambda op, key: down.is_set() and op in ("touch", "replace")  # the renewals: nothing else writes
    with leases.save_lease(view) if held == "lease" else leases.gc_lock(view) as beat:
        down.set()
        assert _until(lambda: beat.lost)
        time.sleep(0.4 * leases.DEAD_AFTER)  # lost once unrenewed for 0.5 DEAD_AFTER: 0.9 in all
        down.clear()
        renewed = beat.renewed
        assert _until(lambda: beat.renewed > renewed)  # renewals succeed again
        assert beat.lost


def test_one_slow_renewal_no_process_could_judge_dead_loses_nothing(tmp_path, fast):
    """One renewal of a save's lease takes 60% of DEAD_AFTER (18 s of 30: a stalled
    connection, throttling), then renewals are quick again. The lease object was never
    older than DEAD_AFTER, so no GC could have judged it dead (as ``lease_listing.leases`` judges):
    the lease is not lost, and the save holding it commits."""
    inner = open_store(str(tmp_path / "store"))
    view = FaultyStore(inner)
    slow = [True]

    def fail_if(op: str, key: str) -> bool:
        if op == "touch" and slow and slow.pop():
            time.sleep(0.6 * leases.DEAD_AFTER)
        return False

    view.fail_if = fail_if
    judged_dead: list[str] = []
    with leases.save_lease(view) as beat:
        until = time.monotonic() + 1.5 * leases.DEAD_AFTER
        while time.monotonic() < until:  # what a GC sees, the whole time
            judged_dead += [info.key for info in lease_listing.leases(inner).dead]
            time.sleep(0.02)
        assert not slow and not judged_dead  # the slow renewal happened; no GC could have judged the lease dead
        lost = beat.lost
    assert not lost


@pytest.mark.skipif(not hasattr(time, "CLOCK_BOOTTIME"), reason="Linux's suspend-counting clock")
def test_a_holder_resumed_from_a_suspend_past_dead_after_knows_it_lost_its_lease(tmp_path, monkeypatch):
    """A machine suspended (a laptop's lid shut, a VM paused by its host) renews nothing, so
    to a GC on another machine, which judges a lease by its modification time, the lease is
    as old as the suspend: dead. The holder measured ``lost`` with ``time.monotonic``
    (CLOCK_MONOTONIC, which stops while Linux is suspended), so it went on trusting the
    lease, and a save committed with chunks that GC may have swept. Here a 1 h suspend:
    CLOCK_BOOTTIME an hour on, CLOCK_MONOTONIC not, the lease's time an hour behind."""
    monkeypatch.setattr(leases, "HEARTBEAT", 0.5)
    suspended = 3600.0
    store = open_store(str(tmp_path / "store"))
    clock_gettime = time.clock_gettime
    with leases.save_lease(store) as beat:
        [lease] = [tmp_path / "store" / info.key for info in store.list(leases.LEASES)]
        assert not beat.lost
        monkeypatch.setattr(
            time,
            "clock_gettime",
            lambda clock: clock_gettime(clock) + (suspended if clock == time.CLOCK_BOOTTIME else 0),
        )
        then = lease.stat().st_mtime - suspended
        os.utime(lease, (then, then))
        assert [info.key for info in lease_listing.leases(store).dead] == [f"{leases.LEASES}{lease.name}"]
        assert beat.lost  # as the GC judges it
        renewed = beat.renewed
        assert _until(lambda: beat.renewed > renewed)  # the first renewal after the resume succeeds
        assert beat.lost  # a GC may have swept meanwhile: lost for good
