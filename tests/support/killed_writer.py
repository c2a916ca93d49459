"""Child process for catalog/test_gc.py: a save SIGKILLed at a chosen write.

usage: killed_writer.py STORE RUN WHERE

Commits step 1 (tag 1), then saves step 2 (tag 2) through a disk that kills this process
at WHERE: once it has written (and fsynced) the first temp file of the "rank record" or
the "manifest", before linking it into place, or once it has made the "step directory",
before writing anything in it. What a job killed mid-save leaves.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for support.*

from ckptflow import Checkpointer
from ckptflow.store.disk import Disk
from ckptflow.store.local import LocalStore
from support.states import CHUNK, tagged_state


class KilledAt(Disk):
    """Kills the process after the first ``op`` ("write_new": a temp file; "mkdir") in, or
    of, the directory ``at``."""

    def __init__(self, op: str, at: str):
        super().__init__()
        self.op, self.at = op, at

    def _reached(self, op: str, directory: str) -> None:
        if op == self.op and directory == self.at:
            os.kill(os.getpid(), signal.SIGKILL)

    def write_new(self, path, parts):
        super().write_new(path, parts)
        self._reached("write_new", os.path.dirname(path))

    def mkdir(self, path):
        super().mkdir(path)
        self._reached("mkdir", path)


def main() -> None:
    root, run, where = sys.argv[1:4]
    with Checkpointer(root, run, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
    step_dir = os.path.join(os.path.realpath(root), "runs", run, "checkpoints", f"{2:012d}")
    op, at = {
        "rank record": ("write_new", os.path.join(step_dir, "ranks")),
        "manifest": ("write_new", step_dir),
        "step directory": ("mkdir", step_dir),
    }[where]
    ck = Checkpointer(LocalStore(root, disk=KilledAt(op, at)), run, chunk_bytes=CHUNK)
    ck.save(2, tagged_state(2), kind="full")
    raise SystemExit(f"the save of step 2 was never killed at its {where}")


if __name__ == "__main__":
    main()
