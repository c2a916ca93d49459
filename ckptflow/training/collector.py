"""Python's cyclic garbage collector paused while a blocking save or a restore runs.

Such an operation builds tens of thousands of short- and long-lived containers (the
manifest's JSON and its parsed index, DCP's plan, one future per chunk), none of them in
a cycle, and each 700 of them set off a collection; every tenth of those walks the young
objects again, and the oldest generation, walked in full now and then, holds everything
the process imported (torch, and Dagster in the lifecycle's processes). At 2,400 tensors
that was 0.3 to 0.4 s of a 1.3 s restore. The collector is paused only for the
operation's own span, while the training loop waits for it (a save's included wait for the
previous async save), not during an async save's background write once ``save`` has returned;
what became garbage meanwhile is collected at its next turn after.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_holders = 0  # operations in progress in this process (a restore may overlap an async save's commit)
_resume = False  # whether the collector ran when the first of them began


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the collector (if it runs) until the last overlapping caller is done; also a
    decorator (``@collector_paused()``)."""
    global _holders, _resume
    with _lock:
        if _holders == 0:
            _resume = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _resume:
                gc.enable()
