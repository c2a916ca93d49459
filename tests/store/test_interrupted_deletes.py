"""A conditional delete (``LocalStore.delete_if``) killed between the rename that takes its
key's file aside and the link back of a version it was not to delete: that version is put
back by the next GC, never swept as a temp file.

The window is real without any bug elsewhere: retention expiring a commit record races a
save that moves the same (damaged) record into quarantine and commits the step again; the
retention's rename can take the new commit aside. It used to be a ``.tmp-`` file, which GC
deleted, and the new checkpoint was lost with its chunks.
"""

from __future__ import annotations

import hashlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptflow import Checkpointer, gc, open_store
from ckptflow.chunks import owners
from ckptflow.chunks.leases import GC_LOCK, PROMOTIONS
from ckptflow.format import layout as fmt
from ckptflow.store import local_cas
from support.child_env import child_env
from support.cli import run_cli
from support.faulty_store import FaultyStore
from support.states import CHUNK, RUN, blank_state, state_tag, tagged_state

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("recommitted", [True, False])
def test_a_delete_killed_after_its_rename_loses_no_valid_version(tmp_path, monkeypatch, capsys, recommitted):
    root = tmp_path / "store"
    key = fmt.manifest_key(RUN, 1)
    path = root / key
    with Checkpointer(str(root), RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
    expired = path.read_bytes()
    path.unlink()
    with Checkpointer(str(root), RUN, chunk_bytes=CHUNK) as ck:  # the step saved again: another commit
        ck.save(1, tagged_state(2))
    recommit = tmp_path / "recommit.json"
    recommit.write_bytes(path.read_bytes())
    path.write_bytes(expired)  # the commit retention expires, read as this version
    args = [str(root), key, hashlib.sha256(expired).hexdigest()] + ([str(recommit)] if recommitted else [])
    child = subprocess.run(
        [sys.executable, str(TESTS / "support" / "killed_delete.py"), *args],
        env=child_env(TESTS.parent),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert not path.exists()  # taken aside, and the process died before putting anything back

    monkeypatch.setattr(local_cas, "ASIDE_SETTLED_S", 0.0)  # as if a minute had passed
    code, _, err = run_cli(capsys, "gc", str(root), "--grace", "0", "--force")  # the GC an operator runs
    assert code == 0, err
    assert not list(root.rglob(".*.aside-*"))
    if not recommitted:  # the aside file held the version to delete: its delete is finished
        assert not path.exists() and "put back" not in err
        return
    assert path.exists() and path.read_bytes() == recommit.read_bytes()  # the new commit is back
    assert f"put back {key}" in err, err  # and the operator is told
    with Checkpointer(str(root), RUN, restore_rng=False) as ck:
        assert ck.verify(1).ok
        state = blank_state()
        assert ck.restore(state).step == 1 and state_tag(state) == 2


def test_gc_leaves_a_file_a_live_delete_has_taken_aside(tmp_path):
    """A file taken aside less than ``ASIDE_SETTLED_S`` ago may be a running delete's,
    between its rename and its compare: GC neither puts it back nor deletes it (pending)."""
    store = open_store(str(tmp_path))
    store.put_if_absent("locks/gc.json", b"a holder's lock")
    version = store.get_versioned("locks/gc.json")[1]
    aside = tmp_path / "locks" / f".gc.json.aside-{version}-{'0' * 32}"
    (tmp_path / "locks" / "gc.json").rename(aside)
    settled = store.settle_interrupted_deletes()
    assert settled.restored == [] and settled.pending == ["locks/gc.json"]
    assert aside.exists() and not store.exists("locks/gc.json")


def test_gc_sweeps_nothing_while_a_commit_is_taken_aside_too_recently_to_settle(tmp_path, monkeypatch):
    """A delete killed less than ``ASIDE_SETTLED_S`` ago left another version of a commit
    aside: GC may not settle it yet, nor can it mark that commit's chunks, so it sweeps
    nothing. It used to sweep them (older than the grace: a save longer than the grace),
    and the next GC put back a commit whose chunks were gone."""
    root = tmp_path / "store"
    key = fmt.manifest_key(RUN, 1)
    path = root / key
    with Checkpointer(str(root), RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
    recommit = tmp_path / "recommit.json"
    recommit.write_bytes(path.read_bytes())
    path.write_bytes(b"the commit retention expires")  # replaced by the re-commit between the check and the rename
    expected = hashlib.sha256(path.read_bytes()).hexdigest()
    child = subprocess.run(
        [sys.executable, str(TESTS / "support" / "killed_delete.py"), str(root), key, expected, str(recommit)],
        env=child_env(TESTS.parent),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    chunks = sorted(p.name for p in (root / "chunks").rglob("*") if p.is_file())

    later = time.time() + 7200  # the chunks are older than the grace: written early in a long save
    report = gc(open_store(str(root)), grace="1h", now=later)
    assert report.skipped is not None and key in report.skipped and report.deleted == []
    assert sorted(p.name for p in (root / "chunks").rglob("*") if p.is_file()) == chunks

    monkeypatch.setattr(local_cas, "ASIDE_SETTLED_S", 0.0)  # a minute later
    report = gc(open_store(str(root)), grace="1h", now=later)
    assert report.skipped is None and report.restored == [key]
    with Checkpointer(str(root), RUN, restore_rng=False) as ck:
        assert ck.verify(1).ok


def test_a_delete_killed_after_its_link_back_leaves_nothing_aside(tmp_path, monkeypatch, caplog):
    """Killed after it linked the other version back and before it removed the name it had
    taken aside: both names are the one file. GC used to find the key taken, warn at every
    sweep that the version taken is kept aside ('compare the two': they are one file) and
    keep the hidden name for good."""
    store = open_store(str(tmp_path))
    store.put_if_absent("locks/gc.json", b"the new holder's lock")
    path = tmp_path / "locks" / "gc.json"
    aside = tmp_path / "locks" / f".gc.json.aside-{hashlib.sha256(b'the old lock').hexdigest()}-{'0' * 32}"
    aside.hardlink_to(path)  # what the link back leaves, until the delete removes the aside name
    monkeypatch.setattr(local_cas, "ASIDE_SETTLED_S", 0.0)  # a minute later
    with caplog.at_level("WARNING", logger="ckptflow"):
        settled = store.settle_interrupted_deletes()
    assert not aside.exists() and path.read_bytes() == b"the new holder's lock"
    assert settled.restored == [] and settled.pending == [] and caplog.records == []


def test_a_dry_run_lists_what_gc_then_deletes_while_a_commit_is_taken_aside(tmp_path, monkeypatch):
    """A commit taken aside by a conditional delete (killed, or under way): a dry run did not
    settle asides, so it listed that commit's chunks as deletable (older than the grace)
    while the gc after it swept nothing (pending) or put the commit back first and kept
    them. It decides as a gc would, writing nothing."""
    root = tmp_path / "store"
    key = fmt.manifest_key(RUN, 1)
    path = root / key
    with Checkpointer(str(root), RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
    aside = _taken_aside(path)  # the re-commit, taken aside in the expired version's place
    chunks = sorted(p.name for p in (root / "chunks").rglob("*") if p.is_file())
    later = time.time() + 7200  # the chunks are older than the grace

    dry = gc(open_store(str(root)), grace="1h", now=later, dry_run=True)
    assert dry.skipped is not None and key in dry.skipped and dry.deleted == []  # listed every chunk of step 1
    assert sorted(p.name for p in (root / "chunks").rglob("*") if p.is_file()) == chunks and aside.exists()
    real = gc(open_store(str(root)), grace="1h", now=later)
    assert real.skipped == dry.skipped and real.deleted == dry.deleted == []
    assert sorted(p.name for p in (root / "chunks").rglob("*") if p.is_file()) == chunks and aside.exists()

    monkeypatch.setattr(local_cas, "ASIDE_SETTLED_S", 0.0)  # a minute later: a gc puts it back first
    dry = gc(open_store(str(root)), grace="1h", now=later, dry_run=True)
    assert dry.skipped is not None and "puts it back first" in dry.skipped and dry.deleted == []
    assert aside.exists() and not path.exists() and dry.restored == []  # a dry run writes nothing
    real = gc(open_store(str(root)), grace="1h", now=later)
    assert real.skipped is None and real.restored == [key] and real.deleted == []
    dry = gc(open_store(str(root)), grace="1h", now=later, dry_run=True)
    assert dry.skipped is None and dry.deleted == []
    with Checkpointer(str(root), RUN, restore_rng=False) as ck:
        assert ck.verify(1).ok


def _release_killed_after_taking_over(root: Path, lock: str, tmp_path: Path) -> None:
    """A holder's release of ``lock`` (``delete_if`` of its own version) killed after its
    rename, another holder having taken the lock over between its compare and its rename:
    the rename took the new holder's lock aside, and the link back never came."""
    store = open_store(str(root))
    ours = owners.body("garbage collection", "a" * 32)
    store.put_if_absent(lock, ours)
    taker = tmp_path / "taker.json"
    taker.write_bytes(owners.body("garbage collection", "b" * 32))
    child = subprocess.run(
        [sys.executable, str(TESTS / "support" / "killed_delete.py"), str(root), lock, _sha(ours), str(taker)],
        env=child_env(TESTS.parent),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert not store.exists(lock) and len(list(root.rglob(".*.aside-*"))) == 1


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_the_gc_lock_a_killed_release_took_aside_is_removed_by_the_next_gc(tmp_path, monkeypatch, caplog):
    """The new holder's heartbeat found its lock gone within seconds and gave it up. Every
    GC settles while it holds gc.json, so that lock could never go back: each GC kept it
    aside and warned to compare the two, for good. A lock its holder gave up is no data."""
    root = tmp_path / "store"
    _release_killed_after_taking_over(root, GC_LOCK, tmp_path)
    monkeypatch.setattr(local_cas, "ASIDE_SETTLED_S", 0.0)  # a minute later
    with caplog.at_level("WARNING", logger="ckptflow"):
        report = gc(open_store(str(root)), grace="0")
    assert report.skipped is None and report.restored == []
    assert not list(root.rglob(".*.aside-*")) and not open_store(str(root)).exists(GC_LOCK)
    assert [r.getMessage() for r in caplog.records if "aside" in r.getMessage()] == []


def test_the_retention_lock_a_killed_release_took_aside_is_not_put_back(tmp_path, monkeypatch):
    """With retention.json free, GC put the given-up lock back under it, as if a commit, and
    said so ('put back'): a lock no one held, that the next retention took over as a dead
    holder's."""
    root = tmp_path / "store"
    _release_killed_after_taking_over(root, PROMOTIONS.lock, tmp_path)
    monkeypatch.setattr(local_cas, "ASIDE_SETTLED_S", 0.0)  # a minute later
    report = gc(open_store(str(root)), grace="0")
    assert report.skipped is None and report.restored == []
    assert not list(root.rglob(".*.aside-*")) and not open_store(str(root)).exists(PROMOTIONS.lock)


def test_what_a_dry_run_says_to_do_about_a_commit_to_put_back_sweeps_nothing(tmp_path, monkeypatch):
    """The dry run that stops at a commit a gc would first put back said 'run gc (it puts it
    back), then a dry run lists the rest': that gc swept the garbage the dry run was run to
    preview. What it says to run puts the commit back and sweeps nothing."""
    root = tmp_path / "store"
    key = fmt.manifest_key(RUN, 1)
    path = root / key
    with Checkpointer(str(root), RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
        ck.save(2, tagged_state(2))
    (root / fmt.manifest_key(RUN, 2)).unlink()  # step 2's chunks: garbage
    _taken_aside(path)
    monkeypatch.setattr(local_cas, "ASIDE_SETTLED_S", 0.0)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".aside-" not in p.name)
    later = time.time() + 7200  # every chunk is older than the grace

    dry = gc(open_store(str(root)), grace="1h", now=later, dry_run=True)
    assert dry.skipped is not None and dry.deleted == [], dry
    told = re.search(r"`ckptflow gc (\S+) --grace (\S+)`", dry.skipped)
    assert told is not None, dry.skipped
    done = gc(open_store(told[1]), grace=told[2], now=later)
    assert done.skipped is None and done.restored == [key] and done.deleted == []
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == sorted([*files, key])
    dry = gc(open_store(str(root)), grace="1h", now=later, dry_run=True)
    assert dry.skipped is None and any(k.startswith("chunks/") for k, _ in dry.deleted)  # the garbage, listed now
    with Checkpointer(str(root), RUN, restore_rng=False) as ck:
        assert ck.verify(1).ok


def test_gc_through_a_faulty_store_settles_what_the_store_it_wraps_took_aside(tmp_path, monkeypatch):
    """``FaultyStore`` (tests/support) did not pass ``settle_interrupted_deletes`` to the
    store it wraps: GC through it settled nothing, saw no commit of step 1 and swept its
    chunks, which no GC on the store itself does."""
    root = tmp_path / "store"
    key = fmt.manifest_key(RUN, 1)
    path = root / key
    with Checkpointer(str(root), RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
    _taken_aside(path)  # the commit, taken aside by a killed delete
    monkeypatch.setattr(local_cas, "ASIDE_SETTLED_S", 0.0)  # a minute later

    report = gc(FaultyStore(open_store(str(root))), grace="0")
    assert report.skipped is None and report.restored == [key] and report.deleted == []
    assert not list(root.rglob(".*.aside-*"))
    with Checkpointer(str(root), RUN, restore_rng=False) as ck:
        assert ck.verify(1).ok


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"(dir)" for p in root.rglob("*")}


@pytest.mark.parametrize("lock", [GC_LOCK, PROMOTIONS.lock])
def test_a_dry_run_with_a_lock_taken_aside_writes_nothing_and_lists_what_gc_then_deletes(tmp_path, monkeypatch, lock):
    """A lock a killed release took aside: the dry run settles nothing (every file, the
    aside one too, byte for byte as before) and lists what the gc after it deletes."""
    root = tmp_path / "store"
    with Checkpointer(str(root), RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
        ck.save(2, tagged_state(2))
    (root / fmt.manifest_key(RUN, 2)).unlink()  # step 2's chunks: garbage
    _release_killed_after_taking_over(root, lock, tmp_path)
    monkeypatch.setattr(local_cas, "ASIDE_SETTLED_S", 0.0)  # a minute later
    later = time.time() + 7200  # every chunk is older than the grace
    before = _files(root)

    dry = gc(open_store(str(root)), grace="1h", now=later, dry_run=True)
    assert _files(root) == before
    assert dry.skipped is None and dry.restored == [] and any(k.startswith("chunks/") for k, _ in dry.deleted)
    real = gc(open_store(str(root)), grace="1h", now=later)
    assert (real.skipped, real.restored, sorted(real.deleted)) == (dry.skipped, dry.restored, sorted(dry.deleted))
    assert not list(root.rglob(".*.aside-*")) and not open_store(str(root)).exists(lock)
    with Checkpointer(str(root), RUN, restore_rng=False) as ck:
        assert ck.verify(1).ok


@pytest.mark.parametrize("lock", [GC_LOCK, PROMOTIONS.lock])
def test_a_lock_taken_aside_moments_ago_does_not_stop_gc(tmp_path, lock):
    """A lock a killed release took aside less than a minute ago made gc (and its dry run)
    sweep nothing: 'cannot tell whether it is a commit whose data must stay'. A lock aside
    is never put back, so gc sweeps and leaves it to a later gc, which removes it."""
    root = tmp_path / "store"
    with Checkpointer(str(root), RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
        ck.save(2, tagged_state(2))
    (root / fmt.manifest_key(RUN, 2)).unlink()  # step 2's chunks: garbage
    _release_killed_after_taking_over(root, lock, tmp_path)  # moments ago: too young to settle
    later = time.time() + 7200  # every chunk is older than the grace

    dry = gc(open_store(str(root)), grace="1h", now=later, dry_run=True)
    assert dry.skipped is None and any(k.startswith("chunks/") for k, _ in dry.deleted), dry.skipped
    real = gc(open_store(str(root)), grace="1h", now=later)
    assert (real.skipped, real.restored, sorted(real.deleted)) == (None, [], sorted(dry.deleted))
    assert len(list(root.rglob(".*.aside-*"))) == 1 and not open_store(str(root)).exists(lock)  # left as it was
    with Checkpointer(str(root), RUN, restore_rng=False) as ck:
        assert ck.verify(1).ok


def _taken_aside(path: Path) -> Path:
    """``path`` renamed as a conditional delete of another version (one retention expired)
    leaves it when killed after its rename: the aside file."""
    other = hashlib.sha256(b"the version retention expired").hexdigest()
    aside = path.parent / f".{path.name}.aside-{other}-{'0' * 32}"
    path.rename(aside)
    return aside
