"""Faults of a local store found by trying to break it: symbolic links, two writers on one
step, unreadable objects, a full disk, a FIFO where an object belongs, a root that is a file."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptflow import Checkpointer, CheckpointExistsError, StoreUnavailableError, gc, open_store
from ckptflow.catalog import listing as catalog_listing
from ckptflow.errors import StoreFullError, StoreNotFoundError, SymlinkError
from ckptflow.format import layout as fmt
from ckptflow.store.disk import Disk
from ckptflow.store.local import LocalStore
from support.child_env import child_env
from support.cli import run_cli
from support.corrupt import chunk_path, flip_byte, only_in
from support.faulty_store import FaultyStore
from support.states import CHUNK, blank_state, state_tag, tagged_state

REPO = Path(__file__).resolve().parents[2]


def two_runs(root: Path) -> None:
    for run in ("a", "b"):
        with Checkpointer(str(root), run, chunk_bytes=CHUNK) as ck:
            ck.save(1, tagged_state(2 if run == "a" else 3))


def chunk_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in (root / "chunks").rglob("*") if p.is_file()}


# ---- one rule for symbolic links: never followed inside a store ---------------------------
def test_a_run_moved_elsewhere_and_linked_back_is_refused_everywhere_and_never_swept(tmp_path, capsys):
    root = tmp_path / "store"
    two_runs(root)
    shutil.move(root / "runs" / "b", tmp_path / "other-disk-b")
    os.symlink(tmp_path / "other-disk-b", root / "runs" / "b")
    before = chunk_files(root)
    code, out, err = run_cli(capsys, "ls", str(root))
    assert code == 0 and out.splitlines()[1].split()[0] == "a"
    assert "run b" in err and "symbolic link" in err
    with Checkpointer(str(root), "b") as ck:
        state = blank_state()
        with pytest.raises(StoreUnavailableError, match="symbolic link"):
            ck.restore(state)
        assert state["epoch"] is None
    report = gc(str(root), grace=0)
    assert report.skipped and "runs/b" in report.skipped and chunk_files(root) == before
    code, _, err = run_cli(capsys, "gc", str(root), "--grace", "1h")
    assert code == 1 and "symbolic link" in err


@pytest.mark.parametrize("moved", ["run", "step"])
def test_a_link_whose_disk_is_not_mounted_is_still_refused_and_never_swept(tmp_path, moved):
    """A run (or a step) moved to another disk and linked back, while that disk is not
    mounted: the link points nowhere, but what it held is still the run's. GC must refuse
    as it does while the disk is there, never take the run for absent and sweep its chunks."""
    root = tmp_path / "store"
    two_runs(root)
    inside = root / "runs" / "b" if moved == "run" else root / fmt.step_prefix("b", 1).rstrip("/")
    shutil.move(inside, tmp_path / "other-disk")
    os.symlink(tmp_path / "other-disk", inside)
    (tmp_path / "other-disk").rename(tmp_path / "other-disk-unmounted")
    before = chunk_files(root)
    report = gc(str(root), grace=0)
    assert report.skipped and "symbolic link" in report.skipped, report
    assert chunk_files(root) == before


def test_a_save_never_writes_through_a_link_out_of_the_root(tmp_path):
    root = tmp_path / "store"
    two_runs(root)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "runs" / "a" / "checkpoints" / fmt.step_prefix("a", 5).split("/")[-2])
    with Checkpointer(str(root), "a", chunk_bytes=CHUNK) as ck, pytest.raises(SymlinkError, match="symbolic link"):
        ck.save(5, tagged_state(5))
    assert list(outside.iterdir()) == []


def test_a_store_root_that_is_a_link_is_fine(tmp_path):
    real = tmp_path / "real"
    two_runs(real)
    os.symlink(real, tmp_path / "link")
    with Checkpointer(str(tmp_path / "link"), "a") as ck:
        state = blank_state()
        assert ck.restore(state).step == 1 and state_tag(state) == 2


def test_a_manifest_that_is_a_link_loop_is_that_checkpoints_problem(tmp_path, capsys):
    root = tmp_path / "store"
    with Checkpointer(str(root), "a", chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(2))
        ck.save(2, tagged_state(3))
    manifest = root / fmt.manifest_key("a", 2)
    manifest.unlink()
    os.symlink(manifest, manifest)  # ELOOP if followed
    code, out, err = run_cli(capsys, "verify", str(root), "--run", "a", "--all")
    assert any(line.startswith("run a step 2:") and "symbolic link" in line for line in out.splitlines())
    assert code == 3 and "none of them proof of damage" in err  # a link is not read, so it proves nothing
    code, out, err = run_cli(
        capsys, "export", str(root), "--run", "a", "--out", str(tmp_path / "m.safetensors"), "--key", "model"
    )
    assert code == 3 and out == "" and "run 'a' step 2" in err and "symbolic link" in err  # no fallback: as restore


# ---- two writers on one step --------------------------------------------------------------
def test_the_loser_of_two_writers_never_spoils_the_winners_checkpoint(tmp_path):
    inner = open_store(str(tmp_path / "store"))
    for step in range(1, 6):
        loser = _race(inner, step)
        assert isinstance(loser, CheckpointExistsError)
        with Checkpointer(inner, "r", restore_rng=False) as ck:
            state = blank_state()
            assert ck.restore(state, step=step).step == step and state_tag(state) == 5


def _race(inner, step: int):
    """Both writers have written their chunks and rank records (the loser's last, over the
    winner's where the names collide) before either commits; the winner commits first.
    What the loser's save raised."""
    views = [FaultyStore(inner), FaultyStore(inner)]
    pauses = [v.pause_before("put_if_absent", lambda key: key == fmt.manifest_key("r", step)) for v in views]
    results: list[list] = [[], []]
    threads = [
        threading.Thread(target=lambda i=i, tag=tag: results[i].append(_save(views[i], step, tagged_state(tag))))
        for i, tag in ((0, 5), (1, 4))
    ]
    for thread, pause in zip(threads, pauses):
        thread.start()
        assert pause.reached.wait(30)
    for thread, pause in zip(threads, pauses):
        pause.release()
        thread.join(30)
    assert results[0][0].step == step  # the winner's save returned success
    return results[1][0]


def _save(store, step, state):
    try:
        with Checkpointer(store, "r", chunk_bytes=CHUNK) as ck:
            return ck.save(step, state)
    except Exception as e:
        return e


# ---- unreadable objects: reported per checkpoint, the rest goes on -----------------------
def _cli_without_root_privileges(*args: str) -> subprocess.CompletedProcess:
    """The CLI with the permission checks an ordinary user gets (root bypasses them)."""
    prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    code = "import sys; from ckptflow.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [*prefix, sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=child_env(REPO),
        timeout=120,
    )


