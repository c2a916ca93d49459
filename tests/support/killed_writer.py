"""Child process for catalog/test_gc.py: a save SIGKILLed at a chosen write.

usage: killed_writer.py STORE RUN WHERE

Commits step 1 (tag 1), then saves step 2 (tag 2) through a disk that kills this process
once it has written (and fsynced) the first temp file of WHERE ("rank record" or "manifest"),
before that temp file is linked into place: what a job killed mid-save leaves.
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


class KilledAfter(Disk):
    """Kills the process after the first temp file written in a directory ``matches``."""

    def __init__(self, matches):
        super().__init__()
        self.matches = matches

    def write_new(self, path, parts):
        super().write_new(path, parts)
        if self.matches(os.path.dirname(path)):
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    root, run, where = sys.argv[1:4]
    with Checkpointer(root, run, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
    step_dir = os.path.join(os.path.realpath(root), "runs", run, "checkpoints", f"{2:012d}")
    matches = {
        "rank record": lambda d: d == os.path.join(step_dir, "ranks"),
        "manifest": lambda d: d == step_dir,
    }[where]
    ck = Checkpointer(LocalStore(root, disk=KilledAfter(matches)), run, chunk_bytes=CHUNK)
    ck.save(2, tagged_state(2), kind="full")
    raise SystemExit(f"the save of step 2 never wrote a temp file of its {where}")


if __name__ == "__main__":
    main()
