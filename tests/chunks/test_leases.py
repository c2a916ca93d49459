"""Liveness of the GC lock and the save leases: heartbeats, dead holders cleared or taken
over, a waiting save that says what it waits for, a GC that stops once its lock is gone."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptflow import Checkpointer, CkptflowError, gc, open_store
from ckptflow.chunks import lease_listing, leases, owners
from ckptflow.format import layout as fmt
from support.faulty_store import FaultyStore
from support.states import CHUNK, RUN, tagged_state


@pytest.fixture
def fast(monkeypatch):
    """Heartbeats every 50 ms, dead after 0.5 s: the same protocol on a test's time scale."""
    monkeypatch.setattr(leases, "HEARTBEAT", 0.05)
    monkeypatch.setattr(leases, "DEAD_AFTER", 0.5)


def age(store, key: str, seconds: float) -> None:
    path = os.path.join(store.root, *key.split("/"))
    then = time.time() - seconds
    os.utime(path, (then, then))


def plant(store, key: str, seconds_ago: float) -> None:
    store.put_if_absent(key, json.dumps({"what": "dead", "pid": 1}).encode())
    age(store, key, seconds_ago)


def test_a_gc_that_died_holding_the_lock_blocks_no_save_and_is_taken_over(tmp_path, caplog):
    store = open_store(str(tmp_path / "store"))
    plant(store, leases.GC_LOCK, 45)  # killed 45 s ago: never renewed since
    started = time.monotonic()
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
    assert time.monotonic() - started < 10  # not the 10 minutes a dead lock used to cost
    with caplog.at_level(logging.WARNING, logger="ckptflow"):
        report = gc(store, grace="1h")
    assert report.skipped is None and "took over" in caplog.text
    assert not store.exists(leases.GC_LOCK)


def test_a_live_gc_keeps_its_lock_and_a_save_says_what_it_waits_for(tmp_path, fast, caplog):
    inner, view, pause = _sweep_paused_at_its_first_delete(tmp_path)
    sweeper = threading.Thread(target=lambda: gc(view, grace=0))
    sweeper.start()
    try:
        assert pause.reached.wait(30)
        time.sleep(4 * leases.DEAD_AFTER)  # the sweep outlives DEAD_AFTER many times: renewals keep it alive
        with pytest.raises(CkptflowError, match="another garbage collection holds"):
            gc(inner, grace=0)
        saved: list = []
        with caplog.at_level(logging.WARNING, logger="ckptflow"):
            saver = threading.Thread(
                target=lambda: saved.append(Checkpointer(inner, run=RUN, chunk_bytes=CHUNK).save(2, tagged_state(2)))
            )
            saver.start()
            saver.join(1.5)
            assert saver.is_alive() and "waiting for garbage collection" in caplog.text
    finally:
        pause.release()
        sweeper.join(30)
    saver.join(30)
    assert saved and saved[0].step == 2


def test_of_two_gcs_finding_a_dead_lock_exactly_one_takes_it(tmp_path):
    store = open_store(str(tmp_path / "store"))
    for _ in range(5):
        plant(store, leases.GC_LOCK, 60)
        assert sorted(_race_for_the_lock(store)) == [False, True]


