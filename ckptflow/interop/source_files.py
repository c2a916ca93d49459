"""The one check every file an import or export reads passes before it is opened, the
one bounded read of a JSON file given with it (a model's config.json, a sidecar), and the
one bound on how many tensors a source may name (``check_name_count``).

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

# Tensors one import may name. The largest real checkpoints name a few hundred thousand (a
# trillion-parameter MoE with its optimizer's moments); each name costs the import and its save
# kilobytes of memory whatever its size, while a source names one in tens of bytes or fewer.
MAX_NAMES = 1 << 20
MAX_JSON_BYTES = 64 << 20  # a config.json or sidecar an import or export reads


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


def check_name_count(
    count: int,
    where: str,
    *,
    error: type[CkptflowError] = CkptflowError,
    what: str = "tensors",
    advice: str = "Import it in parts, each a checkpoint of its own, if that many are meant",
) -> None:
    """Refuse a source naming more than ``MAX_NAMES`` tensors (or ``what``: the pieces of DCP's
    tensors, each a tensor read, with what to do instead: ``advice``), before anything is
    allocated per name. The bytes on disk do
    not bound it: an empty tensor holds no data, and its name costs about 50 bytes of a
    safetensors header, or 10 of DCP metadata that points every name at one pickled
    description, but kilobytes once imported and saved (a tensor object, a manifest entry): a
    12 MB header of 200,000 empty tensors took 1.6 GB and 17 s to import."""
    if count > MAX_NAMES:
        raise error(
            f"{where} names {count} {what}, more than the {MAX_NAMES} one import takes (each costs the import "
            f"and its checkpoint memory whatever its size, an empty one too); refused before reading them. {advice}"
        )