@pytest.mark.skipif(os.geteuid() == 0 and not shutil.which("setpriv"), reason="needs setpriv to drop root's override")
def test_a_denied_chunk_is_that_checkpoints_problem_for_verify_and_export(tmp_path):
    root = tmp_path / "store"
    with Checkpointer(str(root), "a", chunk_bytes=CHUNK) as ck:
        ck.save(1, {"model": tagged_state(2)["model"]})
        ck.save(2, {"model": tagged_state(3)["model"]})
    denied = chunk_path(root, only_in(root, "a", 2, 1)[0])
    denied.chmod(0)
    verify = _cli_without_root_privileges("verify", str(root), "--run", "a", "--all")
    assert verify.returncode == 3 and "none of them proof of damage" in verify.stderr, verify.stderr
    assert any(line.startswith("run a step 2:") and "Permission denied" in line for line in verify.stdout.splitlines())
    out = tmp_path / "m.safetensors"
    export = _cli_without_root_privileges("export", str(root), "--run", "a", "--out", str(out))
    # a denied read proves nothing: export stops at step 2, naming the object, rather than export step 1
    assert export.returncode == 3 and export.stdout == "", export.stderr
    assert "run 'a' step 2" in export.stderr and "Permission denied" in export.stderr and denied.name in export.stderr
    assert not out.exists() and not list(tmp_path.glob("m.safetensors*"))
    export = _cli_without_root_privileges("export", str(root), "--run", "a", "--step", "1", "--out", str(out))
    assert export.returncode == 0 and "step 1" in export.stdout, export.stderr


