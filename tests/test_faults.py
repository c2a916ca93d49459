"""Fault injection: crashes at every store operation, SIGKILL mid-save, and GC safety.

Uses tests/faulty_store.py (FaultyStore) to number the store operations of a save and
fail at each one in turn, and to pause a save just before its commit record.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ckptflow import Checkpointer, gc, open_store
from ckptflow import format as fmt
from ckptflow.errors import NoValidCheckpointError
from faulty_store import FaultyStore, InjectedFault

RUN = "r"
CHUNK = 64  # bytes: every tensor below spans several chunks
HERE = Path(__file__).resolve().parent


# ---- helpers ------------------------------------------------------------------------------
def make_state(tag: int) -> dict:
    """A state whose every tensor (and the JSON leaf) identifies the checkpoint ``tag``.

    ``shared`` is identical in every tag so incremental saves dedup it; tags 0 and 1 are
    never saved (0 = empty restore target).
    """
    return {
        "model": {
            "shared": torch.arange(48, dtype=torch.float32),
            "w": torch.arange(30, dtype=torch.float32) + 1000.0 * tag,
        },
        "z": torch.linspace(-1, 1, 40, dtype=torch.float64) * tag,
        "epoch": tag,
    }


def blank_state() -> dict:
    return {
        "model": {"shared": torch.full((48,), -7.0), "w": torch.full((30,), -7.0)},
        "z": torch.full((40,), -7.0, dtype=torch.float64),
        "epoch": None,
    }


def state_tag(state: dict) -> int:
    """Which tag ``state`` holds, asserting that it is exactly one tag's state (no mix)."""
    tag = state["epoch"]
    expected = make_state(tag)
    assert torch.equal(state["model"]["shared"], expected["model"]["shared"])
    assert torch.equal(state["model"]["w"], expected["model"]["w"]), f"weights w are not those of tag {tag}"
    assert torch.equal(state["z"], expected["z"]), f"tensor z is not that of tag {tag}"
    return tag


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


