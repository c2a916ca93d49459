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

from ckptflow.store import local_root
from ckptflow.store.local import resolved_root

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


def os_error_text(error: OSError, *, command: str | None, store: str | None = None, out: str | None = None) -> str:
    """An error of the operating system's that no ckptflow message explains, as what failed
    and where; where it was refused (a read-only file system, or access), what to do, by the
    refused path (``_refused_where``): export's output ``out`` (written, even inside the
    store), the store ``store`` (the command's ROOT) or a directory above it that it would be
    created in, or another path (import's source). A command that only reads the store is
    not sent to find write access to it."""
    text = f"{error.strerror or error}" + (f": {error.filename}" if error.filename else "")
    if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
        return text
    root = local_root(store) if store else None
    where = _refused_where(os.fsdecode(error.filename) if error.filename else None, root, out)
    if error.errno == errno.EROFS:  # no user may write there: permissions are not the answer
        todo = {
            "out": "pass an --out on a writable one",
            "above": f"give a ROOT on a writable one (the store root {root} would be created there)",
            "store": "use a store on a writable one (or a writable copy of it)",
            "other": "give a path on a writable one",
        }[where]
        return text + f"; the file system is mounted read-only: {todo}"
    if where == "out":
        return text + "; export writes its --out there: pass an --out it may write, or fix that directory's permissions"
    if where == "above":
        return text + (
            f"; the store root {root} would be created there, which this user may not do: give a ROOT it may create, "
            "or fix that directory's permissions"
        )
    if where == "other":
        return text + (
            "; this user may not access that path: give one it may use (import's source), or fix its permissions"
        )
    if command in STORE_WRITERS:
        return text + (
            "; this command needs write access there (gc, import and repair write to the store; ls, stats, verify "
            "and export only read it): run it as a user who may write to the store, or on a writable copy"
        )
    return text + f"; {command or 'this command'} only reads the store: run it as a user who may read the store"


def _refused_where(path: str | None, root: str | None, out: str | None) -> str:
    """Whose a refused path is: "out" (export's output, in it, or its temp beside it,
    ``out.tmp-…``: checked first, for an --out inside the store), "store" (in the local
    store ``root``, or no path named), "above" (a directory above ``root``, which the
    command would create), or "other"."""
    if path is None:
        return "store"
    path = resolved_root(path)
    if out is not None:
        out = resolved_root(out)
        beside = os.path.dirname(path) == os.path.dirname(out) and os.path.basename(path).startswith(
            os.path.basename(out) + "."
        )
        if beside or _within(path, out):
            return "out"
    if root is not None and _within(path, root):
        return "store"
    return "above" if root is not None and _within(root, path) else "other"


def _within(path: str, directory: str) -> bool:
    """Whether the resolved ``path`` is the resolved ``directory`` or below it."""
    return os.path.commonpath([directory, path]) == directory
