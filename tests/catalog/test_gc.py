"""GC safety: after retention GC deletes exactly the unreferenced chunks; the grace period
and the save's lease protect a save in flight (grace=0 included); only stale temp files go; a sweep racing
a deduplicating save is serialised by the lease/lock handshake.

Uses tests/support/faulty_store.py (FaultyStore) to pause a save just before its commit record, or
a GC sweep just before it deletes. Crash and SIGKILL tests are in training/test_crashes.py; the tagged
states both files use are in tests/support/states.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptflow import Checkpointer, gc, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import leases
from ckptflow.errors import StoreUnavailableError
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from support.child_env import child_env
from support.corrupt import rank_files
from support.faulty_store import FaultyStore
from support.states import CHUNK, RUN, blank_state, state_tag, tagged_state

TESTS = Path(__file__).resolve().parents[1]


# ---- helpers ------------------------------------------------------------------------------
def chunk_keys(root: Path) -> dict[str, int]:
    return {info.key: info.size for info in open_store(str(root)).list("chunks/")}


def all_files(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return out


def manifest_chunks(root: Path, step: int) -> set[str]:
    blob = (root / fmt.manifest_key(RUN, step)).read_bytes()
    return {fmt.chunk_key(d) for d in json.loads(blob)["chunks"]}


# ---- GC safety -----------------------------------------------------------------------------
def test_gc_after_retention_deletes_exactly_the_unreferenced_chunks(tmp_path):
    root = tmp_path / "store"
    store = open_store(str(root))
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        for step in range(1, 6):
            ck.save(step, tagged_state(step), kind="full" if step % 2 else "incremental")
    for step in (1, 2, 4):  # what a retention policy would expire
        store.delete(fmt.manifest_key(RUN, step))

    live = manifest_chunks(root, 3) | manifest_chunks(root, 5)
    chunks_before = chunk_keys(root)
    orphans = {info.key: info.size for s in (1, 2, 4) for info in store.list(fmt.step_prefix(RUN, s))}
    assert set(orphans) == set().union(*(rank_files(store, RUN, s) for s in (1, 2, 4)))
    expected = {k: size for k, size in chunks_before.items() if k not in live} | orphans
    assert expected and live <= set(chunks_before)
    # The tensor shared by every step is referenced by the kept ones and must survive.
    assert manifest_chunks(root, 3) & manifest_chunks(root, 5)

    now = time.time() + 5  # every object is older than a zero grace period
    files_before = all_files(root)
    dry = gc(store, grace=0, dry_run=True, now=now)
    assert dry.dry_run and dict(dry.deleted) == expected
    assert len(dry.deleted) == len(expected)
    assert dry.bytes == sum(expected.values())
    assert dry.live_manifests == 2 and not dry.unreadable_manifests
    assert all_files(root) == files_before, "a dry run changed the store"

    real = gc(store, grace=0, now=now)
    assert sorted(real.deleted) == sorted(dry.deleted) and real.bytes == dry.bytes
    assert set(chunk_keys(root)) == live
    assert not any(store.exists(k) for k in orphans)

    ck = Checkpointer(store, run=RUN, restore_rng=False)
    for step in (3, 5):
        assert ck.verify(step).ok
        state = blank_state()
        assert ck.restore(state, step=step).step == step and state_tag(state) == step
    state = blank_state()
    result = ck.restore(state)
    assert result.step == 5 and state_tag(state) == 5
    ck.close()
    assert gc(store, grace=0, now=now).deleted == []


def _paused_save_with_concurrent_gc(root: Path, grace, before: str) -> tuple:
    """Save step 2 but hold it just before its rank record or its manifest (``before``), the
    gap between the chunks and the commit, while GC runs; resume it."""
    inner = open_store(str(root))
    with Checkpointer(inner, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(1, tagged_state(1))
    fs = FaultyStore(inner)
    where = {"rank record": "/ranks/", "manifest": fmt.manifest_key(RUN, 2)}[before]
    pause = fs.pause_before("put_if_absent", lambda key: key.startswith(fmt.step_prefix(RUN, 2)) and where in key)
    ck = Checkpointer(fs, run=RUN, chunk_bytes=CHUNK, threads=4)
    outcome: list = []

    def save() -> None:
        try:
            outcome.append(ck.save(2, tagged_state(2), kind="incremental"))
        except BaseException as e:  # reported to the test thread below
            outcome.append(e)

    saver = threading.Thread(target=save)
    saver.start()
    try:
        assert pause.reached.wait(30), f"the save never reached its {before}"
        assert not inner.exists(fmt.manifest_key(RUN, 2))
        # A GC that starts while the save is in flight (a moment after its chunks landed).
        report = gc(inner, grace=grace, now=time.time() + 2, wait=0)
    finally:
        pause.release()
        saver.join(30)
    assert not saver.is_alive()
    (saved,) = outcome
    ck.close()
    return report, saved


def assert_no_commit_misses_a_chunk(root: Path) -> None:
    store = open_store(str(root))
    for item in catalog.committed(store):
        assert isinstance(item, Manifest), item
        missing = [d for d in item.chunks if not store.exists(fmt.chunk_key(d))]
        missing += [k for k in item.rank_keys() if not store.exists(k)]
        assert missing == [], f"step {item.step} is committed but {missing} are gone"


@pytest.mark.parametrize("grace", [0, "1h"])
@pytest.mark.parametrize("before", ["rank record", "manifest"])
def test_gc_sweeps_nothing_while_a_save_is_between_its_chunks_and_its_commit(tmp_path, grace, before):
    """The save's lease covers it from planning to commit: a GC in that gap, even with
    grace 0, waits for it (here ``wait=0``: skips) instead of sweeping its chunks and rank
    records. The lease used to end with the chunk phase: a GC with a grace shorter than the
    gap (a coordinator stalled in it) swept them, and the save committed a checkpoint whose
    chunks were gone."""
    root = tmp_path / "store"
    report, saved = _paused_save_with_concurrent_gc(root, grace, before)
    assert not isinstance(saved, BaseException), saved
    assert report.deleted == [] and report.skipped and "writing chunks" in report.skipped
    assert saved.step == 2 and saved.info is not None
    assert_no_commit_misses_a_chunk(root)
    ck = Checkpointer(str(root), run=RUN, restore_rng=False)
    assert ck.verify(2).ok and ck.verify(1).ok
    state = blank_state()
    assert ck.restore(state).step == 2 and state_tag(state) == 2
    ck.close()
    assert gc(str(root), grace=0, now=time.time() + 5).deleted == []  # once committed, nothing is garbage


def test_a_save_whose_lease_lapsed_before_its_commit_commits_nothing(tmp_path, monkeypatch):
    """The coordinator's lease renewals stop (a stall, an outage) between its chunks and
    its commit, long enough for GC to judge the save dead and sweep its chunks: the commit
    is refused, and nothing is committed that names a chunk that is gone."""
    monkeypatch.setattr(leases, "HEARTBEAT", 0.05)
    monkeypatch.setattr(leases, "DEAD_AFTER", 0.5)
    root = tmp_path / "store"
    inner = open_store(str(root))
    with Checkpointer(inner, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(1, tagged_state(1))
    fs = FaultyStore(inner)
    pause = fs.pause_before("put_if_absent", lambda key: key.startswith(fmt.step_prefix(RUN, 2)) and "/ranks/" in key)
    outcome: list = []

    def save() -> None:
        try:
            with Checkpointer(fs, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
                outcome.append(ck.save(2, tagged_state(2)))
        except BaseException as e:  # reported to the test thread below
            outcome.append(e)

    saver = threading.Thread(target=save)
    saver.start()
    try:
        assert pause.reached.wait(30)
        fs.fail_if = lambda op, key: op == "touch" and key.startswith(leases.LEASES)  # renewals stop
        time.sleep(3 * leases.DEAD_AFTER)
        report = gc(inner, grace=0, now=time.time() + 2, wait=0)
        assert report.deleted  # the save looked dead (or held no lease): its chunks went
    finally:
        pause.release()
        saver.join(30)
    (error,) = outcome
    assert isinstance(error, StoreUnavailableError), error
    assert "could not be renewed" in str(error) or "was lost" in str(error)
    assert "nothing was committed" in str(error) or "save again" in str(error)
    assert not inner.exists(fmt.manifest_key(RUN, 2))
    assert_no_commit_misses_a_chunk(root)
    with Checkpointer(str(root), run=RUN, restore_rng=False) as ck:
        assert ck.verify(1).ok


def test_gc_removes_stale_temp_files_only(tmp_path):
    root = tmp_path / "store"
    store = open_store(str(root))
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(1, tagged_state(1))
    digest = next(iter(manifest_chunks(root, 1)))
    chunk_dir = root / os.path.dirname(digest)
    step_dir = root / os.path.dirname(fmt.manifest_key(RUN, 1))
    old = time.time() - 2 * 3600
    stale = {
        chunk_dir / ".tmp-deadbeef": b"x" * 10,
        step_dir / ".tmp-cafebabe": b"y" * 20,
        chunk_dir / (os.path.basename(digest) + ".claim"): b"",
    }
    fresh = {chunk_dir / ".tmp-fresh0001": b"z" * 30}
    for path, data in {**stale, **fresh}.items():
        path.write_bytes(data)
    for path in stale:
        os.utime(path, (old, old))

    expected = {os.path.relpath(p, root): len(data) for p, data in stale.items()}
    dry = gc(store, grace="1h", dry_run=True)
    assert dict(dry.deleted) == expected and dry.bytes == 30
    assert all(p.exists() for p in {**stale, **fresh})

    report = gc(store, grace="1h")
    assert dict(report.deleted) == expected
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in fresh)  # may belong to a write in progress
    with Checkpointer(store, run=RUN) as ck:
        assert ck.verify(1).ok


def test_gc_through_a_faulty_store_deletes_what_gc_on_the_store_itself_does(tmp_path):
    """FaultyStore left ``stale_temp_files`` to Store's default (none), so gc through it swept no
    dead writer's temp file, claim or empty directory that gc on the store itself sweeps."""
    root = tmp_path / "store"
    with Checkpointer(open_store(str(root)), run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(1, tagged_state(1))
    digest = next(iter(manifest_chunks(root, 1)))
    chunk_dir = root / os.path.dirname(digest)
    (chunk_dir / ".tmp-deadbeef").write_bytes(b"x" * 10)
    (chunk_dir / (os.path.basename(digest) + ".claim")).write_bytes(b"")
    (root / os.path.dirname(fmt.manifest_key(RUN, 7))).mkdir(parents=True)  # a killed save's empty step
    old = time.time() - 2 * 3600
    for path in (chunk_dir / ".tmp-deadbeef", chunk_dir / (os.path.basename(digest) + ".claim")):
        os.utime(path, (old, old))
    os.utime(root / os.path.dirname(fmt.manifest_key(RUN, 7)), (old, old))
    shutil.copytree(root, tmp_path / "copy")  # times kept

    plain = gc(open_store(str(tmp_path / "copy")), grace="1h")
    wrapped = gc(FaultyStore(open_store(str(root))), grace="1h")
    assert {f"{os.path.dirname(digest)}/.tmp-deadbeef", f"{os.path.dirname(fmt.manifest_key(RUN, 7))}/"} <= {
        key for key, _ in plain.deleted
    }
    assert sorted(wrapped.deleted) == sorted(plain.deleted)
    assert sorted(all_files(root)) == sorted(all_files(tmp_path / "copy"))


def test_gc_sweep_racing_a_deduplicating_save(tmp_path):
    """GC lists a chunk as garbage; a save of the same content starts before GC deletes it.

    Without the lease/lock handshake the save would reuse the chunk (stat + touch) and
    commit a checkpoint whose chunk GC then deletes. With it, the save waits for the
    sweep and writes the chunks again, so its checkpoint verifies.
    """
    root = tmp_path / "store"
    inner = open_store(str(root))
    with Checkpointer(inner, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(1, tagged_state(1))
    inner.delete(fmt.manifest_key(RUN, 1))  # retention expired step 1: its chunks are garbage
    old = time.time() - 7200
    for path in root.rglob("*"):
        if path.is_file():
            os.utime(path, (old, old))
    gc_view = FaultyStore(inner)
    pause = gc_view.pause_before("delete", lambda key: key.startswith("chunks/"))
    swept: list = []
    sweeper = threading.Thread(target=lambda: swept.append(gc(gc_view, grace="1h")))
    sweeper.start()
    saved: list = []
    try:
        assert pause.reached.wait(30)
        saver = threading.Thread(
            target=lambda: saved.append(
                Checkpointer(inner, run=RUN, chunk_bytes=CHUNK, threads=4).save(2, tagged_state(1), kind="incremental")
            )
        )
        saver.start()
        saver.join(0.5)
        assert saver.is_alive(), "the save must wait while GC holds its lock"
    finally:
        pause.release()
        sweeper.join(30)
    saver.join(30)
    assert swept and swept[0].deleted, "the sweep deleted step 1's chunks"
    assert saved and saved[0].info.bytes_written > 0, "the save rewrote the chunks GC deleted"
    with Checkpointer(inner, run=RUN) as ck:
        report = ck.verify(2)
        assert report.ok, report.problems
        state = blank_state()
        assert ck.restore(state).step == 2
    assert state_tag(state) == 1


def test_gc_keeps_every_chunk_a_damaged_manifest_names_anywhere(tmp_path):
    """A bit flipped in a digest of the manifest's chunk map (its JSON still parses, its seal
    fails): the items still name the real chunk, and GC keeps it for a repair from a copy."""
    root = tmp_path / "store"
    store = open_store(str(root))
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK) as ck:
        for step in (1, 2):
            ck.save(step, tagged_state(step))
    own = sorted(manifest_chunks(root, 1) - manifest_chunks(root, 2))
    assert own
    path = root / fmt.manifest_key(RUN, 1)
    blob = path.read_bytes()
    first = blob.index(own[0].rsplit("/", 1)[-1].encode(), blob.index(b'"chunks":{'))  # its key in the chunk map
    path.write_bytes(blob[:first] + (b"0" if blob[first : first + 1] != b"0" else b"1") + blob[first + 1 :])
    report = gc(store, grace=0, now=time.time() + 5)
    assert len(report.unreadable_manifests) == 1 and report.skipped is None
    assert all(store.exists(key) for key in own)


@pytest.mark.parametrize("where", ["rank record", "manifest", "step directory"])
def test_gc_after_a_save_killed_mid_write_leaves_no_empty_directory(tmp_path, where):
    """A save SIGKILLed after writing a temp file, before linking it, or after making its
    step's directory, before writing in it: GC deletes the temp file and the directories
    left empty. It used to leave them, and every restore then skipped the empty step
    directory as an uncommitted checkpoint, for ever."""
    root = tmp_path / "store"
    child = subprocess.run(
        [sys.executable, str(TESTS / "support" / "killed_writer.py"), str(root), RUN, where],
        env=child_env(TESTS.parent),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert (root / fmt.step_prefix(RUN, 2)).is_dir() and not (root / fmt.manifest_key(RUN, 2)).exists()

    report = gc(open_store(str(root)), grace=0)
    assert report.skipped is None
    assert not list(root.rglob(".tmp-*"))
    with Checkpointer(str(root), run=RUN, restore_rng=False) as ck:
        state = blank_state()
        result = ck.restore(state)
    assert (result.step, state_tag(state), result.skipped) == (1, 1, [])
    runs = root / "runs"
    assert [str(d.relative_to(root)) for d in runs.rglob("*") if d.is_dir() and not any(d.iterdir())] == []


def test_a_gc_skipped_for_a_save_in_flight_says_the_lease_timing_in_force(tmp_path, monkeypatch):
    """A lease is live if renewed within ``DEAD_AFTER`` as set when GC lists it
    (``lease_listing`` reads it at each call); the skip named the value imported when
    ``gc`` loaded (30 s) whatever the setting (a process that sets a shorter one, as the
    stalled-save tests' children do)."""
    monkeypatch.setattr(leases, "DEAD_AFTER", 8.0)
    store = open_store(str(tmp_path / "store"))
    with leases.save_lease(store):
        report = gc(store, grace=0, wait=0)
    assert report.skipped is not None and "renewed within the last 8 s" in report.skipped, report.skipped