@pytest.fixture(scope="module")
def store_with_a(tmp_path_factory) -> Path:
    """A store holding checkpoint A (step 1, tag 1), committed."""
    root = tmp_path_factory.mktemp("faults-a") / "store"
    with Checkpointer(str(root), run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(1, make_state(1))
    return root


# ---- crash at every store operation --------------------------------------------------------
@pytest.mark.parametrize(
    "kind,when,blocking",
    [
        ("full", "before", True),
        ("full", "after", True),
        ("incremental", "before", True),
        ("incremental", "after", True),
        ("full", "before", False),
    ],
)
def test_crash_at_every_store_operation(store_with_a, tmp_path, kind, when, blocking):
    # Dry run: number the mutating operations of one save of B (step 2, tag 2).
    dry = tmp_path / "dry"
    shutil.copytree(store_with_a, dry)
    fs = FaultyStore(open_store(str(dry)))
    with Checkpointer(fs, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(2, make_state(2), kind=kind)
    ops = fs.mutating_log()
    total = len(ops)
    assert total == fs.ops >= 6, ops
    # The commit record is the last thing a save writes, and it is written create-only.
    assert ops[-1][1:] == ("put_if_absent", fmt.manifest_key(RUN, 2)), ops[-1]
    assert any(op == "replace" and key == fmt.rank_key(RUN, 2, 0) for _, op, key in ops)
    if kind == "incremental":  # the unchanged tensor is deduplicated (touched, not rewritten)
        assert any(op == "touch" for _, op, _key in ops)

    outcomes = []
    for n in range(total):
        root = tmp_path / f"crash-{n}"
        shutil.copytree(store_with_a, root)
        fs = FaultyStore(open_store(str(root)))
        fs.arm(n, when=when)
        ck = Checkpointer(fs, run=RUN, chunk_bytes=CHUNK, threads=4)
        with pytest.raises(InjectedFault):
            if blocking:
                ck.save(2, make_state(2), kind=kind)
            else:
                ck.save(2, make_state(2), kind=kind, blocking=False).wait()
        assert fs.faults, f"op {n}: the armed fault never fired"

        # A fresh process's view: restore whatever the store now says is newest.
        state = blank_state()
        fresh = Checkpointer(str(root), run=RUN, restore_rng=False)
        result = fresh.restore(state)
        tag = state_tag(state)  # exactly one checkpoint's tensors and JSON, never a mix
        committed_b = when == "after" and n == total - 1
        assert (result.step, tag) == ((2, 2) if committed_b else (1, 1)), f"crash at op {n} ({ops[n][1]})"
        assert fresh.verify(result.step).ok
        assert fresh.verify(1).ok, f"crash at op {n} damaged the older checkpoint"
        fresh.close()
        outcomes.append(result.step)

        # The checkpointer whose save failed keeps working once the store does, also when
        # it saves other data under the step that failed (its leftovers must not leak in).
        fs.disarm()
        retry = 3 if committed_b else 2
        saved = ck.save(retry, make_state(3), kind=kind)
        assert saved.step == retry and saved.info is not None
        state = blank_state()
        after = Checkpointer(str(root), run=RUN, restore_rng=False)
        assert after.restore(state).step == retry and state_tag(state) == 3
        assert after.verify(retry).ok and after.verify(1).ok
        after.close()
        ck.close()
        shutil.rmtree(root)
    assert len(outcomes) == total


def test_crash_on_every_read_during_restore_never_loads_a_mix(store_with_a, tmp_path):
    """A read failure on a newer checkpoint falls back; the live state is untouched or whole."""
    root = tmp_path / "store"
    shutil.copytree(store_with_a, root)
    with Checkpointer(str(root), run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(2, make_state(2), kind="incremental")
    fs = FaultyStore(open_store(str(root)), count_reads=True)
    ck = Checkpointer(fs, run=RUN, restore_rng=False, threads=4)
    ck.restore(blank_state())
    total = fs.ops
    assert total >= 8
    for n in range(total):
        fs.reset_counts()
        fs.arm(n, sticky=False)  # one transient read error at op n
        state = blank_state()
        try:
            result = ck.restore(state)
        except (InjectedFault, NoValidCheckpointError):
            # The listing or the last candidate failed: nothing was loaded into the state.
            assert state["epoch"] is None and torch.equal(state["z"], blank_state()["z"])
            continue
        assert state_tag(state) == result.step
    ck.close()


# ---- SIGKILL mid-save ----------------------------------------------------------------------
SIGKILL_N = 1 << 19  # float64 elements per tensor: 2 tensors = 8 MiB per save


def sigkill_expected(step: int) -> dict:
    base = torch.arange(SIGKILL_N, dtype=torch.float64)
    return {"w": base + step, "v": base * -0.5 - step}


def committed_steps(root: Path) -> list[int]:
    d = root / "runs" / RUN / "checkpoints"
    if not d.is_dir():
        return []
    return sorted(int(p.parent.name) for p in d.glob("*/manifest.json"))


@pytest.mark.timeout(120)
def test_sigkill_mid_save_always_leaves_a_restorable_store(tmp_path):
    root = tmp_path / "store"
    rng = random.Random(20240601)
    kills = []
    deadline = time.monotonic() + 75
    script = HERE / "sigkill_saver.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    for attempt in range(3):
        before = committed_steps(root)
        log = open(tmp_path / f"child-{attempt}.log", "wb")
        child = subprocess.Popen(
            [sys.executable, str(script), str(root), RUN, str(SIGKILL_N), str(1 << 18)],
            stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            # Wait for a commit made by this child, then kill it a random moment later.
            while committed_steps(root) == before:
                assert child.poll() is None, (tmp_path / f"child-{attempt}.log").read_text()
                assert time.monotonic() < deadline, "the saver never committed a checkpoint"
                time.sleep(0.01)
            delay = rng.uniform(0.0, 0.3)
            time.sleep(delay)
            assert child.poll() is None, (tmp_path / f"child-{attempt}.log").read_text()
            os.kill(child.pid, signal.SIGKILL)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait(30)
            log.close()
        assert child.returncode == -signal.SIGKILL
        kills.append((delay, committed_steps(root)))

        # Restore in this process: the newest intact checkpoint, exactly step's weights.
        ck = Checkpointer(str(root), run=RUN, restore_rng=False)
        state = {"w": torch.zeros(SIGKILL_N, dtype=torch.float64), "v": torch.zeros(SIGKILL_N, dtype=torch.float64), "step": -1}
        result = ck.restore(state)
        expected = sigkill_expected(result.step)
        assert torch.equal(state["w"], expected["w"]) and torch.equal(state["v"], expected["v"])
        assert state["step"] == result.step
        assert result.step == max(committed_steps(root))  # every commit record is intact
        assert result.skipped == [(s, r) for s, r in result.skipped if s > result.step]
        # No commit record may point at a checkpoint that fails verification.
        for step in committed_steps(root):
            report = ck.verify(step)
            assert report.ok, (step, report.problems)
        ck.close()
    assert len(kills) == 3

    # GC after the crashes removes temp files and orphans, and leaves every commit whole.
    report = gc(open_store(str(root)), grace=0, now=time.time() + 5)
    ck = Checkpointer(str(root), run=RUN, restore_rng=False)
    assert not [p for p in root.rglob(".tmp-*")], "gc left temp files of killed writers behind"
    for step in committed_steps(root):
        assert ck.verify(step).ok
    assert not [key for key, _ in report.deleted if key.endswith("manifest.json")]
    assert all(
        key.startswith(("chunks/", "locks/leases/")) or "/ranks/" in key or "/.tmp-" in key
        for key, _ in report.deleted
    )
    ck.close()
    shutil.rmtree(root)  # a few hundred MB; pytest keeps old temp dirs around


# ---- GC safety -----------------------------------------------------------------------------
def test_gc_after_retention_deletes_exactly_the_unreferenced_chunks(tmp_path):
    root = tmp_path / "store"
    store = open_store(str(root))
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        for step in range(1, 6):
            ck.save(step, make_state(step), kind="full" if step % 2 else "incremental")
    for step in (1, 2, 4):  # what a retention policy would expire
        store.delete(fmt.manifest_key(RUN, step))

    live = manifest_chunks(root, 3) | manifest_chunks(root, 5)
    chunks_before = chunk_keys(root)
    orphans = {
        info.key: info.size for s in (1, 2, 4) for info in store.list(fmt.step_prefix(RUN, s))
    }
    assert set(orphans) == {fmt.rank_key(RUN, s, 0) for s in (1, 2, 4)}
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


def _paused_save_with_concurrent_gc(root: Path, grace) -> tuple:
    """Save step 2 but hold it just before its commit record while GC runs; resume it."""
    inner = open_store(str(root))
    with Checkpointer(inner, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(1, make_state(1))
    fs = FaultyStore(inner)
    pause = fs.pause_before("put_if_absent", lambda key: key == fmt.manifest_key(RUN, 2))
    ck = Checkpointer(fs, run=RUN, chunk_bytes=CHUNK, threads=4)
    outcome: list = []

    def save() -> None:
        try:
            outcome.append(ck.save(2, make_state(2), kind="incremental"))
        except BaseException as e:  # reported to the test thread below
            outcome.append(e)

    saver = threading.Thread(target=save)
    saver.start()
    try:
        assert pause.reached.wait(30), "the save never reached its commit"
        assert not inner.exists(fmt.manifest_key(RUN, 2))
        # A GC that starts while the save is in flight (a moment after its chunks landed).
        report = gc(inner, grace=grace, now=time.time() + 2)
    finally:
        pause.release()
        saver.join(30)
    assert not saver.is_alive()
    (saved,) = outcome
    assert not isinstance(saved, BaseException), saved
    ck.close()
    return report, saved


def test_gc_with_zero_grace_destroys_an_in_flight_save(tmp_path):
    root = tmp_path / "store"
    report, saved = _paused_save_with_concurrent_gc(root, grace=0)
    new_chunks = manifest_chunks(root, 2) - manifest_chunks(root, 1)
    assert new_chunks
    deleted = {key for key, _ in report.deleted}
    # The in-flight save's new chunks and rank record looked like garbage and were swept.
    assert deleted == new_chunks | {fmt.rank_key(RUN, 2, 0)}
    assert saved.step == 2 and saved.info is not None  # the writer did not notice
    ck = Checkpointer(str(root), run=RUN, restore_rng=False)
    report2 = ck.verify(2)
    assert not report2.ok  # grace=0 is unsafe: a committed checkpoint lost its data
    assert sum("missing" in p for p in report2.problems) == len(new_chunks) + 1
    assert ck.verify(1).ok
    state = blank_state()
    result = ck.restore(state)
    assert result.step == 1 and [s for s, _ in result.skipped] == [2] and state_tag(state) == 1
    ck.close()


def test_gc_grace_period_protects_an_in_flight_save(tmp_path):
    root = tmp_path / "store"
    chunks_seen: dict = {}
    report, saved = _paused_save_with_concurrent_gc(root, grace="1h")
    assert report.deleted == [] and report.bytes == 0
    assert report.live_manifests == 1
    ck = Checkpointer(str(root), run=RUN, restore_rng=False)
    assert ck.verify(2).ok and ck.verify(1).ok
    state = blank_state()
    assert ck.restore(state).step == 2 and state_tag(state) == 2
    chunks_seen.update(chunk_keys(root))
    assert manifest_chunks(root, 1) | manifest_chunks(root, 2) == set(chunks_seen)
    ck.close()


def test_gc_removes_stale_temp_files_only(tmp_path):
    root = tmp_path / "store"
    store = open_store(str(root))
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(1, make_state(1))
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


def test_gc_sweep_racing_a_deduplicating_save(tmp_path):
    """GC lists a chunk as garbage; a save of the same content starts before GC deletes it.

    Without the lease/lock handshake the save would reuse the chunk (stat + touch) and
    commit a checkpoint whose chunk GC then deletes. With it, the save waits for the
    sweep and writes the chunks again, so its checkpoint verifies.
    """
    root = tmp_path / "store"
    inner = open_store(str(root))
    with Checkpointer(inner, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(1, make_state(1))
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
        saver = threading.Thread(target=lambda: saved.append(
            Checkpointer(inner, run=RUN, chunk_bytes=CHUNK, threads=4).save(2, make_state(1), kind="incremental")
        ))
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