def _race_for_the_lock(store) -> list[bool]:
    barrier = threading.Barrier(2)
    held: list[bool] = []

    def take():
        barrier.wait()
        try:
            with leases.gc_lock(store):
                held.append(True)
                time.sleep(0.3)
        except CkptflowError:
            held.append(False)

    threads = [threading.Thread(target=take) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return held


def test_a_gc_whose_lock_was_taken_over_stops_deleting(tmp_path, fast):
    inner, view, pause = _sweep_paused_at_its_first_delete(tmp_path)
    chunks_before = {i.key for i in inner.list("chunks/")}
    outcome: list = []
    sweeper = threading.Thread(target=lambda: outcome.append(_run(lambda: gc(view, grace=0))))
    sweeper.start()
    assert pause.reached.wait(30)
    inner.replace(leases.GC_LOCK, b'{"what": "another gc"}')  # what a takeover writes
    time.sleep(5 * leases.HEARTBEAT)
    pause.release()
    sweeper.join(30)
    [error] = outcome
    assert isinstance(error, CkptflowError) and "lost its lock" in str(error)
    left = {i.key for i in inner.list("chunks/")}
    assert len(chunks_before) > 3 and len(chunks_before - left) <= 1  # only the delete already under way
    assert inner.get(leases.GC_LOCK) == b'{"what": "another gc"}'  # and the new holder's lock stays


def test_a_gc_taken_over_while_its_renewals_failed_leaves_the_new_holders_lock(tmp_path, fast):
    """A's renewals cannot reach the store until B takes its lock over; A then stops, and
    on its way out deletes only its own version of the lock, so saves keep waiting for B."""
    inner, view, pause = _sweep_paused_at_its_first_delete(tmp_path)
    outcome: list = []
    sweeper = threading.Thread(target=lambda: outcome.append(_run(lambda: gc(view, grace=0))))
    sweeper.start()
    assert pause.reached.wait(30)
    view.fail_if = lambda op, key: op == "replace" and key == leases.GC_LOCK  # A's renewals fail
    time.sleep(3 * leases.DEAD_AFTER)
    with leases.gc_lock(inner):  # B finds A's lock dead and takes it over
        taken = inner.get(leases.GC_LOCK)
        pause.release()
        sweeper.join(30)
        [error] = outcome
        assert isinstance(error, CkptflowError) and "lost its lock" in str(error)
        assert inner.exists(leases.GC_LOCK) and inner.get(leases.GC_LOCK) == taken


def _sweep_paused_at_its_first_delete(tmp_path):
    """A store whose one step lost its commit record (its chunks are garbage), and a view of
    it that pauses the first chunk delete a GC through it makes."""
    inner = open_store(str(tmp_path / "store"))
    with Checkpointer(inner, run=RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
    inner.delete(fmt.manifest_key(RUN, 1))
    view = FaultyStore(inner)
    return inner, view, view.pause_before("delete", lambda key: key.startswith("chunks/"))


def _run(fn):
    try:
        return fn()
    except Exception as e:
        return e


def test_leases_of_dead_writers_are_cleared_and_live_ones_waited_for(tmp_path):
    store = open_store(str(tmp_path / "store"))
    for i in range(74):
        plant(store, f"{leases.LEASES}dead-{i}.json", 120)
    report = gc(store, grace="1h", wait=0)
    assert report.skipped is None and len(report.dead_leases) == 74  # reported, cleared, no waiting
    assert not list(store.list(leases.LEASES))
    store.put_if_absent(f"{leases.LEASES}live.json", b"{}")
    report = gc(store, grace="1h", wait=0)
    assert report.skipped and "1 save(s) are writing chunks" in report.skipped and not report.deleted


def test_the_lease_of_a_killed_saver_on_this_machine_holds_no_gc(tmp_path):
    """Same machine: GC sees the saver's process is gone and clears its lease at once, long
    before the 30 s after which any lease not renewed counts as dead."""
    root = str(tmp_path / "store")
    store = open_store(root)
    script = Path(__file__).parents[1] / "support" / "lease_holder.py"
    saver = subprocess.Popen([sys.executable, str(script), root, RUN], stdout=subprocess.PIPE, text=True)
    try:
        assert saver.stdout is not None and saver.stdout.readline().strip() == "holding"
        [lease] = [i.key for i in store.list(leases.LEASES)]
        report = gc(store, grace="1h", wait=0)
        assert report.skipped and "1 save(s) are writing chunks" in report.skipped  # alive: its lease holds
        os.kill(saver.pid, signal.SIGKILL)
        saver.wait(30)
    finally:
        if saver.poll() is None:
            saver.kill()
    report = gc(store, grace="1h", wait=0)
    assert report.skipped is None and report.dead_leases == [lease]
    assert not list(store.list(leases.LEASES))


def test_a_gc_killed_on_this_machine_holds_no_save_and_its_lock_is_taken_over_at_once(tmp_path, caplog):
    """Same machine: a save stops waiting for the lock of a GC whose process is gone, and the
    next GC takes it over, both long before the 30 s after which an unrenewed lock is dead."""
    root = str(tmp_path / "store")
    store = open_store(root)
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time\n"
            "from ckptflow import open_store\n"
            "from ckptflow.chunks import leases\n"
            "with leases.gc_lock(open_store(sys.argv[1])):\n"
            "    print('holding', flush=True)\n"
            "    time.sleep(600)\n"
        ), root],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        with pytest.raises(CkptflowError, match="another garbage collection holds"):
            with leases.gc_lock(store):
                pass  # alive: its lock holds
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(30)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert store.exists(leases.GC_LOCK)  # renewed seconds ago: not dead by its age
    started = time.monotonic()
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
    assert time.monotonic() - started < 10
    with caplog.at_level(logging.WARNING, logger="ckptflow"):
        report = gc(store, grace="1h")
    assert report.skipped is None and "took over" in caplog.text
    assert time.monotonic() - started < leases.DEAD_AFTER


