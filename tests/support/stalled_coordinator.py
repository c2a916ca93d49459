"""Child process of dcp/test_stalled_coordinator.py: one rank of a two-rank gloo save of
step 1 whose coordinator stops itself (SIGSTOP, as a cgroup freezer or a
debugger does) at one store call; the test runs GC while it is stopped, then resumes it.

usage: stalled_coordinator.py STORE PORT RANK STOP_AT DEAD_AFTER BLOCKING

STOP_AT: ``rank-record`` (before rank 0 puts its rank record: rank 1 writes meanwhile) or
``commit`` (before the put of the manifest, after the lease was checked). ``DEAD_AFTER``:
the lease timeout (seconds) of this test's processes, so that GC judges the stopped save
dead in seconds. ``BLOCKING``: ``blocking`` or ``async`` (the commit in the background).
Prints ``committed`` or ``failed: <error>`` last.
"""

from __future__ import annotations

import signal
import sys
import threading

import torch
import torch.distributed as dist

from ckptflow import Checkpointer, open_store
from ckptflow.chunks import leases
from ckptflow.format import layout as fmt
from ckptflow.store.base import Buffers
from support.faulty_store import FaultyStore

RUN = "stalled"


class StopsItself(FaultyStore):
    """The store of a process that stops (SIGSTOP) at its first ``put_if_absent`` of a key
    ``stop_at`` names, and goes on from there when the test sends SIGCONT."""

    def __init__(self, inner, stop_at: str):
        super().__init__(inner)
        self.stop_at, self.stopped = stop_at, False

    def put_if_absent(self, key: str, data: Buffers) -> bool:
        named = "/ranks/" in key if self.stop_at == "rank-record" else key == fmt.manifest_key(RUN, 1)
        if named and not self.stopped:
            self.stopped = True
            print("stopping", flush=True)
            # at this thread: sent to the process, another thread may take it while this one goes on
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        return super().put_if_absent(key, data)


def main() -> None:
    root, port, rank, stop_at, dead_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    blocking = sys.argv[6] == "blocking"
    leases.DEAD_AFTER, leases.HEARTBEAT = float(dead_after), float(dead_after) / 20
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    store = open_store(root)
    if rank == 0:
        store = StopsItself(store, stop_at)
    state = {f"w{rank}": torch.arange(4096, dtype=torch.float32) + rank}
    try:
        with Checkpointer(store, run=RUN, chunk_bytes=4096, threads=2) as ck:
            saved = ck.save(1, state, blocking=blocking)
            if not blocking:
                saved.wait()
        print("committed", flush=True)
    except BaseException as e:  # DCP's CheckpointException is not an Exception
        print(f"failed: {type(e).__name__}: {e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