@pytest.mark.skipif(os.geteuid() == 0 and not shutil.which("setpriv"), reason="needs setpriv to drop root's override")
def test_export_passes_over_a_damaged_step_and_stops_at_a_denied_one(tmp_path):
    root = tmp_path / "store"
    with Checkpointer(str(root), "a", chunk_bytes=CHUNK) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"model": tagged_state(step + 1)["model"]})
    flip_byte(chunk_path(root, only_in(root, "a", 3, 1, 2)[0]))
    out = tmp_path / "m.safetensors"
    export = _cli_without_root_privileges("export", str(root), "--run", "a", "--out", str(out))
    assert export.returncode == 0 and "step 2" in export.stdout, export.stderr
    assert "run a step 3 does not verify" in export.stderr and "does not match its address" in export.stderr
    out.unlink()
    chunk_path(root, only_in(root, "a", 2, 1, 3)[0]).chmod(0)
    export = _cli_without_root_privileges("export", str(root), "--run", "a", "--out", str(out))
    assert export.returncode == 3 and "run 'a' step 2" in export.stderr and "Permission denied" in export.stderr
    assert not out.exists()


# ---- a full disk ----------------------------------------------------------------------------
def test_a_full_disk_leaves_no_temp_file_and_says_what_the_save_needed(tmp_path, monkeypatch):
    root = tmp_path / "store"
    with Checkpointer(str(root), "a", chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(2))
    real_fsync = os.fsync
    chunk_writes = {"left": 3}

    def full(fd):  # the disk fills up while the fourth chunk file is flushed
        if "/chunks/" in os.readlink(f"/proc/self/fd/{fd}"):
            chunk_writes["left"] -= 1
            if chunk_writes["left"] < 0:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr("ckptflow.store.disk.os.fsync", full)
    with Checkpointer(str(root), "a", chunk_bytes=CHUNK) as ck, pytest.raises(StoreFullError) as err:
        ck.save(2, tagged_state(3))
    message = str(err.value)
    assert "run 'a' step 2" in message and str(root) in message and "no space left" in message
    assert "needs up to" in message and err.value.needed == sum(
        t.numel() * t.element_size()
        for t in (tagged_state(3)["model"]["shared"], tagged_state(3)["model"]["w"], tagged_state(3)["z"])
    )
    assert not [p for p in root.rglob(".tmp-*")]
    assert catalog_listing.committed_steps(open_store(str(root)), "a") == [1]


# ---- what is not a regular file is no object ----------------------------------------------
@pytest.mark.parametrize("below", ["", "/sub"])
def test_a_store_root_that_is_a_file_is_refused_saying_so(tmp_path, below):
    """It was "[Errno 17] File exists" (from makedirs), naming no store root."""
    (tmp_path / "x.pt").write_bytes(b"a model, not a store")
    root = f"{tmp_path / 'x.pt'}{below}"
    with pytest.raises(StoreNotFoundError, match=r"store root .*x\.pt.* is a file, not a directory"):
        Checkpointer(root, "r")
    assert (tmp_path / "x.pt").read_bytes() == b"a model, not a store"