def test_a_lease_whose_holder_exited_or_whose_pid_names_another_process_is_dead_on_this_machine(tmp_path):
    store = open_store(str(tmp_path / "store"))
    mine = json.loads(owners.body("save"))
    assert mine["pid"] == os.getpid() and mine["started"] > 0
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    zombie = subprocess.Popen(["true"])  # exits at once, and is not reaped until the end
    while owners.proc_stat(str(zombie.pid))[1] != "Z":
        time.sleep(0.01)
    holders = {
        "elsewhere": dict(mine, machine="another machine", pid=reaped.pid),  # not this machine's to judge
        "exited": dict(mine, pid=reaped.pid),
        "mine": mine,
        "reused": dict(mine, started=mine["started"] - 1),  # this pid, but a process that started earlier
        "zombie": dict(mine, pid=zombie.pid, started=owners.proc_stat(str(zombie.pid))[2]),
    }
    for name, holder in holders.items():
        store.put_if_absent(f"{leases.LEASES}{name}.json", json.dumps(holder).encode())
    found = lease_listing.leases(store)
    zombie.wait()
    assert [i.key.split("/")[-1] for i in found.dead] == ["exited.json", "reused.json", "zombie.json"]
    assert [i.key.split("/")[-1] for i in found.live] == ["elsewhere.json", "mine.json"]


def test_a_lease_nested_deep_is_held_not_a_recursion_error(tmp_path):
    """A fresh lease whose body is JSON nested 30,000 deep (damaged, or another writer's)
    proves nothing about its holder: it holds until it ages out. gc died of RecursionError."""
    store = open_store(str(tmp_path / "store"))
    key = f"{leases.SAVES.leases}other.json"
    store.put_if_absent(key, b"[" * 30_000 + b"]" * 30_000)
    assert [i.key for i in lease_listing.leases(store).live] == [key]


@pytest.mark.parametrize("pid", [2**70, -(2**70)])
def test_a_lease_naming_a_pid_no_process_can_have_is_held_not_an_overflow_error(tmp_path, pid):
    """A lease of this machine whose pid is beyond any pid (damaged, or another writer's)
    proves nothing about its holder: os.kill raised OverflowError out of gc."""
    store = open_store(str(tmp_path / "store"))
    key = f"{leases.SAVES.leases}other.json"
    body = {**owners.this_process(), "pid": pid}
    assert body.get("machine"), "needs Linux /proc"
    store.put_if_absent(key, json.dumps(body).encode())
    assert [i.key for i in lease_listing.leases(store).live] == [key]
