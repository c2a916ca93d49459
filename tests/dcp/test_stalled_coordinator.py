"""A two-rank gloo save whose coordinator is stopped (SIGSTOP: not killed, so its lease's
holder is not gone, only unrenewed) while a GC with grace 0 runs in this process, then
resumed: whatever the save then does, no committed manifest names a chunk or rank record
that GC swept. The lease timeout is cut to seconds in every process (``DEAD_AFTER``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptflow import gc, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import leases
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from support.child_env import child_env
from support.dist_workers import free_port
from support.stalled_coordinator import RUN

TESTS = Path(__file__).resolve().parents[1]
DEAD_AFTER = 3.0


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def _missing(root: Path) -> list[str]:
    """What a committed manifest of ``root`` names that is not stored."""
    store = open_store(str(root))
    missing = []
    for item in catalog.committed(store):
        assert isinstance(item, Manifest), item
        missing += [fmt.chunk_key(d) for d in item.chunks if not store.exists(fmt.chunk_key(d))]
        missing += [k for k in item.rank_keys() if not store.exists(k)]
    return missing


@pytest.mark.parametrize(
    ("stop_at", "blocking"), [("rank-record", "blocking"), ("commit", "blocking"), ("commit", "async")]
)
def test_a_coordinator_stopped_past_its_lease_while_gc_sweeps_commits_nothing_swept(
    tmp_path, monkeypatch, stop_at, blocking
):
    """Stopped before its rank record (rank 1 writes meanwhile, under no lease of its own)
    or after its lease was checked, before the manifest's put: GC judges the lease dead and
    sweeps the save's chunks. The save used to commit in the second case a manifest whose
    chunks and rank records were gone (the lease was checked only before the commit), an
    async save's background commit as a blocking one."""
    monkeypatch.setattr(leases, "DEAD_AFTER", DEAD_AFTER)
    root = tmp_path / "store"
    port = free_port()
    script = str(TESTS / "support" / "stalled_coordinator.py")
    ranks = [
        subprocess.Popen(
            [sys.executable, script, str(root), str(port), str(rank), stop_at, str(DEAD_AFTER), blocking],
            env=child_env(TESTS.parent, TESTS),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while not _stopped(ranks[0].pid):
            assert ranks[0].poll() is None and time.monotonic() < deadline, "rank 0 never reached its stop"
            time.sleep(0.05)
        time.sleep(1.5 * DEAD_AFTER)  # its lease goes unrenewed: GC judges the save dead
        report = gc(open_store(str(root)), grace=0, now=time.time() + 5, wait=0)
        assert report.dead_leases and report.deleted, report  # the save's chunks went
        ranks[0].send_signal(signal.SIGCONT)
        outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.send_signal(signal.SIGCONT)
                rank.kill()
                rank.wait()
    missing = _missing(root)
    assert missing == [], f"committed, naming {len(missing)} swept object(s): {outputs}"
    last = outputs[0].strip().splitlines()[-1]
    assert last.startswith("failed:") and "nothing was committed" in last, outputs
    assert not open_store(str(root)).exists(fmt.manifest_key(RUN, 1))