@pytest.mark.parametrize("where", ["chunk", "manifest"])
def test_a_fifo_where_an_object_belongs_is_no_object_and_never_blocks_a_reader(tmp_path, where):
    """open() of a FIFO waits for a writer forever: a restore hung. Now it is read as
    missing: the chunk's checkpoint is damaged (restore falls back), the manifest's step
    is not committed."""
    root = tmp_path / "store"
    with Checkpointer(str(root), "r", chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
        ck.save(2, tagged_state(2))
    path = chunk_path(str(root), only_in(str(root), "r", 2)[0]) if where == "chunk" else root / fmt.manifest_key("r", 2)
    os.unlink(path)
    os.mkfifo(path)
    key = str(Path(path).relative_to(root))
    assert not open_store(str(root)).exists(key)  # as reads and listings see it
    script = (
        "import sys\n"
        "from ckptflow import Checkpointer\n"
        "from support.states import blank_state, state_tag\n"
        f"with Checkpointer({str(root)!r}, 'r') as ck:\n"
        "    state = blank_state()\n"
        "    result = ck.restore(state)\n"
        "    print(result.step, state_tag(state), ck.verify(1).ok, [c.step for c in ck.list()])\n"
    )
    env = child_env(REPO, REPO / "tests")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    listed = "[1, 2]" if where == "chunk" else "[1]"
    assert done.stdout.strip() == f"1 1 True {listed}"


def test_a_refused_conditional_delete_never_takes_the_object_away(tmp_path):
    """``delete_if`` with a version that is not there leaves the object in place throughout:
    taken aside and linked back, it was missing for a moment to every reader (a restore saw
    no commit, a save saw no GC lock, a lock's holder thought it taken over)."""

    class Renames(Disk):
        def __init__(self) -> None:
            super().__init__(fsync=False)
            self.renamed: list[str] = []

        def rename(self, src: str, dst: str) -> None:
            self.renamed.append(os.path.relpath(src, tmp_path))
            super().rename(src, dst)

    disk = Renames()
    store = LocalStore(str(tmp_path), disk=disk)
    store.put_if_absent("locks/gc.json", b"the new holder's lock")
    assert store.delete_if("locks/gc.json", "0" * 64) is False
    assert disk.renamed == [] and store.get("locks/gc.json") == b"the new holder's lock"
    assert store.delete_if("locks/gc.json", store.get_versioned("locks/gc.json")[1]) is True
    assert disk.renamed == ["locks/gc.json"] and not store.exists("locks/gc.json")


class NoHardLinks(Disk):
    """A filesystem without hard links (some network and FUSE filesystems): ``link`` is refused,
    so create-only writes take the claim-and-rename path. ``before_unlink`` runs first thing in
    the next unlink of ``target``: what another process does between a rename and that unlink."""

    def __init__(self) -> None:
        super().__init__(fsync=False)
        self.target: str | None = None
        self.before_unlink = lambda: None

    def link(self, src: str, dst: str) -> None:
        raise OSError(errno.EPERM, "Operation not permitted", dst)

    def unlink(self, path: str) -> None:
        if path == self.target:
            self.target = None
            self.before_unlink()
        super().unlink(path)


@pytest.mark.parametrize("claim_age_s", [0, 120])
def test_without_hard_links_a_gc_before_the_claim_goes_fails_no_create(tmp_path, claim_age_s):
    """A GC with grace 0 runs once a create-only put has renamed its object into place and
    before it removes its claim (a sweep that listed the claim as the put began): a live claim (age 0)
    is left alone, since without it a second writer could claim and rename over the first;
    one that outlived ``CLAIM_STALE_S`` (a writer stalled 2 minutes) is swept, and the put
    still succeeds. GC used to sweep the live claim, and the put then raised
    FileNotFoundError from removing it although its object was in place: a committed
    manifest reported as a failed save."""
    disk = NoHardLinks()
    store = LocalStore(str(tmp_path), disk=disk)
    key = "runs/r/records/record.json"
    path = str(tmp_path / key)
    swept: list = []

    def gc_in_the_window() -> None:
        claim = path + ".claim"
        assert os.path.exists(claim) and os.path.exists(path)
        if claim_age_s:
            then = time.time() - claim_age_s
            os.utime(claim, (then, then))
        report = gc(LocalStore(str(tmp_path), disk=NoHardLinks()), grace=0, now=time.time() + 5, wait=0)
        swept.extend(k for k, _size in report.deleted)

    disk.target, disk.before_unlink = path + ".claim", gc_in_the_window
    assert store.put_if_absent(key, b"the object") is True
    assert store.get(key) == b"the object"
    assert (key + ".claim" in swept) == bool(claim_age_s)
    assert not os.path.exists(path + ".claim")
    assert store.put_if_absent(key, b"another") is False and store.get(key) == b"the object"
