"""Child process for store/test_interrupted_deletes.py: a conditional delete SIGKILLed
between its rename and its link back.

usage: killed_delete.py STORE KEY EXPECTED [REPLACEMENT]

``delete_if(KEY, EXPECTED)`` on a local store whose disk, at the rename that takes KEY
aside, first puts the bytes of the file REPLACEMENT (if given) in KEY's place (a
concurrent re-commit: the expected version deleted, another created, between the delete's
compare and its rename), then renames, then kills this process: the rename has taken the
other version aside, and the link back never comes.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for support.*

from ckptflow.store.disk import Disk
from ckptflow.store.local import LocalStore


class KilledAfterRename(Disk):
    def __init__(self, target: str, replacement: bytes | None):
        super().__init__()
        self.target, self.replacement = target, replacement

    def rename(self, src: str, dst: str) -> None:
        if src != self.target:
            super().rename(src, dst)
            return
        if self.replacement is not None:
            os.unlink(src)
            with open(src, "xb") as f:
                f.write(self.replacement)
        super().rename(src, dst)
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    root, key, expected = sys.argv[1:4]
    replacement = Path(sys.argv[4]).read_bytes() if len(sys.argv) > 4 else None
    target = os.path.join(os.path.realpath(root), *key.split("/"))
    store = LocalStore(root, disk=KilledAfterRename(target, replacement))
    store.delete_if(key, expected)
    raise SystemExit(f"the delete of {key} was never killed")


if __name__ == "__main__":
    main()
