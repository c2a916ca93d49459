"""Child process of catalog/test_gc_stalled.py: a GC (grace 0) that stops itself (SIGSTOP)
right before it deletes its first chunk; the test saves while it is stopped, then resumes it.

usage: stalled_gc.py STORE DEAD_AFTER

``DEAD_AFTER``: the lock timeout (seconds) of this test's processes. Prints ``gc done`` or
``gc failed: <error>`` last.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from ckptflow import gc, open_store
from ckptflow.chunks import leases
from ckptflow.store.base import Store
from support.faulty_store import FaultyStore


class StopsBeforeAChunkDelete(FaultyStore):
    def __init__(self, inner: Store):
        super().__init__(inner)
        self.stopped = False

    def delete(self, key: str) -> None:
        if key.startswith("chunks/") and not self.stopped:
            self.stopped = True
            print("stopping", flush=True)
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        return super().delete(key)


def main() -> None:
    leases.DEAD_AFTER = float(sys.argv[2])
    leases.HEARTBEAT = leases.DEAD_AFTER / 20
    try:
        report = gc(StopsBeforeAChunkDelete(open_store(sys.argv[1])), grace=0, now=time.time() + 5, wait=0)
        print(f"gc done: {report.deleted}", flush=True)
    except Exception as e:
        print(f"gc failed: {e}", flush=True)


if __name__ == "__main__":
    main()
