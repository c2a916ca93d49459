"""A GC stopped (SIGSTOP) between its last lock check and a delete, past ``DEAD_AFTER``: a
save judges its lock dead, reuses the very chunk it is about to delete, and commits; the
GC, resumed, deletes it. Nothing can bring the chunk back (the GC checks its lock before
each delete; the one in flight lands), so the GC must say which object it deleted after
losing its lock, not report a clean sweep."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ckptflow import Checkpointer, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import leases
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from support.child_env import child_env

TESTS = Path(__file__).resolve().parents[1]
DEAD_AFTER = 3.0


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_a_gc_stalled_past_its_lock_before_a_delete_names_what_it_deleted(tmp_path, monkeypatch):
    """It used to print a clean report ('gc done') while step 2, committed meanwhile, had
    lost its only chunk."""
    monkeypatch.setattr(leases, "DEAD_AFTER", DEAD_AFTER)
    monkeypatch.setattr(leases, "HEARTBEAT", DEAD_AFTER / 20)
    root = tmp_path / "store"
    state = {"w": torch.arange(1024, dtype=torch.float32)}
    with Checkpointer(str(root), run="r") as ck:
        ck.save(1, state)
    store = open_store(str(root))
    store.delete(fmt.manifest_key("r", 1))  # step 1 expired: its chunk is garbage
    sweep = subprocess.Popen(
        [sys.executable, str(TESTS / "support" / "stalled_gc.py"), str(root), str(DEAD_AFTER)],
        env=child_env(TESTS.parent, TESTS),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _stopped(sweep.pid):
            assert sweep.poll() is None and time.monotonic() < deadline, "the GC never reached its stop"
            time.sleep(0.05)
        time.sleep(1.5 * DEAD_AFTER)  # its lock goes unrenewed: the save judges the GC dead
        with Checkpointer(str(root), run="r") as ck:
            ck.save(2, state)  # the same bytes: it reuses the chunk the GC is about to delete
        sweep.send_signal(signal.SIGCONT)
        said = sweep.communicate(timeout=60)[0].strip().splitlines()[-1]
    finally:
        if sweep.poll() is None:
            sweep.send_signal(signal.SIGCONT)
            sweep.kill()
            sweep.wait()
    (committed,) = [item for item in catalog.committed(store) if isinstance(item, Manifest)]
    missing = [fmt.chunk_key(d) for d in committed.chunks if not store.exists(fmt.chunk_key(d))]
    assert said.startswith("gc failed:") and "lost its lock" in said and "'ckptflow verify'" in said, said
    assert missing and all(key in said for key in missing), (missing, said)  # the reused chunk is gone, named
