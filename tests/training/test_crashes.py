"""Fault injection: crashes at every store operation (saves and restores) and SIGKILL
mid-save; every case must leave a store whose newest commit restores whole, never a mix.

Uses tests/support/faulty_store.py (FaultyStore) to number the store operations of a save and
fail at each one in turn. GC safety (retention, grace periods, concurrent saves) is in
catalog/test_gc.py; the tagged states both files use are in tests/support/states.py.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptflow import Checkpointer, gc, open_store
from ckptflow.chunks import leases
from ckptflow.errors import StoreUnavailableError
from ckptflow.format import layout as fmt
from support.child_env import child_env
from support.faulty_store import FaultyStore, InjectedFault
from support.states import CHUNK, RUN, blank_state, state_tag, tagged_state

TESTS = Path(__file__).resolve().parents[1]


# ---- helpers ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store_with_a(tmp_path_factory) -> Path:
    """A store holding checkpoint A (step 1, tag 1), committed."""
    root = tmp_path_factory.mktemp("faults-a") / "store"
    with Checkpointer(str(root), run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(1, tagged_state(1))
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
        ck.save(2, tagged_state(2), kind=kind)
    ops = fs.mutating_log()
    total = len(ops)
    assert total == fs.ops >= 6, ops
    # The commit record is the last thing a save writes, and it is written create-only; then
    # the save's lease goes back (held from planning until the commit, so GC sweeps nothing meanwhile).
    assert ops[-2][1:] == ("put_if_absent", fmt.manifest_key(RUN, 2)), ops[-2]
    assert ops[-1][1] == "delete" and ops[-1][2].startswith(leases.LEASES), ops[-1]
    records = [
        key for _, op, key in ops if op == "put_if_absent" and key.startswith(fmt.step_prefix(RUN, 2) + "ranks/0.")
    ]
    assert len(records) == 1  # the rank record, create-only, named by the save attempt
    if kind == "incremental":  # the unchanged tensor is deduplicated (touched, not rewritten)
        assert any(op == "touch" for _, op, _key in ops)

    outcomes = []
    for n in range(total):
        root = tmp_path / f"crash-{n}"
        shutil.copytree(store_with_a, root)
        fs = FaultyStore(open_store(str(root)))
        fs.arm(n, when=when)
        ck = Checkpointer(fs, run=RUN, chunk_bytes=CHUNK, threads=4)
        released = n == total - 1  # the lease's release, after the commit: logged, and the save stands
        with contextlib.nullcontext() if released else pytest.raises(InjectedFault):
            if blocking:
                ck.save(2, tagged_state(2), kind=kind)
            else:
                ck.save(2, tagged_state(2), kind=kind, blocking=False).wait()
        assert fs.faults, f"op {n}: the armed fault never fired"

        # A fresh process's view: restore whatever the store now says is newest.
        state = blank_state()
        fresh = Checkpointer(str(root), run=RUN, restore_rng=False)
        result = fresh.restore(state)
        tag = state_tag(state)  # exactly one checkpoint's tensors and JSON, never a mix
        committed_b = released or (when == "after" and n == total - 2)
        assert (result.step, tag) == ((2, 2) if committed_b else (1, 1)), f"crash at op {n} ({ops[n][1]})"
        assert fresh.verify(result.step).ok
        assert fresh.verify(1).ok, f"crash at op {n} damaged the older checkpoint"
        fresh.close()
        outcomes.append(result.step)

        # The checkpointer whose save failed keeps working once the store does, also when
        # it saves other data under the step that failed (its leftovers must not leak in).
        fs.disarm()
        retry = 3 if committed_b else 2
        saved = ck.save(retry, tagged_state(3), kind=kind)
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
    """A read failure proves no damage: restore loads the newest checkpoint whole or raises
    ``StoreUnavailableError`` with the live state untouched; it never falls back to step 1."""
    root = tmp_path / "store"
    shutil.copytree(store_with_a, root)
    with Checkpointer(str(root), run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(2, tagged_state(2), kind="incremental")
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
        except StoreUnavailableError:
            assert state["epoch"] is None and torch.equal(state["z"], blank_state()["z"])
            continue
        assert result.step == 2 and state_tag(state) == 2
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


@pytest.mark.slow  # three savers, each starting torch, SIGKILLed mid-save: make test-e2e
@pytest.mark.timeout(120)
def test_sigkill_mid_save_always_leaves_a_restorable_store(tmp_path):
    root = tmp_path / "store"
    rng = random.Random(20240601)
    kills = []
    deadline = time.monotonic() + 75
    script = TESTS / "support" / "sigkill_saver.py"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
    )
    for attempt in range(3):
        before = committed_steps(root)
        log = open(tmp_path / f"child-{attempt}.log", "wb")
        child = subprocess.Popen(
            [sys.executable, str(script), str(root), RUN, str(SIGKILL_N), str(1 << 18)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
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
        state = {
            "w": torch.zeros(SIGKILL_N, dtype=torch.float64),
            "v": torch.zeros(SIGKILL_N, dtype=torch.float64),
            "step": -1,
        }
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
        key.startswith(("chunks/", "locks/leases/")) or "/ranks/" in key or "/.tmp-" in key or key.endswith("/")
        for key, _ in report.deleted
    )
    ck.close()
    shutil.rmtree(root)  # a few hundred MB; pytest keeps old temp dirs around


ENDS = {
    "returns": "",
    "raises": "raise RuntimeError('the training loop failed after the save returned')",
}


@pytest.mark.parametrize("end", sorted(ENDS))
def test_an_async_save_in_flight_when_the_script_ends_is_committed(tmp_path, end):
    """A script whose last call is ``save(..., blocking=False)`` (or that raises after it)
    exits with the save committed: the interpreter's exit stops thread pools, so without
    a wait at exit the save was lost without a word."""
    root = str(tmp_path / "store")
    script = (
        "import torch\n"
        "from ckptflow import Checkpointer\n"
        f"ck = Checkpointer({root!r}, {RUN!r}, codec='zstd')\n"
        "torch.manual_seed(0)\n"
        "handle = ck.save(1, {'model': torch.nn.Linear(2048, 2048).state_dict()}, blocking=False)\n"
        "print('in flight' if not handle.done() else 'done', flush=True)\n"
        f"{ENDS[end]}\n"
    )
    env = child_env(TESTS.parent)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == (1 if end == "raises" else 0), done.stderr[-2000:]
    if done.stdout.strip() == "in flight":
        assert "waiting for the async save of step 1 to commit" in done.stderr
    assert committed_steps(Path(root)) == [1]
    with Checkpointer(root, RUN) as ck:
        assert ck.verify(1).ok


def test_a_child_forked_while_an_async_save_is_in_flight_exits_at_once(tmp_path):
    """A forked child (a DataLoader worker) inherits the saves in flight but not the threads
    that finish them: waiting for them at its exit hung it for ever."""
    root = str(tmp_path / "store")
    script = (
        "import multiprocessing, time, torch\n"
        "from ckptflow import Checkpointer\n"
        f"ck = Checkpointer({root!r}, {RUN!r}, codec='zstd')\n"
        "handle = ck.save(1, {'model': torch.nn.Linear(2048, 2048).state_dict()}, blocking=False)\n"
        "child = multiprocessing.get_context('fork').Process(target=time.sleep, args=(0,))\n"
        "started = time.monotonic()\n"
        "child.start()\n"
        "child.join(30)\n"
        "print(child.exitcode, round(time.monotonic() - started, 1), flush=True)\n"
        "handle.wait()\n"
    )
    env = child_env(TESTS.parent)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    exitcode, seconds = done.stdout.split()
    assert exitcode == "0" and float(seconds) < 10, done.stdout
    assert committed_steps(Path(root)) == [1]


def test_ctrl_c_while_the_exit_waits_for_an_async_save_ends_the_process_at_once(tmp_path):
    """Ctrl-C during the wait at exit abandons the save, as the message says: returning from
    the exit hook left the interpreter joining the thread pools, which finished the save anyway."""
    root = str(tmp_path / "store")
    script = (
        "import atexit, sys, time, torch\n"
        "from ckptflow import Checkpointer\n"
        "atexit.register(lambda: print('the script exit handler ran', file=sys.stderr))\n"
        "from ckptflow.chunks.io import ChunkStore\n"
        "put = ChunkStore.put\n"
        "ChunkStore.put = lambda self, *a, **k: (time.sleep(2), put(self, *a, **k))[1]  # a slow store\n"
        f"ck = Checkpointer({root!r}, {RUN!r}, chunk_bytes=1 << 18)\n"
        "ck.save(1, {'model': torch.nn.Linear(2048, 2048).state_dict()}, blocking=False)\n"
    )
    status, seen, seconds = interrupted_at_exit(script)
    assert status == 128 + signal.SIGINT, seen[-2000:]
    assert "the async save of step 1 is abandoned, not committed" in seen
    assert "the script exit handler ran" in seen  # os._exit skipped it: it runs only after the hook
    assert seconds < 5, f"the process took {seconds:.1f} s to end after Ctrl-C: it waited for the save"
    assert committed_steps(Path(root)) == []


def test_a_save_abandoned_by_ctrl_c_at_exit_commits_nothing_while_the_exit_handlers_run(tmp_path):
    """The atexit handlers run before the process ends (one here waits for the save): the
    save went on meanwhile and committed, though the message said it was not."""
    root = str(tmp_path / "store")
    script = (
        "import atexit, sys, time, torch\n"
        "from ckptflow import Checkpointer\n"
        "from ckptflow.chunks.io import ChunkStore\n"
        "put = ChunkStore.put\n"
        "ChunkStore.put = lambda self, *a, **k: (time.sleep(1), put(self, *a, **k))[1]  # a slow store\n"
        f"ck = Checkpointer({root!r}, {RUN!r}, chunk_bytes=1 << 18)\n"
        "handle = ck.save(1, {'w': torch.randn(1 << 18)}, blocking=False)\n"
        "def outcome():\n"
        "    try:\n"
        "        handle.wait()\n"
        "        print('the save committed', file=sys.stderr)\n"
        "    except Exception as e:\n"
        "        print('the save failed:', e, file=sys.stderr)\n"
        "atexit.register(outcome)\n"
    )
    status, seen, _seconds = interrupted_at_exit(script)
    assert status == 128 + signal.SIGINT, seen[-2000:]
    assert "was abandoned at exit: not committed" in seen, seen[-2000:]
    assert committed_steps(Path(root)) == []


def interrupted_at_exit(script: str) -> tuple[int, str, float]:
    """Run ``script``, send SIGINT once its exit waits for the async save of step 1: its
    exit status, its stderr, and the seconds it took to end after the signal."""
    env = child_env(TESTS.parent)
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
    try:
        seen = ""
        while "waiting for the async save of step 1" not in seen:
            line = proc.stderr.readline()
            assert line, f"exited before waiting for the save: {seen[-2000:]}"
            seen += line
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=60)
        seconds = time.monotonic() - interrupted
        seen += proc.stderr.read()
    finally:
        proc.kill()
    return status, seen, seconds
