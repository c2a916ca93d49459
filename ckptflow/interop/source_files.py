"""The one check every file an import reads passes before it is opened.

Opening a FIFO blocks until some process writes to it, and a character device can be
read forever: an import of a directory holding one (a shard named in an index, a DCP data
file, a sidecar) would hang without a word. Only regular files are opened.
"""

from __future__ import annotations

import os
import stat

from ckptflow.errors import CkptflowError


def check_regular_file(path: str | os.PathLike, *, error: type[CkptflowError] = CkptflowError) -> None:
    """Raise ``error`` unless ``path`` is (or links to) a regular file."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise error(f"{os.fspath(path)} does not exist") from None
    except OSError as e:
        raise error(f"cannot read {os.fspath(path)}: {e}") from None
    if not stat.S_ISREG(mode):
        raise error(
            f"{os.fspath(path)} is not a regular file (a FIFO, a device or a directory), which an import never "
            "opens: copy its bytes into a file and import that"
        )
