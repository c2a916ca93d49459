"""How the CLI prints: aligned tables, warnings, progress bars (human units: ``ckptflow.reports.units``)."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import unquote, urlparse

PROG = "ckptflow"


def json_text(doc: Any) -> str:
    """``doc`` as strict JSON (RFC 8259) for ``--json``: a NaN or infinite number (a loss
    that diverged, recorded in metadata) becomes null, which every parser reads."""

    def finite(node: Any) -> Any:
        if isinstance(node, float) and not math.isfinite(node):
            return None
        if isinstance(node, dict):
            return {k: finite(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [finite(v) for v in node]
        return node

    return json.dumps(finite(doc), indent=2, sort_keys=True, allow_nan=False)


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def warn(message: str) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    lines = []
    for row in [headers, *rows]:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


@contextlib.contextmanager
def progress(desc: str, total: int | None = None) -> Iterator[Callable[[int], None] | None]:
    """A byte-counting tqdm bar on an interactive stderr; ``None`` (silence) otherwise."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    lock = threading.Lock()  # the callbacks come from reader/verify thread pools
    with tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        leave=False,
        dynamic_ncols=True,
    ) as bar:

        def update(n: int) -> None:
            with lock:
                bar.update(n)

        yield update


STORE_WRITERS = ("gc", "import", "repair")  # the commands that write to the store; the others only read it


def os_error_text(error: OSError, *, command: str | None, store: str | None = None) -> str:
    """An error of the operating system's that no ckptflow message explains, as what failed
    and where; where it was refused access, what to do: about the store ``store`` (the
    command's ROOT) only where the refused path is in it, or no path is named, and there
    what ``command`` needs (a command that only reads the store is not sent to find write
    access)."""
    text = f"{error.strerror or error}" + (f": {error.filename}" if error.filename else "")
    refused = error.errno in (errno.EACCES, errno.EPERM)
    if not refused and error.errno != errno.EROFS:
        return text
    if error.filename and not _within(os.fsdecode(error.filename), store):
        return text + (
            "; this user may not access that path: give one it may use (export's --out, import's source), or fix "
            "its permissions"
        )
    if error.errno == errno.EROFS or command in STORE_WRITERS:
        return text + (
            "; this command needs write access there (gc, import and repair write to the store; ls, stats, verify "
            "and export only read it): run it as a user who may write to the store, or on a writable copy"
        )
    return text + f"; {command or 'this command'} only reads the store: run it as a user who may read the store"


def _within(path: str, store: str | None) -> bool:
    """Whether ``path`` is in the local store ``store`` (a path or a file:// URL); an object
    store's paths are never local files."""
    if not store or ("://" in store and not store.startswith("file://")):
        return False
    root = os.path.abspath(unquote(urlparse(store).path) if store.startswith("file://") else store)
    return os.path.commonpath([root, os.path.abspath(path)]) == root
