"""The one check every file an import or export reads passes before it is opened, and the
one bounded read of a JSON file given with it (a model's config.json, a sidecar).

Opening a FIFO blocks until some process writes to it, and a character device can be
read forever: an import of a directory holding one (a shard named in an index, a DCP data
file, a sidecar) would hang without a word. Only regular files are opened.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

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


def read_json_file(path: str | os.PathLike, *, limit: int, what: str = "") -> Any:
    """The JSON value in ``path``, refused unread above ``limit`` bytes; ``what`` names where
    the path came from in errors (``"--config "``)."""
    check_regular_file(path)
    name = f"{what}{os.fspath(path)}"
    if os.path.getsize(path) > limit:
        raise CkptflowError(f"{name} is larger than {limit} bytes; refused unread")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, ValueError) as e:
        raise CkptflowError(f"{name} is not valid JSON ({e})") from None
    except RecursionError:
        raise CkptflowError(f"{name} nests deeper than any JSON ckptflow reads; it is corrupt or hostile") from None
    except OSError as e:
        raise CkptflowError(f"cannot read {name}: {e}") from None
